"""What the HTTP routes talk to: :class:`EngineClient`, the methods both engine clients implement, the in-process
one (:class:`~turbo.engine_proc.inproc.InprocClient`) and the engine process's
(:class:`~turbo.engine_proc.mp_client.MPClient`); and :func:`session_facts`, what ``GET /v1/sessions/{id}`` shows
of a session, built on the engine's side of either.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from ..config import GenerationConfig
from ..loop import RequestHandle


class EngineClient(Protocol):
    """An engine as the HTTP front sees it.

    A client submits generations (``submit``: a prompt; ``submit_many``: a request's ``n`` choices; ``submit_chat``:
    a session's next turn) and returns :class:`~turbo.loop.RequestHandle`-like handles (iterate them for text
    pieces; ``output`` is the :class:`~turbo.core.request.GenerationOutput` afterwards; ``request.output_ids`` /
    ``request.logprobs`` / ``request.stop_ids`` hold what logprobs answers need; ``cancel()``); it creates,
    describes and deletes sessions by id; it answers ``stats()`` for the metrics and ``running`` / ``exit_reason``
    for ``/health``; it tokenizes chat conversations (``chat_template_ids``) with the model's tokenizer. Errors are
    liteturbo's typed errors (:mod:`turbo.errors`) wherever the engine runs.
    """

    tokenizer: object  # the model's Hugging Face tokenizer (a copy in the front for an engine process)
    path: Path  # the checkpoint folder
    session_len: int
    backend_name: str
    device: str
    observers: list[Callable]  # called with each finished request's GenerationOutput
    dead: str | None  # why the engine died; None while it lives

    @property
    def running(self) -> bool:
        """Whether the engine runs and serves (``/health``)."""

    @property
    def exit_reason(self) -> str | None:
        """Why the engine does not serve (``None`` while it does)."""

    def chat_template_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (raises ``LiteturboError``)."""

    def submit(self, prompt: str | list[int], gen: GenerationConfig, priority: int = 0) -> RequestHandle:
        """Queue a prompt (text or ids); raises what :meth:`turbo.loop.EngineLoop.submit` raises."""

    def submit_many(self, prompt: str | list[int], gens: list[GenerationConfig]) -> list[RequestHandle]:
        """Queue one prompt once per config, all before the engine's next step (a request's ``n`` choices)."""

    def submit_chat(self, sid: str, message: str | list[dict], gen: GenerationConfig, persist: bool = False,
                    tools: list[dict] | None = None, tool_call_id: str | None = None,
                    keep_partial: bool = False, read: dict | None = None, owner: str | None = None) -> RequestHandle:
        """Queue session ``sid``'s next turn (saved under the session dir when it ends if ``persist``; ``tools``,
        ``tool_call_id`` and ``keep_partial`` as :meth:`turbo.session.Session.chat` takes them, ``read`` as
        :meth:`turbo.session.Session.begin_turn`); raises ``NotFound``
        for an unknown id (or a session of another ``owner``: every session method takes the owner tag of the
        request's key, :mod:`turbo.engine_proc.sessions`), ``Conflict`` while it generates, ``InvalidRequest`` for a
        bad message."""

    def session_create(self, system: str | None = None, session_id: str | None = None,
                       defaults: dict | None = None, owner: str | None = None) -> str:
        """A new session's id (``session_id`` when given: ``InvalidRequest`` if malformed, ``Conflict`` if taken),
        with its sampling ``defaults`` (keywords) and ``owner``; ``OverCapacity`` when the registry is full."""

    def check_session(self, sid: str, owner: str | None = None) -> dict:
        """``sid``'s sampling defaults (as created; kept in the session dir); raises ``NotFound`` unless it lives
        (and is ``owner``'s)."""

    def session_info(self, sid: str, owner: str | None = None) -> dict:
        """:func:`session_facts` of ``sid`` and its ``defaults`` (``NotFound`` for an unknown id or another owner's)."""

    def session_delete(self, sid: str, owner: str | None = None) -> None:
        """Delete ``sid`` (``NotFound``, also for another owner's; ``Conflict`` while it generates)."""

    def session_ids(self) -> list[str]:
        """The ids of the live sessions."""

    def num_sessions(self) -> int:
        """How many sessions live."""

    def stats(self) -> dict:
        """The engine's counters (:meth:`turbo.core.engine.EngineCore.stats`)."""

    def cancel_all(self) -> None:
        """Cancel every open request (the server is stopping)."""

    def close(self) -> None:
        """Stop the engine's loop or process (open requests are cancelled)."""


def session_facts(session) -> dict:
    """What ``GET /v1/sessions/{id}`` shows of a :class:`~turbo.session.Session`: ``system``, ``messages``,
    ``busy``, ``tokens`` (history length), ``kv_resident_tokens`` and ``last`` (its last turn's
    :class:`~turbo.core.request.GenerationOutput` or ``None``)."""
    return {"system": session.system, "messages": list(session.messages), "busy": session.busy,
            "tokens": len(session.seq.token_ids), "kv_resident_tokens": session.seq.num_computed,
            "last": session.last}
