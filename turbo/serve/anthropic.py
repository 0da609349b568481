"""Anthropic's Messages API over the chat machinery: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

So that the official ``anthropic`` client, and tools built on it, work unchanged against ``liteturbo serve``
(docs/serving.md, "Anthropic Messages"). The Messages shapes are translated, not re-implemented: a request becomes the
chat completion request it means (:func:`read_request`: ``system`` → a system message, content blocks → text,
``tool_use`` blocks → an assistant message's ``tool_calls``, ``tool_result`` blocks → ``tool`` messages,
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` → ``auto`` / ``required`` / a named function / ``none``,
``disable_parallel_tool_use`` → ``parallel_tool_calls: false``, ``stop_sequences`` → ``stop``,
``output_config.format`` → a strict ``json_schema`` response format), read by
:func:`turbo.serve.protocol.read_chat` (the same checks and limits as ``/v1/chat/completions``), answered by the same
engine requests and tool-call reader, and the reply is shaped as a Messages ``message`` (:func:`message_body`:
``text`` and ``tool_use`` content blocks; ``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` with the
sequence, or ``tool_use``) or as its typed server-sent events (:func:`event_stream`: ``message_start``,
``content_block_start`` / ``_delta`` (``text_delta``, ``input_json_delta``) / ``_stop``, ``message_delta``,
``message_stop``; an error after the stream began is one ``error`` event).

Errors on these paths have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(:func:`error_body`), with the same statuses and messages as the OpenAI endpoints; a field this server does not
implement (``thinking`` enabled, image or document blocks, ``mcp_servers``, ...) is refused with a 400 naming it;
fields that change nothing here are accepted (``cache_control``: the prefix cache is automatic; ``inference_geo``,
``speed``, ``diagnostics``, ``user_profile_id``, ``workspace_id``; ``output_config.effort``, for a model without a
reasoning format). The official client no longer sends ``temperature`` / ``top_p`` / ``top_k``; the API still
reads them (``extra_body``), with Anthropic's default temperature 1.
Token counts follow Anthropic's usage everywhere (the reply, ``message_start`` and ``message_delta`` of a stream):
``input_tokens`` is the prompt less the tokens read from the prefix cache (``cache_read_input_tokens``), and
``count_tokens`` answers the whole prompt, their sum (it runs nothing, so it cannot know what the cache will hold,
as Anthropic's cannot). ``message_start`` therefore goes out with the first piece of the reply, when the request's
first step has said how much of the prompt was cached.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from ..http_errors import APIError
from . import protocol
from .responses import EventStream, Job, ReplyDeltas, engine_error, sse_response

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# request fields that change nothing here (a top-level cache_control marker: the prefix cache is automatic)
_BOOKKEEPING = ("cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id")
# Messages fields read here -> what they become; the rest are refused by name (unknown ones by read_chat)
_REFUSED = {
    "mcp_servers": "MCP servers are not implemented; call the tools yourself",
    "container": "code-execution containers are not implemented",
    "context_management": "context management is not implemented",
}


def error_body(e: APIError) -> dict:
    """An :class:`~turbo.http_errors.APIError` in Anthropic's error shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _bad(where: str, must: str) -> APIError:
    return APIError(400, f"{where} {must}", param=where.split(".")[0].split("[")[0])


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (a ``tool_result``'s content, a ``system`` list)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of text blocks {\"type\": \"text\", \"text\": \"...\"}")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{where}[{j}]", f"must be a text block {{\"type\": \"text\", \"text\": \"...\"}}, got "
                                        f"{json.dumps(kind)}: only text is supported here")
        texts.append(block["text"])  # cache_control and citations change nothing here
    return "\n".join(texts)


