"""The HTTP front of ``liteturbo serve``: the OpenAI-compatible and sessions API (:mod:`turbo.serve.app`: routes, auth,
``create_app``, ``serve``), reading requests (:mod:`~turbo.serve.protocol`; structured outputs:
:mod:`~turbo.serve.structured`), queueing and answering a request's choices (:mod:`~turbo.serve.answer`), response
shapes and server-sent events (:mod:`~turbo.serve.responses`; log-probabilities: :mod:`~turbo.serve.logprobs`),
tool calling (:mod:`~turbo.serve.tools`, :mod:`~turbo.serve.tool_grammar`, :mod:`~turbo.tool_parsers` (a level down: sessions read calls too)), Prometheus metrics (:mod:`~turbo.serve.metrics`) and the web chat
page (``static/chat.html``). The engine it serves, and the registry of its sessions
(:mod:`~turbo.engine_proc.sessions`), are reached through :mod:`turbo.engine_proc`.
"""
