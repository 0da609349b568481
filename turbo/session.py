"""Stateful chat sessions: a conversation's messages, its token history and (while resident) its KV blocks.

:class:`Session` runs turns on its :class:`~turbo.engine.Engine` (directly, or through
:class:`turbo.loop.EngineLoop` with :meth:`Session.begin_turn` / :meth:`Session.end_turn`), saves itself atomically
with or without its KV cache, and :func:`load_session` restores one (reusing the saved KV only under the same
weights, compute dtype and KV storage).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from lite.formats import LiteturboError

from .config import GenerationConfig
from .engine import GenerationOutput, Request, _gen_config
from .errors import Conflict, InvalidRequest
from .scheduler import Sequence

if TYPE_CHECKING:
    from .engine import Engine


class Session:
    """A stateful chat: messages, their token history and (while resident) KV blocks kept between turns.

    Each turn renders the whole conversation with the chat template and computes only the tokens after the
    longest prefix still in the cache, so the result equals running the full conversation statelessly. Under
    memory pressure an idle session's blocks are evicted; its next turn recomputes them (nothing is lost).
    """

    def __init__(self, engine: Engine, system: str | None = None) -> None:
        if system is not None and not isinstance(system, str):
            raise LiteturboError(f"the system prompt must be a str or None, got {type(system).__name__}")
        self.engine = engine
        self.system = system
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.seq = Sequence(seq_id=next(engine._ids))
        self.closed = False
        self.busy = False
        self.last: GenerationOutput | None = None

    def chat(self, message: str, stream: bool = False, gen: GenerationConfig | None = None, priority: int = 0,
             **kwargs):
        """Send a user message. Returns the reply text, or with ``stream=True`` an iterator of text pieces.

        ``self.last`` holds the :class:`GenerationOutput` of the latest turn (tokens, timings, cache hits).
        Raises ``LiteturboError`` for a closed or busy session, an empty message, or a conversation longer
        than the context.
        """
        if self.closed:
            raise LiteturboError("this session is closed; open a new one with engine.session()")
        self._check_idle()
        if not isinstance(message, str):
            raise LiteturboError(f"the message must be a str, got {type(message).__name__}")
        if not message.strip():
            raise LiteturboError("the message is empty: type some text")
        gen = _gen_config(gen, kwargs)
        it = self._turn(message, gen, priority)
        if stream:
            return it
        return "".join(it)

    def _check_idle(self) -> None:
        if self.busy:
            raise Conflict("a reply is still being generated on this session; wait for it to finish, or stop it (close "
                           "the stream / disconnect), or use another session")

    def _turn(self, message: str, gen: GenerationConfig, priority: int) -> Iterator[str]:
        req, messages = self.begin_turn(message, gen, priority)  # runs at the first next(): a stream never
        pieces: list[str] = []                                    # started holds nothing
        out = None
        try:
            for item in self.engine._drive(req):
                if isinstance(item, GenerationOutput):
                    out = item
                else:
                    pieces.append(item)
                    yield item
        finally:
            self.end_turn(req, messages, out, pieces)

    def begin_turn(self, message: str, gen: GenerationConfig, priority: int = 0) -> tuple[Request, list[dict]]:
        """Mark the session busy and queue its next turn: the request and the conversation it answers. Whoever drives
        the request (this session's stream, or :class:`turbo.loop.EngineLoop`) must call :meth:`end_turn` after.
        Raises ``Conflict`` for a busy session, ``InvalidRequest`` for a closed one or a bad prompt."""
        with self.engine._lock:
            if self.closed:
                raise InvalidRequest("this session is closed; open a new one with engine.session()")
            self._check_idle()
            self.busy = True
        try:
            messages = self.messages + [{"role": "user", "content": message}]
            ids = self.engine.chat_template_ids(messages)
            req = self.engine.add_request(ids, gen, priority=priority, seq=self.seq)
        except BaseException:
            self.busy = False
            raise
        req.keep_cache = True
        return req, messages

    def end_turn(self, req: Request, messages: list[dict], out: GenerationOutput | None, pieces: list[str]) -> None:
        """Record a finished (or abandoned) turn: ``out`` is the request's output, or ``None`` when the consumer
        stopped early (the request is cancelled here); ``pieces`` the text streamed so far."""
        # a consumer that stops early (client gone) still leaves a consistent history: the partial reply is the
        # assistant's turn, and ``last`` is its output with finish_reason "cancelled"
        if out is None:
            self.engine.cancel(req)
            out = self.engine.output(req)
        reply = out.text if out.token_ids else "".join(pieces)
        if out.token_ids or pieces:
            self.messages = messages + [{"role": "assistant", "content": reply}]
        if out.finish_reason == "error" or not (out.token_ids or pieces):
            # a failed turn's tokens and K/V must not poison the next turns, and a turn that produced nothing
            # (cancelled while its prompt was computed) must not keep its prompt's blocks: drop the token history
            # and its blocks; the next turn renders ``messages`` again and recomputes (full blocks of earlier turns
            # still come from the prefix cache)
            with self.engine._lock:
                self.engine.scheduler.finish(self.seq)
            self.seq = Sequence(seq_id=next(self.engine._ids))
        self.last = out
        self.busy = False

    def save(self, path: str | Path, include_kv: bool = False) -> Path:
        """Write the session (messages, token history, optionally its KV) to folder ``path``, atomically.

        ``include_kv`` stores the cached K/V of the computed tokens in the cache's own form (``kv.safetensors``,
        per layer ``[tokens, kv_heads, ...]``: 16-bit values, or int8/int4 codes with their scales) so a restore
        needs no recompute; it is only reused by the same model weights, compute dtype and KV storage
        (an engine with another KV dtype recomputes the history, with a warning). Raises ``LiteturboError`` while a reply streams.
        """
        import json
        import os
        import shutil
        import tempfile

        from safetensors.torch import save_file

        self._check_idle()
        path = Path(path).expanduser().absolute()
        if path.exists() and not (path / "session.json").is_file():
            raise LiteturboError(f"{path} exists and is not a saved session; choose another folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            n = self.seq.num_computed if include_kv else 0
            meta = {"format": "liteturbo-session/1", "system": self.system, "messages": self.messages,
                    "token_ids": self.seq.token_ids, "kv_tokens": n, "model_fingerprint": self.engine.fingerprint(),
                    "kv_storage": self.engine.runner.kv_cache.storage_key()}
            if n:
                slots = torch.tensor(self.engine.block_manager.slots(self.seq.block_table, 0, n), dtype=torch.long)
                # the stored form ([tokens, KVH, ...] per layer: 16-bit values, or int8/int4 codes and scales)
                save_file(self.engine.runner.kv_cache.export(slots), str(tmp / "kv.safetensors"))
                meta["kv_sha256"] = _sha256(tmp / "kv.safetensors")
            (tmp / "session.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
            os.chmod(tmp, 0o755)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt) and free its KV blocks."""
        self._check_idle()
        with self.engine._lock:
            self.engine.scheduler.finish(self.seq)
        self.seq = Sequence(seq_id=next(self.engine._ids))
        self.messages = self.messages[:1] if self.system is not None else []

    def close(self) -> None:
        """Free the session's KV blocks; further ``chat`` calls raise. Raises ``LiteturboError`` while a reply
        streams (finish reading it, or close the stream, first)."""
        self._check_idle()
        with self.engine._lock:
            if not self.closed:
                self.engine.scheduler.finish(self.seq)
            self.closed = True


