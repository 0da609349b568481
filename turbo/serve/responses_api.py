"""OpenAI's Responses API on sessions: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is translated into the chat it means (:func:`read_request`): ``input`` (text, or items: messages with
``input_text`` / ``output_text`` parts, ``function_call`` and ``function_call_output`` items) after the stored
conversation of ``previous_response_id``, ``instructions`` as the system message (not carried over from the previous
response, as OpenAI does), ``tools`` (function tools, flat), ``tool_choice``, ``text.format`` (``json_schema`` /
``json_object``), ``max_output_tokens`` and the sampling fields; the whole conversation is then checked by
:func:`turbo.serve.protocol.read_chat` (the same checks and limits as ``/v1/chat/completions``).

What makes ``previous_response_id`` fast: a stored response (``store``, the default) lives in a session
(:class:`~turbo.engine_proc.sessions.SessionRegistry`), and a response that continues the latest response of its
session is that session's next turn (:func:`submit`): only the new items are prefilled, the history's KV is the
session's (``usage.input_tokens_details.cached_tokens`` ≈ the history), and with ``--session-dir`` it survives a
restart (sessions are saved after every turn; the responses under the session dir, :mod:`turbo.serve.response_store`).
A response that continues an older one (a branch), whose session expired, or whose ``instructions`` differ starts
a session of its own with the stored conversation (its KV from the prefix cache where the blocks are still there).
At most ``cap`` such sessions live (:class:`ResponseSessions`, least recently used first; default 64): one-off
responses do not fill the session registry or the session dir.
``store: false`` runs as a plain chat and keeps nothing.

The answer is a ``response`` object (:meth:`Answer.body`: ``message`` items with ``output_text`` and
``function_call`` items whose ``call_id`` a ``function_call_output`` answers; ``status`` ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when the limit cut it), or its typed server-sent events
(:func:`event_stream`: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``, ``response.content_part.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``, then ``response.completed``
or ``response.incomplete``; an error after the stream began is one ``error`` event), each with its
``sequence_number``. Fields the server cannot honour (built-in tools, ``reasoning``, ``background``, ``include``,
``conversation``, image and file inputs, ...) are refused with a 400 naming them.
"""
from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..errors import Conflict, NotFound, OverCapacity
from ..http_errors import APIError
from ..sglang_route import ROUTER_FILLS
from . import protocol
from .response_store import ResponseStore, StoredResponse
from .responses import EventStream, Job, ReplyDeltas, engine_error, sse_response

_REFUSED = {  # field -> (harmless value test, why)
    "background": (lambda v: v is False, "background responses are not implemented; wait for the answer or stream it"),
    "conversation": (lambda v: False, "conversations objects are not implemented; chain with previous_response_id"),
    "include": (lambda v: v == [], "no extra output data is available"),
    "reasoning": (lambda v: v == {} or all(x is None for x in v.values()) if isinstance(v, dict) else False,
                  "this model has no reasoning format"),
    "prompt": (lambda v: False, "stored prompt templates are not implemented; send the input"),
    "max_tool_calls": (lambda v: False, "not implemented; use parallel_tool_calls: false for one call"),
    "top_logprobs": (lambda v: v == 0, "log-probabilities are on /v1/chat/completions"),
    "truncation": (lambda v: v == "disabled", "only \"disabled\": a conversation longer than the context is refused"),
}
_IGNORED = ("prompt_cache_key", "prompt_cache_retention", "safety_identifier", "service_tier", "stream_options")


def _bad(param: str, what: str) -> APIError:
    return APIError(400, what, param=param)


def _text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("input", f"{where} must be a string or a list of text parts")
    texts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds or not isinstance(p.get("text"), str):
            raise _bad("input", f"{where}[{j}] is {json.dumps(kind)[:40]}: this server reads text parts "
                                f"({' / '.join(kinds)}); images, files and audio are not supported")
        texts.append(p["text"])
    return "\n".join(texts)


