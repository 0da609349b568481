"""The session id rules, shared by the server (its registry and request reader) and the router (:mod:`turbo.router`):
``sess-`` + 24 lowercase hex digits (96 random bits); and the owner tag of a session or stored response made under an
API key (:func:`owner_of`: a hash of the key, never the key). Imports nothing of the engine.
"""
from __future__ import annotations

import hashlib
import re
import secrets

SESSION_ID_PREFIX = "sess-"
_SESSION_ID = re.compile(r"sess-[0-9a-f]{24}")


def new_session_id() -> str:
    """A fresh random session id: ``sess-`` + 24 lowercase hex digits (96 random bits)."""
    return SESSION_ID_PREFIX + secrets.token_hex(12)


def session_id_problem(sid) -> str | None:
    """``None`` when ``sid`` is a well-formed session id (:func:`new_session_id`'s form), else what is wrong, as the
    end of a sentence naming the field."""
    if isinstance(sid, str) and _SESSION_ID.fullmatch(sid):
        return None
    shown = repr(sid) if len(repr(sid)) <= 60 else repr(sid)[:57] + "..."
    return (f"must be 'sess-' followed by 24 lowercase hex digits (like {new_session_id()!r}), got {shown}; "
            f"leave it out to get a new id")


def owner_of(key: bytes) -> str:
    """The owner tag of what a request under API ``key`` makes (sessions, stored responses): 32 hex digits of
    SHA-256 over a fixed prefix and the key. Kept in memory and in the session dir instead of the key; the same on
    every replica (no per-server secret), so a session another replica saved keeps its owner."""
    return hashlib.sha256(b"liteturbo-owner\0" + key).hexdigest()[:32]
