"""Typed errors of the engine, so that a server maps them to HTTP statuses without parsing messages.

Every one is a :class:`~lite.formats.LiteturboError` (so ``except LiteturboError`` still catches them all) with a
``status``: the HTTP status an API layer answers with. A plain ``LiteturboError`` raised while checking a request
counts as an invalid request (400).
"""
from __future__ import annotations

from lite.formats import LiteturboError


class InvalidRequest(LiteturboError):
    """The request itself is wrong (bad option, empty or too long prompt): 400."""

    status = 400


class NotFound(LiteturboError):
    """An unknown session or request id: 404."""

    status = 404


class Conflict(LiteturboError):
    """The resource is busy, e.g. a session that is already generating a reply: 409."""

    status = 409


class OverCapacity(LiteturboError):
    """The engine cannot take the request now (queue or KV pool full): 503, retry after ``retry_after`` seconds."""

    status = 503

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStalled(OverCapacity):
    """The engine process lives but has made no progress for longer than the stall timeout while requests were open
    (a hang, or the process stopped): 503, retry after ``retry_after`` seconds. The message names the stall."""


class InternalError(LiteturboError):
    """The engine failed while running the request (a kernel error): 500."""

    status = 500


class EngineDead(LiteturboError):
    """The engine is gone (its process or a tensor-parallel worker died): 503; the server shuts down. The message
    names what died and how (exit code or signal)."""

    status = 503


def http_status(e: BaseException) -> int:
    """The HTTP status for an exception: the typed ones' ``status``, 400 for other ``LiteturboError``s, else 500."""
    if isinstance(e, LiteturboError):
        return getattr(e, "status", 400)
    return 500