def _items(raw: Any, continuing: bool) -> list[dict]:
    """``input`` as chat messages in the request's shape (``arguments`` as JSON text)."""
    if isinstance(raw, str):
        if not raw.strip():
            raise _bad("input", "'input' is empty: send the user's text or a list of items")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("input", "'input' must be a string or a non-empty list of items (messages, function_call, "
                            "function_call_output)")
    out: list[dict] = []
    for i, it in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise _bad("input", f"{where} must be an item object")
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad("input", f"{where}.role {json.dumps(role)[:40]} must be user, assistant, system or developer")
            if role in ("system", "developer"):
                if continuing or any(m["role"] != "system" for m in out):
                    raise _bad("input", f"{where} is a {role} message after the conversation began: give it as "
                                        f"'instructions' (or first, in a conversation without previous_response_id)")
                role = "system"
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text", "text")
            out.append({"role": role, "content": _text(it.get("content"), f"{where}.content", kinds)})
        elif kind == "function_call":
            if not all(isinstance(it.get(k), str) and it.get(k) for k in ("call_id", "name")) or \
                    not isinstance(it.get("arguments"), str):
                raise _bad("input", f"{where} (function_call) needs call_id, name and arguments (JSON text)")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)  # the same reply: its text, then its calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not it["call_id"]:
                raise _bad("input", f"{where} (function_call_output) needs the call_id of the call it answers")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _text(it.get("output"), f"{where}.output", ("input_text", "output_text"))})
        else:
            raise _bad("input", f"{where} has type {json.dumps(kind)[:40]}: this server reads message, function_call "
                                f"and function_call_output items")
    if out[-1]["role"] not in ("user", "tool"):
        raise _bad("input", "the last input item must be the user's message or a function_call_output: the reply "
                            "comes after it")
    return out