def load_session(engine: "Engine", path: str | Path) -> "Session":
    """Restore into ``engine`` a session written by :meth:`Session.save`. Its KV is reloaded when it was saved by the same
    weights and dtype (else recomputed on the next turn). Raises ``LiteturboError`` for a bad folder."""
    import json

    path = Path(path).expanduser()
    bad = f"{path} is not a saved liteturbo session"
    try:
        meta = json.loads((path / "session.json").read_text())
    except (OSError, ValueError):
        raise LiteturboError(f"{bad} (session.json missing or not JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != "liteturbo-session/1":
        raise LiteturboError(f"{bad} (session.json lacks format 'liteturbo-session/1')")
    system, messages, token_ids = meta.get("system"), meta.get("messages"), meta.get("token_ids")
    if system is not None and not isinstance(system, str):
        raise LiteturboError(f"{bad}: 'system' must be a string or null")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise LiteturboError(f"{bad}: 'messages' must be a list of {{'role': str, 'content': str}}")
    if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.model.cfg.vocab_size
            for t in token_ids):
        raise LiteturboError(f"{bad}: 'token_ids' must be a list of token ids of this model's vocabulary")
    s = Session(engine, system)
    s.messages = list(messages)
    s.seq.token_ids = list(token_ids)
    if s.seq.token_ids:
        engine._check_prompt(s.seq.token_ids, session=True)
    n = meta.get("kv_tokens", 0)
    if n == 0:
        return s  # saved without KV: the next turn computes the history
    import warnings

    def drop(why: str) -> "Session":
        """Warn that the saved KV is not used (``why``) and return the session, which will recompute."""
        warnings.warn(f"{path}: the saved KV cache is not used ({why}); the {len(token_ids)} tokens of history are "
                      f"recomputed on the next turn", stacklevel=3)
        return s

    if not (isinstance(n, int) and not isinstance(n, bool) and 0 < n <= len(token_ids)):
        return drop(f"kv_tokens {n!r} is not a token count within the history")
    kv_file = path / "kv.safetensors"
    if not kv_file.is_file():
        return drop("kv.safetensors is missing")
    if meta.get("model_fingerprint") != engine.fingerprint():
        return drop("it was saved by other weights or another compute dtype")
    cache = engine.runner.kv_cache
    # sessions saved before the KV cache had a dtype of its own stored it in the compute dtype
    saved_as = meta.get("kv_storage", str(engine.dtype).removeprefix("torch."))
    if saved_as != cache.storage_key():
        return drop(f"it was saved as {saved_as!r} but this engine's cache is {cache.storage_key()!r}")
    digest = meta.get("kv_sha256")
    if digest is not None and digest != _sha256(kv_file):
        return drop("kv.safetensors does not match the checksum in session.json: it was changed or damaged")
    kv = _load_session_kv(kv_file)
    if kv is None:
        return drop("kv.safetensors cannot be read")
    with engine._lock:
        try:
            engine.block_manager.ensure_capacity(s.seq.block_table, n)
        except Exception:
            engine.block_manager.free(s.seq.block_table)
            return drop("the KV pool has no room for it now")
        slots = torch.tensor(engine.block_manager.slots(s.seq.block_table, 0, n), dtype=torch.long,
                             device=engine.backend.device)
        try:
            cache.load(kv, slots)  # validates every tensor before writing any
        except ValueError as e:
            engine.block_manager.free(s.seq.block_table)
            return drop(str(e))
        s.seq.num_computed = n
        engine.block_manager.register_full_blocks(s.seq.token_ids, s.seq.block_table, n)
        engine.scheduler.finish(s.seq, keep_cache=True)
    return s


