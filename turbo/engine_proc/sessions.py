"""Sessions by id, held where the engine runs (the engine process, or the server's own process without one):
:class:`SessionRegistry` creates, finds, expires, evicts the KV of and
persists the :class:`~turbo.session.Session` objects the sessions API addresses by id (the id rules, ``sess-`` + 24
lowercase hex digits, are :mod:`turbo.session_ids`, shared with the request reader and the router).

With a session dir shared by several servers (replicas behind ``liteturbo route``), a registry loads a session it
does not hold from the dir on first use, reloads one the dir holds in a state it did not write or read itself (another
replica continued it), and forgets one whose saved copy another replica deleted.

A session made under an API key has an owner (:func:`turbo.session_ids.owner_of`, a hash of the key; saved beside it
in the session dir as ``<id>.owner``): :meth:`SessionRegistry.get` and :meth:`SessionRegistry.delete` given another
owner raise the ``NotFound`` of an unknown id, so under another key a session does not exist. ``owner=None`` (a server
without keys, or the server's own housekeeping) checks nothing.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

from lite.formats import LiteturboError, make_dirs

from ..core import trim_heap
from ..errors import Conflict, InvalidRequest, NotFound, OverCapacity
from ..session import Session
from ..session_ids import new_session_id, session_id_problem


class SessionRegistry:
    """Sessions by id for a server, each expiring after ``idle_timeout`` seconds unused.

    ``max_sessions`` caps the sessions that keep their KV cache resident: past it, the least recently used idle
    sessions' KV blocks are evicted first (their histories stay, so their next turn recomputes them) until the
    session expires; ``max_stored`` caps the sessions remembered at all (``OverCapacity`` when full of live ones).
    With ``session_dir``, a session is saved there (with its KV) when it is created and when its turn ends
    (:meth:`persist`), and :meth:`restore` reloads the saved ones after a restart. The dir may be shared by several
    registries (replicas): :meth:`get` loads a session saved there that it does not hold (unless its last save is
    older than ``idle_timeout``), reloads a held one whose saved copy changed since this registry last wrote or read
    it, and forgets one whose saved copy was deleted. Raises ``NotFound`` for an unknown id, ``LiteturboError``
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
        self._defaults: dict[str, dict] = {}
        self._owners: dict[str, str | None] = {}  # sid -> owner tag (None: made without a key)
        # lock order: the engine's lock, then this one, then _disk_lock; whatever may touch the engine (closing,
        # evicting, loading a session) takes the engine's first, as the engine loop's thread already holds it when
        # it calls in (a turn's start, persist at its end)
        self._lock = threading.RLock()
        # the saved copy as this registry last wrote or read it ((inode, mtime_ns, size) of its session.json), and
        # the sessions being saved now
        self._stamps: dict[str, tuple | None] = {}
        self._saving: set[str] = set()
        self._disk_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, system: str | None = None, session_id: str | None = None,
               defaults: dict | None = None, owner: str | None = None) -> tuple[str, Session]:
        """A new session and its id: ``session_id`` (:func:`session_id_problem`'s form) or a new random one. With a
        session dir it is saved at once (so that another replica sharing the dir knows it), with ``defaults`` (a
        JSON-ready dict, e.g. the session's sampling defaults; :meth:`defaults` reads it back) and ``owner`` (the
        tag of the key it is made under, module docs). Raises ``InvalidRequest`` for a malformed ``session_id``,
        ``Conflict`` when it exists (here or in the session dir), ``OverCapacity`` when ``max_stored`` live sessions
        exist."""
        if session_id is not None and (why := session_id_problem(session_id)):
            raise InvalidRequest(f"the session id {why}")
        with self.engine.lock, self._lock:
            self.expire()
            if session_id is not None and self._exists(session_id):
                raise Conflict(f"a session {session_id!r} exists already; choose another id, or leave it out")
            self._check_room()
            sid = session_id or new_session_id()
            while session_id is None and self._exists(sid):
                sid = new_session_id()
            s = self.engine.session(system)
            self._sessions[sid] = s
            self._used[sid] = _now()
            self._defaults[sid] = dict(defaults or {})
            self._owners[sid] = owner
            with self._disk_lock:
                self._stamps[sid] = None
            if self.session_dir is not None:  # before the session itself: a replica that sees it knows its owner
                self._write_owner(sid, owner)
        if self.session_dir is not None:
            self._write_defaults(sid)
            self.persist(sid)
        return sid, s

    def get(self, sid: str, owner: str | None = None) -> Session:
        """The session ``sid`` (marked as used now); with a session dir, loaded or reloaded from it first when
        another replica saved it. Raises ``NotFound`` (also when ``owner`` is given and the session has another)."""
        with self.engine.lock, self._lock:
            self.expire()
            s = self._sessions.get(sid)
            s = self._load(sid) if s is None else self._refresh(sid, s)
            if s is None or not self._owned(sid, owner):
                raise NotFound(f"no session {sid!r} (it never existed, was deleted, or expired after "
                               f"{self.idle_timeout:.0f} s unused); create one with POST /v1/sessions, or send its "
                               f"first turn with 'create_session': true (or the id in the x-smg-routing-key header)")
            self._sessions.move_to_end(sid)
            self._used[sid] = _now()
            return s

    def defaults(self, sid: str) -> dict:
        """What :meth:`create` was given as ``defaults`` for ``sid`` (read from the session dir when another
        replica created it); ``{}`` when none or unknown."""
        with self._lock:
            if sid not in self._defaults and self.session_dir is not None and not session_id_problem(sid):
                try:
                    self._defaults[sid] = json.loads(self._defaults_file(sid).read_text())
                except (OSError, ValueError):
                    return {}
            return dict(self._defaults.get(sid) or {})

    def owner(self, sid: str) -> str | None:
        """The owner tag ``sid`` was made with (read from the session dir when this registry did not make it);
        ``None`` when it was made without a key, or is unknown."""
        with self._lock:
            if sid not in self._owners and self.session_dir is not None and not session_id_problem(sid):
                try:
                    owner = self._owner_file(sid).read_text().strip() or None
                except OSError:
                    owner = None
                if sid in self._sessions:  # held (restored, or loaded from another replica's save): read once
                    self._owners[sid] = owner
                return owner
            return self._owners.get(sid)

    def _owned(self, sid: str, owner: str | None) -> bool:
        """Whether a request under ``owner`` may reach ``sid`` (``None``: no check)."""
        return owner is None or self.owner(sid) == owner

    def delete(self, sid: str, owner: str | None = None) -> None:
        """Close and forget ``sid`` and delete its saved copy (also one this registry does not hold). Raises
        ``NotFound`` (also for a session of another ``owner``), ``Conflict`` while it generates."""
        with self.engine.lock, self._lock:
            self.expire()
            s = self._sessions.get(sid)
            if (s is None and not self._exists(sid)) or not self._owned(sid, owner):
                raise NotFound(f"no session {sid!r} (it never existed, was deleted, or expired); nothing to delete")
            if s is not None and s.busy:
                raise Conflict(f"session {sid!r} is generating a reply; wait for it or cancel it first")
            if s is not None:
                self._forget(sid)
            if self.session_dir is not None and not session_id_problem(sid):
                shutil.rmtree(self.session_dir / sid, ignore_errors=True)
                self._defaults_file(sid).unlink(missing_ok=True)
                self._owner_file(sid).unlink(missing_ok=True)

    def items(self) -> list[tuple[str, Session]]:
        """(id, session) pairs, least recently used first."""
        with self._lock:
            return list(self._sessions.items())

    def expire(self) -> list[str]:
        """Close and forget sessions idle longer than ``idle_timeout``; returns their ids."""
        with self.engine.lock, self._lock:
            now = _now()
            old = [sid for sid, s in self._sessions.items()
                   if not s.busy and now - self._used.get(sid, now) > self.idle_timeout]
            for sid in old:
                self._forget(sid)
            return old

    def evict_idle_kv(self, keep: int) -> int:
        """Free the KV blocks of all but the ``keep`` most recently used idle sessions (histories stay)."""
        with self.engine.lock, self._lock:
            idle = [s for s in self._sessions.values() if not s.busy and s.seq.block_table]
            victims = idle[:max(0, len(idle) - keep)]
            for s in victims:
                self.engine.evict_idle(s.seq)
            return len(victims)

    def persist(self, sid: str) -> None:
        """Save ``sid`` under ``session_dir`` (no-op without one); a failed save warns and keeps serving.

        Runs on the engine loop's thread when a turn ends (holding the engine's lock), so it takes no registry lock
        but the innermost one."""
        if self.session_dir is None:
            return
        s = self._sessions.get(sid)  # a single dict read: atomic, no lock (see above)
        if s is None or s.busy:
            return
        with self._disk_lock:
            self._saving.add(sid)
        stamp = saved = None
        try:
            s.save(self.session_dir / sid, include_kv=True)
            stamp, saved = self._stamp(sid), True
            trim_heap()  # the exported KV (tens of MB) was freed: its pages go back, not into the heap's fragments
        except Exception as e:  # noqa: BLE001 - persistence must not take the server down
            warnings.warn(f"could not save session {sid} to {self.session_dir}: {e}", stacklevel=2)
        finally:
            with self._disk_lock:
                self._saving.discard(sid)
                if saved and self._sessions.get(sid) is s:
                    self._stamps[sid] = stamp

    def restore(self) -> int:
        """Load every session saved under ``session_dir`` (ids are the folder names); returns how many."""
        if self.session_dir is None or not self.session_dir.is_dir():
            return 0
        n = 0
        for d in sorted(self.session_dir.iterdir()):
            if not (d / "session.json").is_file() or d.name in self._sessions:
                continue
            stamp = self._stamp(d.name)
            try:
                s = self.engine.load_session(d)
            except LiteturboError as e:
                warnings.warn(f"skipping saved session {d}: {e}", stacklevel=2)
                continue
            with self._lock:
                self._sessions[d.name] = s
                self._used[d.name] = _now()
                with self._disk_lock:
                    self._stamps[d.name] = stamp
            n += 1
        return n

    # --- the session dir -----------------------------------------------------------------------------------------

    def _saved(self, sid: str) -> Path | None:
        """``sid``'s folder in the session dir (``None`` without a dir or for a malformed id: never a path outside)."""
        if self.session_dir is None or session_id_problem(sid):
            return None
        return self.session_dir / sid

    def _stamp(self, sid: str) -> tuple | None:
        """Which saved copy of ``sid`` the dir holds now: (inode, mtime_ns, size) of its session.json, or ``None``.
        Every save writes a new file (:meth:`Session.save` replaces the folder), so any change shows."""
        d = self._saved(sid)
        try:
            st = os.stat(d / "session.json") if d is not None else None
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)

    def _exists(self, sid: str) -> bool:
        return sid in self._sessions or self._stamp(sid) is not None

    def _check_room(self) -> None:
        if len(self._sessions) >= self.max_stored:
            raise OverCapacity(f"{len(self._sessions)} sessions exist (max_stored={self.max_stored}); delete "
                               f"some or retry after they expire", retry_after=5.0)
        self.evict_idle_kv(keep=self.max_sessions - 1)

    def _load(self, sid: str) -> Session | None:
        """Lazy restore: ``sid`` loaded from the session dir (another replica saved it), or ``None`` when it is not
        there, its last save is older than ``idle_timeout`` (expired) or it cannot be read (with a warning)."""
        stamp = self._stamp(sid)
        if stamp is None or time.time() - stamp[1] / 1e9 > self.idle_timeout:
            return None
        self._check_room()
        try:
            s = self.engine.load_session(self._saved(sid))
        except LiteturboError as e:
            warnings.warn(f"could not load saved session {sid}: {e}", stacklevel=3)
            return None
        self._sessions[sid] = s
        with self._disk_lock:
            self._stamps[sid] = stamp
        return s

    def _refresh(self, sid: str, s: Session) -> Session | None:
        """``s``, or, when another replica changed its saved copy since this registry wrote or read it, the saved
        copy loaded in its place (``s`` closed); ``None`` when another replica deleted it."""
        if self.session_dir is None or s.busy:
            return s  # a turn running here: this copy is the newest
        with self._disk_lock:
            if sid in self._saving:
                return s
            known = self._stamps.get(sid)
        now = self._stamp(sid)
        if now == known:
            return s
        if now is None:  # saved before, gone now: deleted through another replica
            self._forget(sid)
            return None
        self._forget(sid)
        return self._load(sid)

    def _defaults_file(self, sid: str) -> Path:
        return self.session_dir / f"{sid}.defaults.json"

    def _write_defaults(self, sid: str) -> None:
        if not self._defaults.get(sid):
            return
        try:
            tmp = self._defaults_file(sid).with_suffix(".tmp")
            tmp.write_text(json.dumps(self._defaults[sid]))
            os.replace(tmp, self._defaults_file(sid))
        except (OSError, TypeError, ValueError) as e:
            warnings.warn(f"could not save the defaults of session {sid} to {self.session_dir}: {e}", stacklevel=3)

    def _owner_file(self, sid: str) -> Path:
        return self.session_dir / f"{sid}.owner"

    def _write_owner(self, sid: str, owner: str | None) -> None:
        """Save (or, for ``None``, remove) ``sid``'s owner tag; a failed save warns (the session then has no
        owner on disk: another replica or a restart would refuse it under every key, never show it to another)."""
        path = self._owner_file(sid)
        try:
            if owner is None:
                path.unlink(missing_ok=True)
                return
            tmp = path.with_suffix(".owner-tmp")
            tmp.write_text(owner)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"could not save the owner of session {sid} to {self.session_dir}: {e}", stacklevel=3)

    def _forget(self, sid: str) -> None:
        s = self._sessions.pop(sid)
        self._used.pop(sid, None)
        self._defaults.pop(sid, None)
        self._owners.pop(sid, None)
        with self._disk_lock:
            self._stamps.pop(sid, None)
        if not s.busy:
            s.close()


def _now() -> float:
    return time.monotonic()