def _tool(i: int, t: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise _bad(where, "must be a tool {\"name\": ..., \"description\": ..., \"input_schema\": {...}}")
    if t.get("type") not in (None, "custom"):
        raise _bad(f"{where}.type", f"{json.dumps(t.get('type'))[:60]} is a server tool this server does not run; "
                                    f"give client tools (name, description, input_schema)")
    extra = sorted(set(t) - {"name", "description", "input_schema", "type", "cache_control"})
    if extra:
        raise _bad(where, f"has unsupported field {extra[0]!r}: a tool has name, description and input_schema")
    if "input_schema" not in t:
        raise _bad(f"{where}.input_schema", "is missing: the JSON schema of the tool's input (an object schema)")
    f = {"name": t["name"], "parameters": t["input_schema"]}
    if t.get("description") is not None:
        f["description"] = t["description"]
    return {"type": "function", "function": f}


def _tool_choice(c: Any) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) of a Messages ``tool_choice``."""
    if c is None:
        return None, None
    if not isinstance(c, dict) or c.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", 'must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
                                  f'{{"type": "none"}}, got {json.dumps(c)[:80]}')
    extra = sorted(set(c) - {"type", "name", "disable_parallel_tool_use"})
    if extra or ("name" in c) != (c["type"] == "tool"):
        raise _bad("tool_choice", "has type and, for type \"tool\" only, name (and disable_parallel_tool_use)")
    off = c.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise _bad("tool_choice.disable_parallel_tool_use", "must be true or false")
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(c["type"]) or \
        {"type": "function", "function": {"name": c["name"]}}
    return choice, None if off is None else not off


def _blocks(content: list, where: str, role: str, open_ids: list[str]) -> tuple[list, list, list]:
    """(texts, tool calls, tool messages) of one message's content blocks; a ``tool_result`` must answer one of
    ``open_ids`` (removed from it once answered), once, before any text block of its message."""
    texts, calls, results, answered = [], [], [], []
    for j, block in enumerate(content):
        bw = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not block["id"] or not isinstance(block.get("name"), str):
                raise _bad(bw, "(tool_use) needs a non-empty 'id' and the tool's 'name'")
            if not isinstance(block.get("input"), dict):
                raise _bad(f"{bw}.input", "must be the call's input as a JSON object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and role == "user":
            tid = block.get("tool_use_id")
            if texts:  # Anthropic's rule: the results first, any text after them
                raise _bad(bw, "is a tool_result after a text block: in a user message the tool_result blocks come "
                               "first, any text after them")
            if isinstance(tid, str) and tid in answered:
                raise _bad(f"{bw}.tool_use_id", f"{json.dumps(tid)[:80]} is answered a second time in this message: "
                                                f"each tool_use takes one tool_result")
            if not isinstance(tid, str) or tid not in open_ids:
                made = f"its tool_use ids are {', '.join(open_ids)}" if open_ids else "it made no tool_use"
                raise _bad(f"{bw}.tool_use_id", f"{json.dumps(tid)[:80]} does not answer a tool_use of the "
                                                f"assistant message just before ({made}); a tool_result must "
                                                f"follow the assistant message whose tool_use it answers")
            open_ids.remove(tid)
            answered.append(tid)
            text = _text_of(block.get("content", ""), f"{bw}.content")
            results.append({"role": "tool", "tool_call_id": tid,
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind not in ("thinking", "redacted_thinking") or role != "assistant":  # past reasoning: not shown
            what = json.dumps(kind)[:40] if kind else "a block without a known type"
            raise _bad(bw, f"is {what} in a {role} message: this server reads text blocks, tool_use blocks "
                           f"(assistant) and tool_result blocks (user); images and documents are not supported")
    return texts, calls, results


def _unanswered(at: int, ids: list[str], what: str) -> APIError:
    """The 400 of assistant message ``at``'s ``tool_use`` blocks ``ids`` that ``what`` (the next message, or the end
    of the conversation) does not answer (Anthropic's rule and wording)."""
    return _bad(f"messages[{at}]", f"has tool_use ids without tool_result blocks immediately after: "
                                   f"{', '.join(ids)} ({what}). Each tool_use block must have a corresponding "
                                   f"tool_result block in the next message, a user message")


def _messages(raw: Any) -> list[dict]:
    """Messages as chat completion messages. Every ``tool_result`` must answer a ``tool_use`` of the assistant
    message just before, and every ``tool_use`` must be answered by a ``tool_result`` in the message right after it,
    which is a user message (400 naming the message otherwise: a user message without results or with some, another
    assistant message, or the end of the conversation after the ``tool_use``)."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "must be a non-empty list of {\"role\": \"user\" | \"assistant\", \"content\": ...}")
    out: list[dict] = []
    open_ids: list[str] = []  # the tool_use ids of the last assistant message, not yet answered
    open_at = -1  # that message's index
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(where, "must be {\"role\": \"user\" | \"assistant\", \"content\": ...} (system goes in the "
                              "top-level 'system' field)")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise _bad(where, f"has unsupported field {extra[0]!r}: a message has role and content")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise _bad(f"{where}.content", "must be a string or a list of content blocks")
        if open_ids and m["role"] == "assistant":
            raise _unanswered(open_at, open_ids, f"{where} is another assistant message")
        texts, calls, results = _blocks(content, where, m["role"], open_ids)
        if m["role"] == "assistant":
            open_ids, open_at = [c["id"] for c in calls], i
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        if open_ids and results:
            raise _bad(where, f"answers some tool_use blocks but not {', '.join(open_ids)}: give a tool_result for "
                              f"every tool_use of the assistant message before (messages[{open_at}])")
        if open_ids:
            raise _unanswered(open_at, open_ids, f"{where} has no tool_result")
        open_ids = []
        out.extend(results)
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    if open_ids:
        raise _unanswered(open_at, open_ids, "the conversation ends after it")
    return out


def _options(data: dict, body: dict) -> None:
    """Move the Messages options in ``data`` (stop_sequences, temperature's range, metadata, tools, tool_choice)
    into the chat request ``body``."""
    if "stop_sequences" in data:
        stops = data.pop("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
            raise _bad("stop_sequences", "must be a list of non-empty strings")
        if stops:
            body["stop"] = stops
    temperature = data.get("temperature")
    if temperature is not None and (not protocol._is_num(temperature) or not 0 <= temperature <= 1):
        raise _bad("temperature", f"must be a number in [0, 1], got {json.dumps(temperature)[:40]}")
    meta = data.pop("metadata", None)
    if meta is not None:
        if not isinstance(meta, dict) or set(meta) - {"user_id"}:
            raise _bad("metadata", "must be {\"user_id\": \"...\"}")
        if meta.get("user_id") is not None:
            body["user"] = meta["user_id"]
    tools = data.pop("tools", None)
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list of tools {\"name\", \"description\", \"input_schema\"}")
        body["tools"] = [_tool(i, t) for i, t in enumerate(tools)]
    choice, parallel = _tool_choice(data.pop("tool_choice", None))
    if choice is not None and (choice != "none" or tools):
        body["tool_choice"] = choice
    if parallel is not None and tools:
        body["parallel_tool_calls"] = parallel


def translate(data: dict, count_only: bool = False) -> dict:
    """The chat completion request body a Messages body means (400 naming the Messages field when it is not one).
    ``count_only``: a ``count_tokens`` body (no ``max_tokens``, nothing that samples)."""
    data = dict(data)
    for name, why in _REFUSED.items():
        if data.pop(name, None) not in (None, []):
            raise APIError(400, f"'{name}' is not supported by this server: {why}", param=name,
                           code="unsupported_field")
    thinking = data.pop("thinking", None)
    if thinking is not None and thinking != {"type": "disabled"}:
        raise APIError(400, "'thinking' is not supported for this model: it has no reasoning format; leave it out or "
                            "send {\"type\": \"disabled\"}", param="thinking", code="unsupported_field")
    if data.pop("service_tier", "auto") not in ("auto", "standard_only"):
        raise _bad("service_tier", "must be \"auto\" or \"standard_only\"")
    for name in _BOOKKEEPING:  # nothing for this server to do: prefix caching is automatic, one region, one speed
        data.pop(name, None)
    out = data.pop("output_config", None) or {}
    if not isinstance(out, dict) or set(out) - {"effort", "format"}:
        raise _bad("output_config", "must be {\"format\": {\"type\": \"json_schema\", \"schema\": {...}}, "
                                    "\"effort\": ...}")
    fmt = out.get("format")
    if not count_only and data.get("max_tokens") is None:
        raise _bad("max_tokens", "is required: the most tokens the reply may have")
    body: dict = {"messages": []}
    system = data.pop("system", None)
    if system is not None:
        body["messages"].append({"role": "system", "content": _text_of(system, "system")})
    body["messages"] += _messages(data.pop("messages", None))
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
                or set(fmt) - {"type", "schema"}:
            raise _bad("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": {...}}")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                                          "strict": True}}
    _options(data, body)
    for name in ("model", "max_tokens", "stream", "temperature", "top_p", "top_k", "speculative"):
        if name in data:
            body[name] = data.pop(name)
    if data:  # what is left is no Messages field this server reads
        unknown = sorted(data)
        raise APIError(400, f"unrecognized field{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(repr(u) for u in unknown)} in a messages request (docs/serving.md, "
                            f"\"Anthropic Messages\")", param=unknown[0], code="unsupported_field")
    return body


def read_request(data: dict, model_id: str) -> protocol.ChatRequest:
    """A checked ``POST /v1/messages`` body as the :class:`~turbo.serve.protocol.ChatRequest` it means."""
    return protocol.read_chat(translate(data), model_id)


# --- the reply -------------------------------------------------------------------------------------------------------

def new_job(model: str, stream: bool, req: protocol.ChatRequest, tool_parser) -> Job:
    """The :class:`~turbo.serve.responses.Job` of a Messages request (its id ``msg_...``)."""
    reads = req.tools if req.tools is not None and req.tools.parses else None
    return Job("chat", model, stream, tools=reads, tool_parser=tool_parser if reads else None,
               id=f"msg_{uuid.uuid4().hex[:24]}")


def _stop(out, stops: list[str], tokenizer, called: bool, stopped: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply: the stop string that ended it is found where the decoded
    tokens run past the reply's text."""
    if called:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if stops and not stopped:
        rest = tokenizer.decode(out.token_ids, skip_special_tokens=True)[len(out.text):]
        hit = next((s for s in stops if rest.startswith(s)), None)
        if hit is not None:
            return "stop_sequence", hit
    return "end_turn", None


def _input_usage(prompt_tokens: int, cached_tokens: int) -> dict:
    """The input half of a Messages ``usage``, Anthropic's meaning: ``input_tokens`` the prompt tokens not read from
    the prefix cache, ``cache_read_input_tokens`` those read from it (the two add up to the prompt, what
    ``count_tokens`` answers), no cache writes billed apart."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0}


def _usage(out) -> dict:
    return {**_input_usage(out.prompt_tokens, out.cached_tokens), "output_tokens": len(out.token_ids)}


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def message_body(job: Job, out, stops: list[str], tokenizer) -> dict:
    """The Messages ``message`` of a finished reply."""
    message, _ = job.message(out)
    content = [{"type": "text", "text": message["content"]}] if message["content"] else []
    calls = message.get("tool_calls") or []
    content += [_tool_use(c) for c in calls]
    reason, seq = _stop(out, stops, tokenizer, bool(calls), False)
    return {"id": job.id, "type": "message", "role": "assistant", "model": job.model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(out)}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data), ensure_ascii=False)}\n\n"


class _Blocks:
    """The content-block events of one streamed reply: text goes to an open text block; a call (its id and name
    first, then its arguments, whole) is a tool_use block of its own. ``called``: the reply made a call."""

    def __init__(self) -> None:
        self.index, self.open, self.called = 0, None, False  # open: None, "text" or "tool_use"

    def _begin(self, block: dict) -> list[str]:
        events = self.close()
        if events:
            self.index += 1
        self.open = block["type"]
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        """The event that ends the open block (none when no block is open)."""
        return [_event("content_block_stop", {"index": self.index})] if self.open else []

    def of(self, deltas: list[dict]) -> list[str]:
        """The events of the reader's ``deltas``."""
        events = []
        for d in deltas:
            for c in d.get("tool_calls", ()):
                if "id" in c:
                    self.called = True
                    events += self._begin({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                                           "input": {}})
                if c["function"].get("arguments"):
                    events.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": c["function"]["arguments"]}}))
            if d.get("content"):
                if self.open != "text":
                    events += self._begin({"type": "text", "text": ""})
                events.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "text_delta", "text": d["content"]}}))
        return events


