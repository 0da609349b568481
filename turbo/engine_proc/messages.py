"""The messages between the HTTP front (:class:`~turbo.engine_proc.mp_client.MPClient`) and the engine process
(:mod:`turbo.engine_proc.process`): one dataclass per message, as SGLang's ``io_struct``, pickled over two pyzmq
PUSH/PULL sockets (a local, trusted pipe between two processes of one server).

front -> engine
    :class:`Submit` (a prompt's token ids), :class:`SubmitMany` (a request's ``n`` choices, queued together),
    :class:`Chat` (a session's next turn), :class:`Cancel`, :class:`Call` (a sessions or stats method, or the
    watchdog's ``ping``, answered by :class:`Reply`), :class:`Shutdown`.
engine -> front
    :class:`Ready` or :class:`Failed` once at start; :class:`Ack` per submitted request (its stop ids, or the error
    that refused it); per loop turn ONE :class:`Out` with every request's new text, token ids and logprobs of that
    turn (and its output or error when it ended); :class:`Reply` per call; :class:`Dead` before exiting when the
    engine died (e.g. a tensor-parallel worker was killed).

Errors travel as :class:`WireError`, which keeps their type: a 400 / 404 / 409 / 503 raised in the engine process is
answered the same as in one process. The classes use ``__slots__``; :class:`Out` keeps a turn's outputs in columns
(a decode turn of 64 requests pickles to about 1 kB).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lite.formats import LiteturboError

from .. import errors

_TYPED = {c.__name__: c for c in (errors.InvalidRequest, errors.NotFound, errors.Conflict, errors.OverCapacity,
                                  errors.InternalError, errors.EngineDead, LiteturboError)}


@dataclass(slots=True)
class WireError:
    """A picklable stand-in for an exception: its type name, message and ``retry_after`` (``OverCapacity``)."""

    name: str
    message: str
    retry_after: float | None = None

    @classmethod
    def of(cls, e: BaseException) -> "WireError":
        """The wire form of exception ``e``: its class name, message and ``retry_after`` (if it has one)."""
        return cls(type(e).__name__, str(e), getattr(e, "retry_after", None))

    def exception(self) -> BaseException:
        """The exception this describes: the same typed error for liteturbo's errors; any other exception (a
        kernel's ``RuntimeError``) becomes an :class:`~turbo.errors.InternalError` naming it."""
        cls = _TYPED.get(self.name)
        if cls is errors.OverCapacity:
            return cls(self.message, retry_after=self.retry_after or 1.0)
        if cls is not None:
            return cls(self.message)
        return errors.InternalError(f"the engine failed while running this request ({self.name}: {self.message}); "
                                    f"see the server log")


# --- front -> engine -------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Submit:
    """Queue a prompt (token ids) as request ``rid`` (the front's id) with its ``GenerationConfig``."""

    rid: int
    prompt_ids: list[int]
    gen: Any
    priority: int = 0


@dataclass(slots=True)
class SubmitMany:
    """Queue one prompt once per config (a request's ``n`` choices) as requests ``rids``, all before the next step."""

    rids: list[int]
    prompt_ids: list[int]
    gens: list
    priority: int = 0


@dataclass(slots=True)
class Chat:
    """Queue session ``session_id``'s next turn as request ``rid`` (saved when it ends if ``persist``; ``tools``,
    ``tool_call_id`` and ``keep_partial`` as :meth:`turbo.session.Session.chat` takes them, ``read`` as
    :meth:`turbo.session.Session.begin_turn`; ``owner``: the owner tag of the request's API key, or ``None``)."""

    rid: int
    session_id: str
    message: str | list[dict]  # the user's text, a tool result, or several messages (Session.begin_turn)
    gen: Any
    persist: bool = False
    tools: list[dict] | None = None
    tool_call_id: str | None = None
    keep_partial: bool = False
    read: dict | None = None  # turbo.session.Session.begin_turn's: how the reply is read for calls
    owner: str | None = None  # a session of another owner is not found (turbo/engine_proc/sessions.py)


@dataclass(slots=True)
class Cancel:
    """Stop request ``rid``; ``reason`` is its finish reason."""

    rid: int
    reason: str = "cancelled"


@dataclass(slots=True)
class Call:
    """Run the engine process's ``rpc_<method>(*args)`` (sessions, stats) between steps; answered by a :class:`Reply`
    with the same ``cid``."""

    cid: int
    method: str
    args: tuple = ()


@dataclass(slots=True)
class Shutdown:
    """Leave (the front is stopping)."""


# --- engine -> front -------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Ready:
    """The engine loaded: the checkpoint folder, session length, backend name, device, sessions restored from the
    session dir and the engine process's pid."""

    path: str
    session_len: int
    backend: str
    device: str
    restored: int
    pid: int


@dataclass(slots=True)
class Failed:
    """Loading failed: the error's message (a traceback for a bug); the process exits 1."""

    message: str


@dataclass(slots=True)
class Ack:
    """Request ``rid`` was queued (``stop_ids``: ids whose text is never shown) or refused (``error``)."""

    rid: int
    stop_ids: list[int] | None = None
    error: WireError | None = None


@dataclass(slots=True)
class Out:
    """One loop turn's outputs, a column per field (as SGLang's ``BatchTokenIDOut``, so that a turn pickles as a few
    flat lists): item ``i`` is request ``rids[i]``'s new ``texts[i]``, token ``ids[i]`` and their ``logprobs[i]``;
    ``ends[i]`` is ``None``, or, when the request ended, its :class:`~turbo.core.request.GenerationOutput` or the
    :class:`WireError` that ended it; ``cached[i]`` is how many of its prompt tokens were read from the prefix cache
    (or its session's KV), known from its first step on (-1 before). A request may have two items in one turn (its
    last text, then its end)."""

    rids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list] = field(default_factory=list)
    ends: list = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def add(self, rid: int, text: str, ids: list[int], logprobs: list, end: Any = None, cached: int = -1) -> None:
        """Append one item (request ``rid``'s new text, token ids, logprobs, end and cached prompt tokens)."""
        self.rids.append(rid)
        self.texts.append(text)
        self.ids.append(ids)
        self.logprobs.append(logprobs)
        self.ends.append(end)
        self.cached.append(cached)

    def __len__(self) -> int:
        return len(self.rids)

    def items(self):
        """(rid, text, ids, logprobs, end, cached) per item, in order."""
        return zip(self.rids, self.texts, self.ids, self.logprobs, self.ends, self.cached)


@dataclass(slots=True)
class Reply:
    """The answer to :class:`Call` ``cid``: its ``result``, or the ``error`` it raised."""

    cid: int
    result: Any = None
    error: WireError | None = None


@dataclass(slots=True)
class Dead:
    """The engine died (``why``); the process leaves."""

    why: str
