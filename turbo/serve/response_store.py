"""The stored responses of the Responses API (``store: true``): what ``previous_response_id`` continues and
``GET /v1/responses/{id}`` answers.

A :class:`StoredResponse` keeps the response object as it was answered, the whole conversation after it (chat
messages in OpenAI's request shape, ``arguments`` as JSON text, so it can be checked and replayed as a request) and
the session that holds its KV (:mod:`turbo.engine_proc.sessions`). :class:`ResponseStore` holds them in memory and,
with a session dir, as one JSON file each under ``<session dir>/.responses/`` (written atomically: a temporary file
renamed over), read back on demand after a restart. Ids are ``resp_`` + 32 hex digits; anything else is not found.
A response made under an API key keeps its owner tag (:func:`turbo.session_ids.owner_of`, a hash of the key, never the
key): under another key it is not found.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

_ID = re.compile(r"resp_[0-9a-f]{32}")
DIR_NAME = ".responses"  # beside the saved sessions (a session's folder holds a session.json; this one does not)


@dataclass
class StoredResponse:
    """One stored response: ``body`` (the response object), ``messages`` (the conversation after it, its system
    message first when it had instructions), ``session_id`` (the session that held it; it may have moved on or
    expired since), ``system`` (its instructions) and ``owner`` (the owner tag of the key it was made under;
    ``None`` without keys)."""

    body: dict
    messages: list[dict]
    session_id: str | None
    system: str | None
    owner: str | None = None


class ResponseStore:
    """Stored responses by id, in memory and (``directory`` given) on disk. Thread-safe."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.dir = None if directory is None else Path(directory).expanduser() / DIR_NAME
        self._mem: dict[str, StoredResponse] = {}
        self._lock = threading.Lock()

    def put(self, rid: str, r: StoredResponse) -> None:
        """Keep ``r`` under ``rid`` (and write it, atomically, with a directory)."""
        with self._lock:
            self._mem[rid] = r
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(asdict(r), f, ensure_ascii=False)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.dir / f"{rid}.json")
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def get(self, rid: str, owner: str | None = None) -> StoredResponse | None:
        """The stored response ``rid``, or ``None`` (also when ``owner`` is given and it has another: a server with
        keys gives every request's; ``None`` checks nothing)."""
        r = self._get(rid)
        return r if r is None or owner is None or r.owner == owner else None

    def _get(self, rid: str) -> StoredResponse | None:
        if not isinstance(rid, str) or not _ID.fullmatch(rid):
            return None
        with self._lock:
            r = self._mem.get(rid)
        if r is not None or self.dir is None:
            return r
        try:
            data = json.loads((self.dir / f"{rid}.json").read_text(encoding="utf-8"))
            r = StoredResponse(**data)
        except (OSError, ValueError, TypeError):
            return None
        with self._lock:
            self._mem.setdefault(rid, r)
        return r

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; whether it was stored."""
        found = self._get(rid) is not None
        with self._lock:
            self._mem.pop(rid, None)
        if found and self.dir is not None:
            (self.dir / f"{rid}.json").unlink(missing_ok=True)
        return found
