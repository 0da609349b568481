"""The HTTP wing: the OpenAI-compatible and sessions API (:mod:`turbo.serve.app`), its session registry, metrics,
client and the web chat page."""
