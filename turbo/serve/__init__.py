"""The HTTP wing: the OpenAI-compatible and sessions API (:mod:`turbo.serve.app`: routes, auth, ``create_app``,
``serve``), reading requests (:mod:`~turbo.serve.protocol`), response shapes and server-sent events
(:mod:`~turbo.serve.responses`), the session registry (:mod:`~turbo.serve.sessions`), metrics, client and the web
chat page."""
