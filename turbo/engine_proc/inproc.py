"""The engine in this process as an :class:`~turbo.engine_proc.client.EngineClient`: :class:`InprocClient` drives an
:class:`~turbo.engine.Engine` with an :class:`~turbo.loop.EngineLoop` and keeps its sessions in a
:class:`~turbo.engine_proc.sessions.SessionRegistry` (``create_app(engine)``, ``liteturbo serve --no-engine-process``).
"""
from __future__ import annotations

from ..config import GenerationConfig
from ..engine import Engine
from ..loop import EngineLoop, RequestHandle
from .sessions import SessionRegistry
from .client import session_facts


class InprocClient:
    """The engine in this process: ``engine`` driven by ``loop`` (an :class:`~turbo.loop.EngineLoop`), sessions
    by id in ``sessions`` (a :class:`~turbo.engine_proc.sessions.SessionRegistry` of this engine)."""

    def __init__(self, engine: Engine, loop: EngineLoop, sessions: SessionRegistry) -> None:
        self.engine, self.loop, self.sessions = engine, loop, sessions
        self.tokenizer, self.path, self.session_len = engine.tokenizer, engine.path, engine.session_len
        self.backend_name, self.device = engine.backend.name, str(engine.platform.device)
        self.observers = loop.observers  # called with each finished request's GenerationOutput
        self.dead: str | None = None  # an engine in this process dies with it

    @property
    def running(self) -> bool:
        """Whether the engine loop runs (``/health``)."""
        return self.loop.running

    @property
    def exit_reason(self) -> None:
        """Always ``None``: an engine of this process does not exit on its own (``/health`` says the loop stopped)."""
        return None

    def chat_template_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (raises ``LiteturboError``)."""
        return self.engine.chat_template_ids(messages)

    def submit(self, prompt: str | list[int], gen: GenerationConfig, priority: int = 0) -> RequestHandle:
        """Queue a prompt (text or ids); see :meth:`turbo.loop.EngineLoop.submit` for the errors."""
        return self.loop.submit(prompt, gen, priority)

    def submit_many(self, prompt: str | list[int], gens: list[GenerationConfig]) -> list[RequestHandle]:
        """Queue one prompt once per config, all before the next step (see :meth:`turbo.loop.EngineLoop.submit_many`)."""
        return self.loop.submit_many(prompt, gens)

    def submit_chat(self, sid: str, message: str | list[dict], gen: GenerationConfig, persist: bool = False,
                    tools: list[dict] | None = None, tool_call_id: str | None = None,
                    keep_partial: bool = False, read: dict | None = None, owner: str | None = None) -> RequestHandle:
        """Queue session ``sid``'s next turn (saved under the session dir when it ends if ``persist``; ``tools``,
        ``tool_call_id`` and ``keep_partial`` as :meth:`turbo.session.Session.chat` takes them); raises ``NotFound`` for
        an unknown id or another ``owner``'s, ``Conflict`` while it generates, ``InvalidRequest`` for a bad message."""
        session = self.sessions.get(sid, owner)
        on_end = (lambda: self.sessions.persist(sid)) if persist else None
        return self.loop.submit_chat(session, message, gen, 0, on_end, tools=tools, tool_call_id=tool_call_id,
                                     keep_partial=keep_partial, read=read)

    def session_create(self, system: str | None = None, session_id: str | None = None,
                       defaults: dict | None = None, owner: str | None = None) -> str:
        """A new session's id (``session_id`` when given: ``InvalidRequest`` if malformed, ``Conflict`` if taken),
        with its sampling ``defaults`` (keywords) and ``owner``; ``OverCapacity`` when the registry is full."""
        return self.sessions.create(system, session_id, defaults, owner)[0]

    def check_session(self, sid: str, owner: str | None = None) -> dict:
        """``sid``'s sampling defaults (as created; kept in the session dir); raises ``NotFound`` unless it lives
        (and is ``owner``'s)."""
        self.sessions.get(sid, owner)
        return self.sessions.defaults(sid)

    def session_info(self, sid: str, owner: str | None = None) -> dict:
        """:func:`session_facts` of ``sid`` and its ``defaults`` (``NotFound`` for an unknown id or another owner's)."""
        return dict(session_facts(self.sessions.get(sid, owner)), defaults=self.sessions.defaults(sid))

    def session_delete(self, sid: str, owner: str | None = None) -> None:
        """Delete ``sid`` (``NotFound``, also for another owner's; ``Conflict`` while it generates)."""
        self.sessions.delete(sid, owner)

    def session_ids(self) -> list[str]:
        """The ids of the live sessions."""
        return [sid for sid, _ in self.sessions.items()]

    def num_sessions(self) -> int:
        """How many sessions live."""
        return len(self.sessions)

    def stats(self) -> dict:
        """The engine's counters (:meth:`turbo.core.engine.EngineCore.stats`)."""
        return self.engine.stats()

    def cancel_all(self) -> None:
        """Cancel every open request (the server is stopping)."""
        self.loop.cancel_all()

    def close(self) -> None:
        """Stop the loop (open requests are cancelled)."""
        self.loop.stop()