def _tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools", "'tools' must be a list of function tools {\"type\": \"function\", \"name\", "
                            "\"parameters\"}")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad("tools", f"tools[{i}] has type {json.dumps(kind)[:40]}: this server runs function tools only "
                                f"(no built-in web search, file search, code interpreter or MCP)")
        extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise _bad("tools", f"tools[{i}] has unsupported field {extra[0]!r}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def _tool_choice(c: Any) -> Any:
    if c is None or c in ("auto", "none", "required"):
        return c
    if isinstance(c, dict) and c.get("type") == "function" and set(c) == {"type", "name"}:
        return {"type": "function", "function": {"name": c["name"]}}
    raise _bad("tool_choice", f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                              f"\"name\": ...}}, got {json.dumps(c)[:80]}")


def _format(text: Any) -> tuple[dict | None, dict]:
    """(the chat request's response_format, the response's ``text`` echo) of ``text``."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _bad("text", "'text' must be {\"format\": {...}}")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text", "'text.verbosity' is not supported (only \"medium\")")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, {"format": fmt}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": fmt}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if extra:
            raise _bad("text", f"'text.format' has unsupported field {extra[0]!r}")
        spec = {"name": fmt.get("name") or "output", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}, {"format": fmt}
    raise _bad("text", "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                       "\"json_schema\", \"name\": ..., \"schema\": {...}}")


@dataclass
class ResponsesRequest:
    """A checked ``POST /v1/responses``: ``chat`` (the whole conversation as a checked chat request), ``prefix``
    (how many of its messages came before this request: the previous response's conversation, or the system message),
    ``messages`` (the conversation in the request's shape), ``previous`` (the stored response it continues), ``store``,
    ``echo`` (the request fields the response object repeats) and ``owner`` (the key's owner tag, or ``None``)."""

    chat: protocol.ChatRequest
    prefix: int
    messages: list[dict]
    system: str | None
    previous: StoredResponse | None
    store: bool
    echo: dict = field(default_factory=dict)
    owner: str | None = None  # the owner tag of the request's key: its response and session are that owner's


def _chat_body(data: dict, messages: list[dict]) -> tuple[dict, dict, list | None, Any]:
    """(the chat request body of the options left in ``data`` around ``messages``, the response's ``text`` echo, the
    chat tools, the chat tool_choice); 400 naming a field the API has but this server does not read."""
    body: dict[str, Any] = {"messages": messages}
    fmt, text_echo = _format(data.pop("text", None))
    if fmt is not None:
        body["response_format"] = fmt
    tools = _tools(data.pop("tools", None))
    if tools:
        body["tools"] = tools
    choice = _tool_choice(data.pop("tool_choice", None))
    if choice is not None and (tools or choice != "none"):
        body["tool_choice"] = choice
    if "max_output_tokens" in data:
        body["max_tokens"] = data.pop("max_output_tokens")
    for name in ("model", "stream", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "parallel_tool_calls", "user", "speculative"):
        if name in data:
            body[name] = data.pop(name)
    if data:
        unknown = sorted(data)
        raise APIError(400, f"unrecognized field{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(repr(u) for u in unknown)} in a responses request (docs/serving.md, "
                            f"\"Responses\")", param=unknown[0], code="unsupported_field")
    return body, text_echo, tools, choice


def read_request(data: dict, model_id: str, store: ResponseStore, owner: str | None = None) -> ResponsesRequest:
    """A ``POST /v1/responses`` body (400 naming the field; 400 ``previous_response_not_found`` for an unknown
    ``previous_response_id``, as OpenAI answers, and for another ``owner``'s: it does not exist for this key)."""
    data = dict(data)
    # what sglang-router adds to every response it forwards (turbo/sglang_route.py), at its values only
    fills = {name: data.pop(name) for name in ROUTER_FILLS["responses"] if name in data}
    protocol.read_router_defaults(protocol.Body(fills, "a responses request"), "responses")
    for name, (harmless, why) in _REFUSED.items():
        v = data.pop(name, None)
        if v is not None and not harmless(v):
            raise APIError(400, f"'{name}' is not supported by this server: {why}", param=name,
                           code="unsupported_field")
    for name in _IGNORED:
        data.pop(name, None)
    keep = data.pop("store", True)
    if not isinstance(keep, bool):
        raise _bad("store", "'store' must be true or false")
    prev_id = data.pop("previous_response_id", None)
    previous = None
    if prev_id is not None:
        previous = store.get(prev_id, owner)
        if previous is None:  # 400 with this code, as OpenAI answers it (clients recover by the code)
            raise APIError(400, f"Previous response with id {json.dumps(prev_id)[:80]} not found: it was never "
                                f"stored (store: false), was deleted, or belongs to another server; send the whole "
                                f"conversation as input instead", param="previous_response_id",
                           code="previous_response_not_found")
    system = data.pop("instructions", None)
    if system is not None and not isinstance(system, str):
        raise _bad("instructions", "'instructions' must be a string")
    meta = data.pop("metadata", None)
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16 or
                             not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise _bad("metadata", "'metadata' must be an object of at most 16 string values")
    history = [m for m in previous.messages if m["role"] != "system"] if previous else []
    head = [{"role": "system", "content": system}] if system is not None else []
    new = _items(data.pop("input", None), continuing=previous is not None)
    if new[0]["role"] == "system" and head:
        raise _bad("input", "give the system prompt once: as 'instructions' or as the first input message")
    messages = head + history + new
    body, text_echo, tools, choice = _chat_body(data, messages)
    chat = protocol.read_chat(body, model_id)
    echo = {"instructions": system, "metadata": meta or {}, "previous_response_id": prev_id, "store": keep,
            "text": text_echo, "tools": [dict(type="function", **t["function"]) for t in tools or []],
            "tool_choice": choice or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "max_output_tokens": body.get("max_tokens"), "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None}, "user": body.get("user")}
    if chat.n != 1:
        raise _bad("n", "'n' is not a responses field")
    if system is None and new[0]["role"] == "system":  # the first input item was the system prompt
        system = new[0]["content"]
    return ResponsesRequest(chat, len(head) + len(history), messages, system, previous, keep, echo, owner)


# --- the session a response runs in ---------------------------------------------------------------------------------

_HEAD = threading.Lock()  # one head check + turn submission at a time, so two continuations cannot both extend it


class ResponseSessions:
    """The sessions stored responses run in, least recently used first; at most ``cap`` of them live: the oldest
    beyond it is deleted (its responses stay stored, and continuing one later starts a session with the stored
    conversation), so one-off responses do not fill the session registry or the session dir."""

    def __init__(self, cap: int = 64) -> None:
        self.cap = cap
        self.order: "collections.OrderedDict[str, None]" = collections.OrderedDict()

    def touch(self, sid: str) -> None:
        """Mark session ``sid`` as used now (the most recent)."""
        self.order[sid] = None
        self.order.move_to_end(sid)

    def shed(self, client, keep: int) -> None:
        """Delete the least recently used sessions until at most ``keep`` remain (busy ones are skipped)."""
        for sid in list(self.order):
            if len(self.order) <= keep:
                return
            try:
                client.session_delete(sid)  # the server's housekeeping: no owner, every key's sessions share the cap
            except Conflict:  # generating now: it stays
                continue
            except NotFound:
                pass
            self.order.pop(sid, None)


def submit(client, r: ResponsesRequest, gen, persist: bool, read: dict | None, live: ResponseSessions):
    """Queue a stored response (``store: true``) on the engine as a session turn; returns ``(handle, session id)``.
    When its previous response is its session's latest turn (and the instructions are the same) it is that session's
    next turn; otherwise it starts a session with the whole conversation. (``store: false`` is a plain request of the
    rendered chat: the route's.)"""
    chat = r.chat
    tools = chat.tools.openai() if chat.tools else None
    with _HEAD:
        prev = r.previous
        if prev is not None and prev.session_id is not None and prev.system == r.system:
            try:
                info = client.session_info(prev.session_id, r.owner)
            except NotFound:
                info = None
            if info is not None and not info["busy"] and len(info["messages"]) == len(prev.messages):
                handle = client.submit_chat(prev.session_id, chat.messages[r.prefix:], gen, persist, tools, None,
                                            False, read, r.owner)
                live.touch(prev.session_id)
                return handle, prev.session_id
        live.shed(client, live.cap - 1)
        try:
            sid = client.session_create(r.system, owner=r.owner)
        except OverCapacity:  # the registry is full of other sessions: give up ours, oldest first, then retry once
            live.shed(client, 0)
            sid = client.session_create(r.system, owner=r.owner)
        live.touch(sid)
        start = 1 if r.system is not None else 0
        try:
            handle = client.submit_chat(sid, chat.messages[start:], gen, persist, tools, None, False, read, r.owner)
        except BaseException:
            client.session_delete(sid)
            raise
        return handle, sid


# --- the answer ------------------------------------------------------------------------------------------------------

def _usage(out) -> dict:
    n = len(out.token_ids)
    return {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": out.cached_tokens},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.prompt_tokens + n}


class Answer:
    """One response being answered: its id, the request, its job (how the reply is read) and its session."""

    def __init__(self, r: ResponsesRequest, job: Job, model: str) -> None:
        self.r, self.job, self.model = r, job, model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.session_id: str | None = None
        self.msg_id, self.fc_ids = f"msg_{uuid.uuid4().hex}", {}

    def fc_id(self, call_id: str) -> str:
        """The ``fc_...`` item id of the tool call ``call_id`` (made at its first use, the same after)."""
        return self.fc_ids.setdefault(call_id, f"fc_{uuid.uuid4().hex}")

    def base(self, status: str, output: list, usage: dict | None, incomplete: bool = False) -> dict:
        """The Responses API ``response`` object: ``status`` (``in_progress``, ``completed``, ``incomplete``),
        ``output`` items, ``usage`` (or ``None`` while streaming); ``incomplete``: cut at ``max_output_tokens``."""
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "model": self.model,
                "output": output, "usage": usage, **self.r.echo}

    def text_item(self, text: str, status: str) -> dict:
        """The reply's ``message`` output item holding ``text`` (one ``output_text`` part)."""
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(self, call: dict, status: str = "completed") -> dict:
        """The ``function_call`` output item of ``call`` (a chat-completions tool call: id, function name and
        arguments as a JSON string)."""
        return {"type": "function_call", "id": self.fc_id(call["id"]), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def body(self, out) -> tuple[dict, dict]:
        """(the response object of a finished reply, the assistant message it adds to the conversation)."""
        message, _ = self.job.message(out)
        cut = out.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        output = [self.text_item(message["content"], status)] if message["content"] else []
        output += [self.call_item(c) for c in message.get("tool_calls") or ()]
        return self.base(status, output, _usage(out), incomplete=cut), message

    def record(self, store: ResponseStore, body: dict, message: dict) -> None:
        """Store the answered response (``store: true``): its object and the conversation after it."""
        if self.r.store:
            store.put(self.id, StoredResponse(body, self.r.messages + [message], self.session_id, self.r.system,
                                              self.r.owner))


class _OutputEvents:
    """The typed events of one streamed reply's output items: its text (one ``message`` item) and its calls (a
    ``function_call`` item each), numbered by ``sequence_number``."""

    def __init__(self, a: Answer) -> None:
        self.a, self.seq = a, 0
        self.text: list[str] = []
        self.index, self.open_text = 0, False  # the next output index; a message item is open
        self.calls: dict[int, dict] = {}  # the reply's calls by their index in the reply: {"call", "output_index"}

    def event(self, kind: str, **data) -> str:
        """One server-sent event of type ``kind`` with ``data`` and the next ``sequence_number``."""
        self.seq += 1
        body = dict(type=kind, sequence_number=self.seq - 1, **data)
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def close_text(self) -> list[str]:
        """The events that end the open message item (none when no text is open)."""
        if not self.open_text:
            return []
        a, t, i = self.a, "".join(self.text), self.index
        part = {"type": "output_text", "text": t, "annotations": [], "logprobs": []}
        self.open_text, self.index = False, i + 1
        return [self.event("response.output_text.done", item_id=a.msg_id, output_index=i, content_index=0, text=t,
                           logprobs=[]),
                self.event("response.content_part.done", item_id=a.msg_id, output_index=i, content_index=0, part=part),
                self.event("response.output_item.done", output_index=i, item=a.text_item(t, "completed"))]

    def text_delta(self, piece: str) -> list[str]:
        """The events of one piece of reply text: the message item and its part opened first if none is."""
        a, ev = self.a, []
        if not self.open_text:
            self.open_text = True
            ev += [self.event("response.output_item.added", output_index=self.index,
                              item=dict(a.text_item("", "in_progress"), content=[])),
                   self.event("response.content_part.added", item_id=a.msg_id, output_index=self.index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []})]
        self.text.append(piece)
        return ev + [self.event("response.output_text.delta", item_id=a.msg_id, output_index=self.index,
                                content_index=0, delta=piece, logprobs=[])]

    def call_delta(self, c: dict) -> list[str]:
        """A tool reader's call delta (its id and name first, then its arguments)."""
        a, ev = self.a, []
        if "id" in c:
            ev += self.close_text()
            call = {"id": c["id"], "function": {"name": c["function"]["name"], "arguments": ""}}
            self.calls[c["index"]] = {"call": call, "output_index": self.index + len(self.calls)}
            ev.append(self.event("response.output_item.added", output_index=self.calls[c["index"]]["output_index"],
                                 item=a.call_item(call, "in_progress")))
        entry, delta = self.calls[c["index"]], c["function"].get("arguments") or ""
        if delta:
            entry["call"]["function"]["arguments"] += delta
            ev.append(self.event("response.function_call_arguments.delta", item_id=a.fc_id(entry["call"]["id"]),
                                 output_index=entry["output_index"], delta=delta))
        return ev

    def deltas(self, deltas: list[dict]) -> list[str]:
        """The events of a tool reader's deltas (or ``[{"content": piece}]`` without one)."""
        ev: list[str] = []
        for d in deltas:
            if d.get("content"):
                ev += self.text_delta(d["content"])
            for c in d.get("tool_calls", ()):
                ev += self.call_delta(c)
        return ev

    def finish(self) -> list[str]:
        """The events that end every open item."""
        ev = self.close_text()
        for entry in self.calls.values():
            call = entry["call"]
            ev += [self.event("response.function_call_arguments.done", item_id=self.a.fc_id(call["id"]),
                              output_index=entry["output_index"], arguments=call["function"]["arguments"]),
                   self.event("response.output_item.done", output_index=entry["output_index"],
                              item=self.a.call_item(call))]
        return ev


async def _events(a: Answer, handle, store: ResponseStore) -> AsyncIterator[str]:
    job, out_ev = a.job, _OutputEvents(a)
    try:
        yield out_ev.event("response.created", response=a.base("in_progress", [], None))
        yield out_ev.event("response.in_progress", response=a.base("in_progress", [], None))
        async for ds in ReplyDeltas(job, handle):
            for e in out_ev.deltas(ds):
                yield e
        out, ends = handle.output, []
        for e in ends + out_ev.finish():
            yield e
        body, message = a.body(out)
        a.record(store, body, message)
        yield out_ev.event("response.completed" if body["status"] == "completed" else "response.incomplete",
                           response=body)
    except Exception as e:  # noqa: BLE001 - after the 200 went out, an error is one event in the stream
        err = engine_error(e)
        yield out_ev.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        if handle.output is None:  # the client went away (or the error ended it): free its blocks
            handle.cancel()


def event_stream(a: Answer, handle, store: ResponseStore) -> EventStream:
    """The streamed answer of a response: the Responses API's typed server-sent events; the response is stored when
    it ends."""
    return sse_response([handle], _events(a, handle, store))
