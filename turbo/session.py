"""Stateful chat sessions: a conversation's messages, its token history and (while resident) its KV blocks.

:class:`Session` runs turns on its engine through the core's public API (directly, or through
:class:`turbo.loop.EngineLoop` with :meth:`Session.begin_turn` / :meth:`Session.end_turn`), saves itself atomically
with or without its KV cache, and :func:`load_session` restores one (reusing the saved KV only under the same
weights, compute dtype and KV storage).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

from safetensors.torch import load_file, save_file

from lite.formats import LiteturboError, make_dirs

from .chat_render import render_prompt, template_text
from .config import GenerationConfig, generation_config
from .core import EngineCore, GenerationOutput, Request, saved_kv_ref
from .errors import Conflict, InvalidRequest
from .tool_parsers import ToolParser, parser_for_template, reading as tool_reading


class Session:
    """A stateful chat: messages, their token history and (while resident) KV blocks kept between turns.

    Each turn renders the whole conversation with the chat template and computes only the tokens after the
    longest prefix still in the cache, so the result equals running the full conversation statelessly. Under
    memory pressure an idle session's blocks are evicted; its next turn recomputes them (nothing is lost).
    """

    def __init__(self, engine: EngineCore, system: str | None = None) -> None:
        if system is not None and not isinstance(system, str):
            raise LiteturboError(f"the system prompt must be a str or None, got {type(system).__name__}")
        self.engine = engine
        self.system = system
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.seq = engine.new_sequence()
        self.closed = False
        self.busy = False
        self.last: GenerationOutput | None = None
        self.tools: list[dict] | None = None  # OpenAI's tools list the turns are rendered with (turbo.chat_render)
        self._keep_partial, self._before = False, []  # the running turn's: keep a partial reply? history before it
        self._turn_tools: list[dict] | None = None  # the running turn's, kept once it is recorded
        self._turn_reading: dict | None = None  # how the running turn's reply is read for calls (tool_parsers.reading)

    def chat(self, message: str, stream: bool = False, gen: GenerationConfig | None = None, priority: int = 0,
             tools: list[dict] | None = None, tool_call_id: str | None = None, keep_partial: bool = False, **kwargs):
        """Send a user message. Returns the reply text, or with ``stream=True`` an iterator of text pieces.

        A stream closed before its end (or a turn cancelled) leaves the session as it was before the turn: no new
        messages, the token history and KV of the earlier turns; ``keep_partial=True`` keeps the partial reply as
        the assistant's turn instead (a chat UI's Stop button).

        ``tools`` (OpenAI's ``tools`` list) are rendered into this and later turns (see :mod:`turbo.chat_render`;
        ``[]`` removes them); the reply is the model's text, tool-call markup included, and the session keeps it as
        a structured assistant turn: its calls, read in the chat template's format (:mod:`turbo.tool_parsers`), go
        to ``messages[-1]["tool_calls"]`` with their ids. ``tool_call_id``: the message is the result of that tool
        call (a ``tool`` message) instead of the user's; it must be a call of the last assistant turn that made calls
        and not yet answered, with no user turn since (else ``InvalidRequest`` naming ``tool_call_id``, nothing
        changed).

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
        gen = generation_config(gen, kwargs)
        turn_tools = self.tools if tools is None else tools
        read = tool_reading(parser_for_template(template_text(self.engine.tokenizer))) if turn_tools else None
        it = self._turn(message, gen, priority, tools, tool_call_id, keep_partial, read)
        if stream:
            return it
        return "".join(it)

    def _check_idle(self) -> None:
        if self.busy:
            raise Conflict("a reply is still being generated on this session; wait for it to finish, or stop it (close "
                           "the stream / disconnect), or use another session")

    def _turn(self, message: str, gen: GenerationConfig, priority: int, tools, tool_call_id,
              keep_partial: bool, read: dict | None) -> Iterator[str]:
        # runs at the first next(): a stream never started holds nothing
        req, messages = self.begin_turn(message, gen, priority, tools, tool_call_id, keep_partial, read)
        pieces: list[str] = []
        out = None
        try:
            for item in self.engine.drive(req):
                if isinstance(item, GenerationOutput):
                    out = item
                else:
                    pieces.append(item)
                    yield item
        finally:
            self.end_turn(req, messages, out, pieces)

    def begin_turn(self, message: str | list[dict], gen: GenerationConfig, priority: int = 0, tools: list[dict] | None = None,
                   tool_call_id: str | None = None, keep_partial: bool = False,
                   read: dict | None = None) -> tuple[Request, list[dict]]:
        """Mark the session busy and queue its next turn: the request and the conversation it answers. Whoever drives
        the request (this session's stream, or :class:`turbo.loop.EngineLoop`) must call :meth:`end_turn` after.
        ``tools`` / ``tool_call_id`` / ``keep_partial``: see :meth:`chat` (the tools are kept once the turn is
        recorded). ``message`` may also be a list of messages, appended together before the reply (see
        :meth:`_new_messages`; the Responses API's input items). ``read`` (:func:`turbo.tool_parsers.reading`): read the reply for calls and keep them as a
        structured assistant turn (the HTTP front passes the parser, ``max_calls`` and call-id prefix it answers
        with, so the ids it sent are the ids kept); ``None``: the reply is kept as text. Raises ``Conflict`` for a
        busy session, ``InvalidRequest`` for a closed one, bad tools, a ``tool_call_id`` that answers no open call
        (see :meth:`chat`) or a bad prompt."""
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequest("tools must be a list of OpenAI tool objects ({'type': 'function', 'function': ...})")
        if tool_call_id is not None and (not isinstance(tool_call_id, str) or not tool_call_id):
            raise InvalidRequest("tool_call_id must be the id of the tool call this message answers")
        if read is not None:
            ToolParser(read["parser"])  # a bad parser name fails before the session is touched
        with self.engine.lock:
            if self.closed:
                raise InvalidRequest("this session is closed; open a new one with engine.session()")
            self._check_idle()
            if isinstance(message, list):
                new = self._new_messages(message, tool_call_id)
            else:
                if tool_call_id is not None:
                    self._check_tool_call_id(tool_call_id)
                new = [{"role": "user", "content": message} if tool_call_id is None else
                       {"role": "tool", "content": message, "tool_call_id": tool_call_id}]
            self.busy = True
        try:
            messages = self.messages + new
            self._turn_tools = self.tools if tools is None else (tools or None)
            self._turn_reading = read
            self._keep_partial, self._before = bool(keep_partial), list(self.seq.token_ids)
            ids = self._render(messages)
            if len(ids) >= self.engine.session_len and self.engine.config.session_overflow == "drop-oldest":
                messages, ids = self._drop_oldest(messages, ids)
            req = self.engine.add_request(ids, gen, priority=priority, seq=self.seq)
        except BaseException:
            self.busy = False
            raise
        req.keep_cache = True
        return req, messages

    def open_tool_calls(self) -> list[str]:
        """Ids of the calls a tool turn may answer now: those of the last assistant turn that made calls, minus the
        ones already answered, when no user turn came after it (else none)."""
        answered = set()
        for m in reversed(self.messages):
            if m["role"] == "tool":
                answered.add(m.get("tool_call_id"))
            elif m["role"] == "user":
                return []
            elif m["role"] == "assistant" and m.get("tool_calls"):
                return [c["id"] for c in m["tool_calls"] if c["id"] not in answered]
        return []

    def _new_messages(self, items: list, tool_call_id: str | None) -> list[dict]:
        """A turn of several messages (e.g. the Responses API's input items): user messages, assistant messages
        (``tool_calls`` with ``arguments`` as dicts) and tool results, the last one the user's or a tool's; each tool
        message must answer a call still open at its place (InvalidRequest naming it otherwise)."""
        if tool_call_id is not None:
            raise InvalidRequest("tool_call_id goes with a single message; in a list each tool message carries its own")
        if not items:
            raise InvalidRequest("the turn's list of messages is empty")
        open_, out = self.open_tool_calls(), []
        for i, m in enumerate(items):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("user", "assistant", "tool") or not isinstance(m.get("content"), str):
                raise InvalidRequest(f"the turn's message {i} must be a user, assistant or tool message with text "
                                     f"content")
            if role == "tool":
                if m.get("tool_call_id") not in open_:
                    made = f"the calls waiting are {', '.join(open_)}" if open_ else "no call waits for a result"
                    raise InvalidRequest(f"the turn's message {i} answers tool_call_id "
                                         f"{json.dumps(m.get('tool_call_id'))[:80]}, which no open call has ({made})")
                open_.remove(m["tool_call_id"])
            else:
                open_ = [c["id"] for c in m.get("tool_calls") or ()] if role == "assistant" else []
            out.append(dict(m))
        if out[-1]["role"] == "assistant":
            raise InvalidRequest("the turn's last message is the assistant's: end with the user's message or a "
                                 "tool's result, the reply comes after it")
        return out

    def _check_tool_call_id(self, tool_call_id: str) -> None:
        open_ = self.open_tool_calls()
        if tool_call_id not in open_:
            made = f"the calls waiting for a result are {', '.join(open_)}" if open_ else \
                "no call of this session waits for a result"
            raise InvalidRequest(f"tool_call_id {json.dumps(tool_call_id)[:80]} answers no call of this session "
                                 f"({made}); send the id of a call the last assistant turn made, or a user turn")

    def _assistant_turn(self, reply: str, out: GenerationOutput) -> dict:
        """The assistant message a reply is kept as: with its calls (``arguments`` as dicts, as chat templates
        take them) when the turn reads calls and the reply made some, else its text."""
        read = self._turn_reading
        if read is None:
            return {"role": "assistant", "content": reply}
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in self._turn_tools or []
                   if isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)}
        content, calls = ToolParser(read["parser"]).parse(reply, read["max_calls"], out.finish_reason == "length",
                                                          read["call_id_prefix"], schemas)
        try:  # a call is complete JSON (turbo.tool_parsers); were one not, the turn is kept as text, never lost
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                     for c in calls]
        except ValueError:
            calls = []
        if not calls:
            return {"role": "assistant", "content": reply}
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def _render(self, messages: list[dict]) -> list[int]:
        if self._turn_tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            text = render_prompt(self.engine.tokenizer, messages, self._turn_tools)
            return self.engine.encode(text, add_special_tokens=False)
        return self.engine.chat_template_ids(messages)

    def _drop_oldest(self, messages: list[dict], ids: list[int]) -> tuple[list[dict], list[int]]:
        """``session_overflow="drop-oldest"``: drop the oldest whole turns (a user message and what answered it), the
        system prompt kept, until the conversation fits ``session_len`` or only the new message is left (then
        :meth:`~turbo.core.engine.EngineCore.add_request` refuses it with both numbers)."""
        head = 1 if messages and messages[0]["role"] == "system" else 0
        while len(ids) >= self.engine.session_len and len(messages) - 1 > head:  # earlier turns are left
            starts = [i for i in range(head + 1, len(messages) - 1) if messages[i]["role"] == "user"]
            cut = starts[0] if starts else len(messages) - 1  # the second turn's start, or all but the new message
            messages = messages[:head] + messages[cut:]
            ids = self._render(messages)
        return messages, ids

    def end_turn(self, req: Request, messages: list[dict], out: GenerationOutput | None, pieces: list[str]) -> None:
        """Record a finished (or abandoned) turn: ``out`` is the request's output, or ``None`` when the consumer
        stopped early (the request is cancelled here); ``pieces`` the text streamed so far. A cancelled turn (client
        gone) is rolled back (see :meth:`chat`) unless it was begun with ``keep_partial`` and produced text; ``last``
        is its output with finish_reason "cancelled" either way."""
        if out is None:
            self.engine.cancel(req)
            out = self.engine.output(req)
        if out.finish_reason == "cancelled" and (not self._keep_partial or not (out.token_ids or pieces)):
            self.engine.rewind(self.seq, self._before)  # nothing to keep: as before the turn, the earlier KV kept
            self.last, self.busy = out, False
            return
        reply = out.text if out.token_ids else "".join(pieces)
        # a failed turn is kept only with the text its client already saw; one that failed before any text (e.g. its
        # constraint refused the first token) leaves the conversation as it was
        if (out.token_ids or pieces) if out.finish_reason != "error" else reply:
            self.messages = messages + [self._assistant_turn(reply, out)]
            self.tools = self._turn_tools
        if out.finish_reason == "error" or not (out.token_ids or pieces):
            # a failed turn's tokens and K/V must not poison the next turns, and a turn that produced nothing
            # (cancelled while its prompt was computed) must not keep its prompt's blocks: drop the token history
            # and its blocks; the next turn renders ``messages`` again and recomputes (full blocks of earlier turns
            # still come from the prefix cache)
            self.engine.drop_sequence(self.seq)
            self.seq = self.engine.new_sequence()
        self.last = out
        self.busy = False

    def save(self, path: str | Path, include_kv: bool = False) -> Path:
        """Write the session (messages, token history, optionally its KV) to folder ``path``, atomically.

        ``include_kv`` stores the cached K/V of the computed tokens in the cache's own form (``kv.safetensors``,
        per layer ``[tokens, kv_heads, ...]``: 16-bit values, or int8/int4 codes with their scales) so a restore
        needs no recompute; it is only reused by the same model weights, compute dtype and KV storage
        (an engine with another KV dtype recomputes the history, with a warning). A tensor-parallel engine saves
        each rank's shard and its ``tensor_parallel_size``; an engine of another size recomputes, with a warning.
        Raises ``LiteturboError`` while a reply streams.
        """

        self._check_idle()
        path = Path(path).expanduser().absolute()
        if path.exists() and not (path / "session.json").is_file():
            raise LiteturboError(f"{path} exists and is not a saved session; choose another folder")
        make_dirs(path.parent, "the folder of the session")
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            n = self.seq.num_computed if include_kv else 0
            meta = {"format": "liteturbo-session/1", "system": self.system, "messages": self.messages, "tools": self.tools,
                    "token_ids": self.seq.token_ids, "kv_tokens": n, "model_fingerprint": self.engine.fingerprint(),
                    "kv_storage": self.engine.kv_storage, "tensor_parallel_size": self.engine.tensor_parallel_size}
            if n:
                # the stored form ([tokens, KVH, ...] per layer: 16-bit values, or int8/int4 codes and scales)
                save_file(self.engine.export_kv(self.seq), str(tmp / "kv.safetensors"))
                meta["kv_sha256"] = _sha256(tmp / "kv.safetensors")
            (tmp / "session.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
            os.chmod(tmp, 0o755)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
            if n:  # the disk tier: an evicted session loads this back instead of recomputing
                self.seq.disk_kv = saved_kv_ref(path / "kv.safetensors", self.seq.token_ids[:n])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt) and free its KV blocks."""
        self._check_idle()
        self.engine.drop_sequence(self.seq)
        self.seq = self.engine.new_sequence()
        self.messages = self.messages[:1] if self.system is not None else []

    def close(self) -> None:
        """Free the session's KV blocks; further ``chat`` calls raise. Raises ``LiteturboError`` while a reply
        streams (finish reading it, or close the stream, first)."""
        self._check_idle()
        with self.engine.lock:
            if not self.closed:
                self.engine.drop_sequence(self.seq)
            self.closed = True


def load_session(engine: EngineCore, path: str | Path) -> Session:
    """Restore into ``engine`` a session written by :meth:`Session.save`. Its KV is reloaded when it was saved by the same
    weights and dtype (else recomputed on the next turn). Raises ``LiteturboError`` for a bad folder."""

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
            isinstance(m, dict) and isinstance(m.get("role"), str) and (
                isinstance(m.get("content"), str) or m.get("content") is None and isinstance(m.get("tool_calls"), list))
            for m in messages):
        raise LiteturboError(f"{bad}: 'messages' must be a list of {{'role': str, 'content': str}} (content null "
                             f"only beside 'tool_calls')")
    if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size
            for t in token_ids):
        raise LiteturboError(f"{bad}: 'token_ids' must be a list of token ids of this model's vocabulary")
    tools = meta.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise LiteturboError(f"{bad}: 'tools' must be a list of tool objects or null")
    s = Session(engine, system)
    s.messages, s.tools = list(messages), tools
    s.seq.token_ids = list(token_ids)
    if s.seq.token_ids:
        engine.check_prompt(s.seq.token_ids, session=True)
    n = meta.get("kv_tokens", 0)
    if n == 0:
        return s  # saved without KV: the next turn computes the history

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
    # sessions saved before the KV cache had a dtype of its own stored it in the compute dtype
    saved_as = meta.get("kv_storage", str(engine.dtype).removeprefix("torch."))
    if saved_as != engine.kv_storage:
        return drop(f"it was saved as {saved_as!r} but this engine's cache is {engine.kv_storage!r}")
    saved_tp = meta.get("tensor_parallel_size", 1)  # the KV is saved per rank shard
    if saved_tp != engine.tensor_parallel_size:
        return drop(f"it was saved by an engine split over tensor_parallel_size={saved_tp!r} ranks, each rank's KV "
                    f"heads apart, but this engine runs {engine.tensor_parallel_size}")
    digest = meta.get("kv_sha256")
    if digest is not None and digest != _sha256(kv_file):
        return drop("kv.safetensors does not match the checksum in session.json: it was changed or damaged")
    kv = _load_session_kv(kv_file)
    if kv is None:
        return drop("kv.safetensors cannot be read")
    s.seq.disk_kv = saved_kv_ref(kv_file, token_ids[:n])  # the disk tier: loaded when there is room, if not now
    why = engine.import_kv(s.seq, kv, n)
    if why is not None and why.startswith("the KV pool has no room"):
        warnings.warn(f"{path}: the saved KV cache is not loaded now ({why}); the next turn loads it from this file "
                      f"when there is room, else recomputes the {len(token_ids)} tokens of history", stacklevel=2)
    elif why is not None:
        s.seq.disk_kv = None
        return drop(why)
    return s


def _sha256(file: Path) -> str:

    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_session_kv(file: Path) -> dict | None:
    """The saved KV tensors, or ``None`` when the file is unreadable (shapes are checked by the cache)."""
    try:
        return load_file(str(file))
    except Exception:
        return None
