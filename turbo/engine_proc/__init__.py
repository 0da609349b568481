"""The engine process of ``liteturbo serve`` and its transport: what the HTTP front (:mod:`turbo.serve`) talks to.

- :mod:`~turbo.engine_proc.client`: :class:`~turbo.engine_proc.client.EngineClient`, the one protocol both clients
  implement (submit, sessions, stats, health), and the session facts both sides show;
- :mod:`~turbo.engine_proc.inproc`: :class:`~turbo.engine_proc.inproc.InprocClient`, an engine of this process;
- :mod:`~turbo.engine_proc.mp_client`: :class:`~turbo.engine_proc.mp_client.MPClient`, the front's side of an
  engine process (pyzmq);
- :mod:`~turbo.engine_proc.process`: that process's body (``python -m turbo.engine_proc.process``);
- :mod:`~turbo.engine_proc.messages`: the messages between them, one dataclass each.
"""