def _sha256(file: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_session_kv(file: Path) -> dict | None:
    """The saved KV tensors, or ``None`` when the file is unreadable (shapes are checked by the cache)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception:
        return None


class SessionRegistry:
    """Sessions by id for a server, each expiring after ``idle_timeout`` seconds unused.

    ``max_sessions`` caps the sessions that keep their KV cache resident: past it, the least recently used idle
    sessions' KV blocks are evicted first (their histories stay, so their next turn recomputes them) until the
    session expires; ``max_stored`` caps the sessions remembered at all (``OverCapacity`` when full of live ones).
    With ``session_dir``, a session is saved there (with its KV) when its turn ends (:meth:`persist`), and
    :meth:`restore` reloads the saved ones after a restart. Raises ``NotFound`` for an unknown id.
    """

    def __init__(self, engine: "Engine", max_sessions: int = 256, idle_timeout: float = 3600.0,
                 session_dir: str | Path | None = None, max_stored: int | None = None) -> None:
        import collections
        import threading

        self.engine, self.max_sessions, self.idle_timeout = engine, max_sessions, idle_timeout
        self.max_stored = max_stored or 16 * max_sessions
        self.session_dir = None if session_dir is None else Path(session_dir).expanduser()
        self._sessions: "collections.OrderedDict[str, Session]" = collections.OrderedDict()  # LRU first
        self._used: dict[str, float] = {}
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, system: str | None = None) -> tuple[str, Session]:
        """A new session and its id (``sess-`` + 24 hex characters). Raises ``OverCapacity`` when ``max_stored``
        live sessions exist."""
        import secrets

        from .errors import OverCapacity

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
        from .errors import NotFound

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
        import shutil

        from .errors import Conflict

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
        with self._lock, self.engine._lock:
            idle = [s for s in self._sessions.values() if not s.busy and s.seq.block_table]
            victims = idle[:max(0, len(idle) - keep)]
            for s in victims:
                if s.seq.seq_id in self.engine.scheduler.idle:
                    self.engine.scheduler.evict(s.seq)
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
            import warnings

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
                import warnings

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
    import time

    return time.monotonic()
