"""Sessions by id for the HTTP server: :class:`SessionRegistry` creates, finds, expires, evicts the KV of and
persists the :class:`~turbo.session.Session` objects the sessions API addresses by id.
"""
from __future__ import annotations

import collections
import secrets
import shutil
import threading
import time
import warnings
from pathlib import Path

from lite.formats import LiteturboError, make_dirs

from ..errors import Conflict, NotFound, OverCapacity
from ..session import Session


class SessionRegistry:
    """Sessions by id for a server, each expiring after ``idle_timeout`` seconds unused.

    ``max_sessions`` caps the sessions that keep their KV cache resident: past it, the least recently used idle
    sessions' KV blocks are evicted first (their histories stay, so their next turn recomputes them) until the
    session expires; ``max_stored`` caps the sessions remembered at all (``OverCapacity`` when full of live ones).
    With ``session_dir``, a session is saved there (with its KV) when its turn ends (:meth:`persist`), and
    :meth:`restore` reloads the saved ones after a restart. Raises ``NotFound`` for an unknown id, ``LiteturboError``
    for a ``session_dir`` that cannot be created.
    """

    def __init__(self, engine, max_sessions: int = 256, idle_timeout: float = 3600.0,
                 session_dir: str | Path | None = None, max_stored: int | None = None) -> None:
        self.engine, self.max_sessions, self.idle_timeout = engine, max_sessions, idle_timeout
        self.max_stored = max_stored or 16 * max_sessions
        self.session_dir = None if session_dir is None else Path(session_dir).expanduser()
        if self.session_dir is not None:  # refused at start-up, not by a warning after every turn
            make_dirs(self.session_dir, "--session-dir")
        self._sessions: "collections.OrderedDict[str, Session]" = collections.OrderedDict()  # LRU first
        self._used: dict[str, float] = {}
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, system: str | None = None) -> tuple[str, Session]:
        """A new session and its id (``sess-`` + 24 hex characters). Raises ``OverCapacity`` when ``max_stored``
        live sessions exist."""
        with self._lock:
            self.expire()
            if len(self._sessions) >= self.max_stored:
                raise OverCapacity(f"{len(self._sessions)} sessions exist (max_stored={self.max_stored}); delete "
                                   f"some or retry after they expire", retry_after=5.0)
            self.evict_idle_kv(keep=self.max_sessions - 1)
            sid = "sess-" + secrets.token_hex(12)
            s = self.engine.session(system)
            self._sessions[sid] = s
            self._used[sid] = _now()
            return sid, s

    def get(self, sid: str) -> Session:
        """The session ``sid`` (marked as used now). Raises ``NotFound``."""
        with self._lock:
            self.expire()
            s = self._sessions.get(sid)
            if s is None:
                raise NotFound(f"no session {sid!r} (it never existed, was deleted, or expired after "
                               f"{self.idle_timeout:.0f} s unused); create one with POST /v1/sessions")
            self._sessions.move_to_end(sid)
            self._used[sid] = _now()
            return s

    def delete(self, sid: str) -> None:
        """Close and forget ``sid`` (and its saved copy). Raises ``NotFound``, ``Conflict`` while it generates."""
        with self._lock:
            s = self.get(sid)
            if s.busy:
                raise Conflict(f"session {sid!r} is generating a reply; wait for it or cancel it first")
            self._forget(sid)
            if self.session_dir is not None:
                shutil.rmtree(self.session_dir / sid, ignore_errors=True)

    def items(self) -> list[tuple[str, Session]]:
        """(id, session) pairs, least recently used first."""
        with self._lock:
            return list(self._sessions.items())

    def expire(self) -> list[str]:
        """Close and forget sessions idle longer than ``idle_timeout``; returns their ids."""
        with self._lock:
            now = _now()
            old = [sid for sid, s in self._sessions.items()
                   if not s.busy and now - self._used.get(sid, now) > self.idle_timeout]
            for sid in old:
                self._forget(sid)
            return old

    def evict_idle_kv(self, keep: int) -> int:
        """Free the KV blocks of all but the ``keep`` most recently used idle sessions (histories stay)."""
        with self._lock, self.engine.lock:
            idle = [s for s in self._sessions.values() if not s.busy and s.seq.block_table]
            victims = idle[:max(0, len(idle) - keep)]
            for s in victims:
                self.engine.evict_idle(s.seq)
            return len(victims)

    def persist(self, sid: str) -> None:
        """Save ``sid`` under ``session_dir`` (no-op without one); a failed save warns and keeps serving."""
        if self.session_dir is None:
            return
        with self._lock:
            s = self._sessions.get(sid)
        if s is None or s.busy:
            return
        try:
            s.save(self.session_dir / sid, include_kv=True)
        except Exception as e:  # noqa: BLE001 - persistence must not take the server down
            warnings.warn(f"could not save session {sid} to {self.session_dir}: {e}", stacklevel=2)

    def restore(self) -> int:
        """Load every session saved under ``session_dir`` (ids are the folder names); returns how many."""
        if self.session_dir is None or not self.session_dir.is_dir():
            return 0
        n = 0
        for d in sorted(self.session_dir.iterdir()):
            if not (d / "session.json").is_file() or d.name in self._sessions:
                continue
            try:
                s = self.engine.load_session(d)
            except LiteturboError as e:
                warnings.warn(f"skipping saved session {d}: {e}", stacklevel=2)
                continue
            with self._lock:
                self._sessions[d.name] = s
                self._used[d.name] = _now()
            n += 1
        return n

    def _forget(self, sid: str) -> None:
        s = self._sessions.pop(sid)
        self._used.pop(sid, None)
        if not s.busy:
            s.close()


def _now() -> float:
    return time.monotonic()