async def _events(job: Job, handle, stops: list[str], tokenizer, input_tokens: int) -> AsyncIterator[str]:
    def start(cached: int) -> str:
        """``message_start``, sent once the request's first step said how much of the prompt was cached (with its
        first piece of text), or at the end: its input usage is the final one's."""
        return _event("message_start", {"message": {
            "id": job.id, "type": "message", "role": "assistant", "model": job.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {**_input_usage(input_tokens, max(cached, 0)), "output_tokens": 0}}})
    try:
        blocks, started = _Blocks(), False
        deltas = ReplyDeltas(job, handle)
        async for ds in deltas:
            if not started:
                started = True
                yield start(handle.request.cached_tokens if handle.output is None else handle.output.cached_tokens)
            for e in blocks.of(ds):
                yield e
        out, stopped = handle.output, deltas.stopped
        if not started:
            yield start(out.cached_tokens)
        for e in blocks.close():
            yield e
        reason, seq = _stop(out, stops, tokenizer, blocks.called, stopped)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": _usage(out)})
        yield _event("message_stop", {})
    except Exception as e:  # noqa: BLE001 - after the 200 went out, an error is one event in the stream
        yield _event("error", {"error": error_body(engine_error(e))["error"]})
    finally:
        if handle.output is None:  # the client went away (or the error ended it): free its blocks
            handle.cancel()


def event_stream(job: Job, handle, stops: list[str], tokenizer, input_tokens: int) -> EventStream:
    """The streamed answer of a Messages request: Anthropic's typed server-sent events (``input_tokens``: the
    prompt's length; ``message_start`` and ``message_delta`` give the same input usage)."""
    return sse_response([handle], _events(job, handle, stops, tokenizer, input_tokens))
