"""What the HTTP server answers: OpenAI's response and chunk shapes, server-sent events, engine errors as HTTP ones.

- :func:`engine_error` turns an engine exception into an :class:`~turbo.http_errors.APIError` (typed errors keep
  their status, others are 500s); :func:`cancelled_error` is the 503 of a request cancelled by a stopping server.
- :class:`Job`: one generation to answer (a chat completion, a completion or a session turn) and its options;
  :func:`reply_body` is its JSON answer, :func:`event_stream` its server-sent events (``data: {...}`` chunks in
  OpenAI's shapes, ending with ``data: [DONE]``; an error after the stream began is one ``data: {"error": ...}``
  event before it).
- A job has one choice per engine request (``n`` > 1: several, answered as ``choices[i]``; a stream interleaves
  their chunks as they come, each with its ``index``; ``usage`` counts the shared prompt once). A chat with tools
  reads each reply for calls (:mod:`turbo.tool_parsers`): the message gets ``tool_calls`` and the finish
  reason ``tool_calls``; a stream sends ``tool_calls`` deltas as OpenAI does (the call's id, type and name first,
  then its arguments), each call once its JSON closed; a call cut by ``max_tokens`` is dropped whole. With a
  reasoning parser (a thinking model) the reasoning goes to ``reasoning_content`` (streamed as its own deltas) and
  the rest is the reply.
- Log-probability entries (their bytes, token strings and text offsets) are :mod:`turbo.serve.logprobs`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from lite.formats import LiteturboError

from ..engine import GenerationOutput
from ..errors import OverCapacity, http_status
from ..http_errors import APIError
from ..loop import RequestHandle
from .logprobs import Logprobs, TextOffsets, Tokens, logprob_entries
from .tools import finish_reason

log = logging.getLogger("liteturbo.server")


def engine_error(e: BaseException) -> APIError:
    """The :class:`APIError` of an exception raised by the engine (typed errors keep their status)."""
    if isinstance(e, APIError):
        return e
    status = http_status(e)
    headers = {}
    if isinstance(e, OverCapacity):
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
    if status >= 500 and not isinstance(e, LiteturboError):
        log.error("the engine failed on a request", exc_info=(type(e), e, e.__traceback__))
        return APIError(500, f"the engine failed while running this request ({type(e).__name__}: {e}); "
                             f"see the server log")
    return APIError(status, str(e), headers=headers)


def cancelled_error() -> APIError:
    """The error of a request the engine loop cancelled (it stops with the server)."""
    return APIError(503, "the request was cancelled: the server is shutting down; retry")


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


# --- one generation's answer -----------------------------------------------------------------------------------------

_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "session": "turn-"}


@dataclass
class Job:
    """One generation to answer: what kind of response (``"chat"``, ``"completion"`` or ``"session"``), for which
    model id, and its options. ``tools`` (a :class:`~turbo.serve.tools.ToolRequest`) and ``tool_parser`` (a
    :class:`~turbo.tool_parsers.ToolParser`): a chat whose replies are read for tool calls; ``call_id_prefix``
    (a session turn's): its calls' ids follow :func:`turbo.tool_parsers.new_call_id_prefix`'s rule, as the session
    keeps them. ``id`` defaults to a fresh one with the kind's prefix."""

    kind: str
    model: str
    stream: bool
    include_usage: bool = False
    logprobs: Logprobs | None = None
    session_id: str | None = None
    tools: Any = None
    tool_parser: Any = None
    call_id_prefix: str | None = None
    reasoning: Any = None  # a ReasoningParser (turbo/reasoning_parsers.py): replies split into reasoning and content
    prompt_open: bool = False  # the prompt opened the reasoning block
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{_ID_PREFIX[self.kind]}{uuid.uuid4().hex[:24]}"

    def finish(self, reason: str, called: bool) -> str:
        """OpenAI's finish reason of a reply that made calls or not (:func:`turbo.serve.tools.finish_reason`)."""
        if not called:
            return reason
        return finish_reason(reason, [True], self.tools)

    def message(self, out: GenerationOutput) -> tuple[dict, str]:
        """A finished chat reply's ``message`` and finish reason (``tool_calls`` when it made calls); with a
        reasoning parser, its reasoning as ``reasoning_content`` (``None`` when it had none) and the rest read as
        the reply."""
        text, head = out.text, {"role": "assistant"}
        if self.reasoning is not None:
            thought, text = self.reasoning.split(out.text, self.prompt_open)
            head["reasoning_content"] = thought
        if self.tool_parser is None or text is None:
            return dict(head, content=text), out.finish_reason
        # a call cut by max_tokens is dropped whole (no half call, no markup in the content)
        content, calls = self.tool_parser.parse(text, self.tools.max_calls, cut=out.finish_reason == "length",
                                                call_id_prefix=self.call_id_prefix, tools=self.tools.schemas)
        if not calls:
            return dict(head, content=content), out.finish_reason
        message = dict(head, content=content, tool_calls=[c.openai() for c in calls])
        return message, self.finish(out.finish_reason, True)


def _chunk_base(job: Job) -> dict:
    if job.kind == "chat":
        return {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
                "system_fingerprint": None}
    if job.kind == "completion":
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                "system_fingerprint": None}
    return {"id": job.id, "object": "session.turn.chunk", "created": job.created, "model": job.model,
            "session_id": job.session_id}


def usage(outs: list[GenerationOutput]) -> dict:
    """OpenAI's ``usage`` object of a request's outputs, one per choice (the prompt counted once, as its choices
    share it; with ``prompt_tokens_details.cached_tokens``: the first choice's)."""
    n = sum(len(o.token_ids) for o in outs)
    p = outs[0].prompt_tokens
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens}}


def reply_body(job: Job, outs: list[GenerationOutput], tokens: Tokens, handles: list[RequestHandle]) -> dict:
    """The JSON answer of a finished, non-streamed job (one choice per output)."""
    if job.kind == "session":
        message, finish = job.message(outs[0])
        calls = {"tool_calls": message["tool_calls"]} if "tool_calls" in message else {}
        return {"id": job.id, "object": "session.turn", "created": job.created, "model": job.model,
                "session_id": job.session_id, "content": message["content"], **calls, "finish_reason": finish,
                "usage": usage(outs)}
    choices = []
    for i, (out, handle) in enumerate(zip(outs, handles)):
        lp, _ = logprob_entries(job.logprobs, tokens, handle, 0, len(out.token_ids), TextOffsets(), len(out.text))
        if job.kind == "chat":
            message, finish = job.message(out)
            choices.append({"index": i, "message": message, "logprobs": None if lp is None else {"content": lp},
                            "finish_reason": finish})
        else:
            choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason})
    obj = "chat.completion" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "system_fingerprint": None,
            "choices": choices, "usage": usage(outs)}


class _Choice:
    """One choice of a stream: what of its tokens and text went out, and its tool-call reader."""

    def __init__(self, job: Job, index: int, handle: RequestHandle) -> None:
        self.job, self.index, self.handle = job, index, handle
        self.sent = self.chars = 0  # tokens whose logprobs went out, characters of text that went out
        self.offsets = TextOffsets()  # at token `sent`
        self.reader = job.tool_parser.streamer(job.tools.max_calls, job.call_id_prefix, job.tools.schemas) \
            if job.tool_parser is not None else None
        self.thinking = job.reasoning.streamer(job.prompt_open) if job.reasoning is not None else None
        self.called = self.stopped = False  # stopped: the reply repeated a call, so its generation was stopped

    def chunks(self, piece: str, tokens: Tokens, end: int | None = None) -> list[dict]:
        """The chunks of a text piece (``end``: the last piece, all tokens to ``end``) with its logprobs."""
        job, base = self.job, _chunk_base(self.job)
        self.chars += len(piece)
        text_len = len(self.handle.output.text) if end is not None else self.chars
        lp, self.sent = logprob_entries(job.logprobs, tokens, self.handle, self.sent, end, self.offsets, text_len)
        if job.kind == "completion":
            choices = [{"index": self.index, "text": piece, "logprobs": lp, "finish_reason": None}]
            return [dict(base, choices=choices, **({"usage": None} if job.include_usage else {}))] \
                if piece or (lp and lp["tokens"]) else []
        thoughts = []
        if self.thinking is not None:  # reasoning first; the rest is the reply, read for calls below
            split = self.thinking.feed(piece) + (self.thinking.finish() if end is not None else [])
            thoughts = [d for d in split if "reasoning_content" in d]
            piece = "".join(d.get("content", "") for d in split)
        if self.reader is None:
            deltas = thoughts + ([{"content": piece}] if piece else [])
        else:
            deltas = thoughts + self.reader.feed(piece) + (
                self.reader.finish(cut=self.handle.output.finish_reason == "length") if end is not None else [])
            self.called = self.called or any("tool_calls" in d for d in deltas)
            if self.reader.repeated and not self.stopped:
                self.stopped = True
                self.handle.cancel("stop")
        if job.kind == "session":  # its chunks carry the text as "delta", and tool calls beside it
            return [dict(base, delta=d.get("content", ""), **({"tool_calls": d["tool_calls"]} if "tool_calls" in d
                                                              else {}), finish_reason=None) for d in deltas]
        if lp and not deltas:
            deltas = [{}]
        out = []
        for k, d in enumerate(deltas):
            lpk = None if job.logprobs is None else {"content": lp if k == 0 else []}
            choice = {"index": self.index, "delta": d, "logprobs": lpk, "finish_reason": None}
            out.append(dict(base, choices=[choice], **({"usage": None} if job.include_usage else {})))
        return out

    def final(self) -> dict:
        """The chunk with the finish reason."""
        job, out, base = self.job, self.handle.output, _chunk_base(self.job)
        finish = job.finish("stop" if self.stopped else out.finish_reason, self.called)
        if job.kind == "session":
            return dict(base, delta="", finish_reason=finish, usage=usage([out]))
        key = {"delta": {}} if job.kind == "chat" else {"text": ""}
        lp = None if job.logprobs is None else ({"content": []} if job.kind == "chat" else None)
        choice = {"index": self.index, **key, "logprobs": lp, "finish_reason": finish}
        return dict(base, choices=[choice], **({"usage": None} if job.include_usage else {}))


async def _pump(i: int, handle: RequestHandle, q: asyncio.Queue) -> None:
    """Put choice ``i``'s text pieces on ``q``, then ``(i, None)`` (or ``(i, the error)``)."""
    try:
        async for piece in handle:
            await q.put((i, piece))
    except Exception as e:  # noqa: BLE001 - reported by the stream as its error event
        await q.put((i, e))
        return
    await q.put((i, None))


async def _events(job: Job, handles: list[RequestHandle], tokens: Tokens) -> AsyncIterator[str]:
    """The job's server-sent events (the choices' chunks as they come), ending with ``data: [DONE]``; leaving early
    cancels every choice's request."""
    choices = [_Choice(job, i, h) for i, h in enumerate(handles)]
    q: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, h, q)) for i, h in enumerate(handles)]
    try:
        if job.kind == "chat":
            for c in choices:
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None if job.logprobs is None else {"content": []}, "finish_reason": None}
                yield sse(dict(_chunk_base(job), choices=[first], **({"usage": None} if job.include_usage else {})))
        left = len(choices)
        while left:
            i, item = await q.get()
            c = choices[i]
            if isinstance(item, Exception):
                raise item
            if item is not None:
                for chunk in c.chunks(item, tokens):
                    yield sse(chunk)
                continue
            left -= 1
            out = c.handle.output
            if out.finish_reason == "cancelled" and not c.stopped:
                raise cancelled_error()
            for chunk in c.chunks("", tokens, end=len(out.token_ids)) + [c.final()]:
                yield sse(chunk)
        if job.include_usage and job.kind != "session":
            yield sse(dict(_chunk_base(job), choices=[], usage=usage([h.output for h in handles])))
    except Exception as e:  # noqa: BLE001 - after the 200 went out, an error is one event in the stream
        yield sse(engine_error(e).body())
    finally:
        for p in pumps:
            p.cancel()
        for h in handles:
            if h.output is None:  # the client went away (or the error ended it): free its blocks
                h.cancel()
    yield DONE


class ReplyDeltas:
    """One streamed chat reply read for tool calls, for the endpoints that shape their own events (Anthropic's
    Messages, the Responses API): :meth:`__aiter__` yields each piece's deltas (``{"content"}`` / ``{"tool_calls"}``,
    as :class:`~turbo.tool_parsers.ToolStreamer` gives them; ``[{"content": piece}]`` without tools), stops the
    generation at a repeated call (``stopped``), raises the 503 of a request the server cancelled, and ends with the
    reader's last deltas."""

    def __init__(self, job: Job, handle: RequestHandle) -> None:
        self.handle, self.stopped = handle, False
        self.reader = job.tool_parser.streamer(job.tools.max_calls, job.call_id_prefix, job.tools.schemas) \
            if job.tool_parser is not None else None

    async def __aiter__(self):
        reader, handle = self.reader, self.handle
        async for piece in handle:
            yield reader.feed(piece) if reader is not None else [{"content": piece}]
            if reader is not None and reader.repeated and not self.stopped:
                self.stopped = True
                handle.cancel("stop")
        if handle.output.finish_reason == "cancelled" and not self.stopped:
            raise cancelled_error()
        if reader is not None:
            yield reader.finish(cut=handle.output.finish_reason == "length")


def sse_response(handles: list[RequestHandle], events: AsyncIterator[str]) -> "EventStream":
    """A server-sent-event response of ``events`` that cancels ``handles``' requests however it ends."""
    return EventStream(handles, events, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStream(StreamingResponse):
    """A server-sent-event response that cancels its requests however it ends, even when the client went away
    before the first event (then the event generator never starts, so its own ``finally`` never runs)."""

    def __init__(self, handles: list[RequestHandle], events: AsyncIterator[str], **kwargs) -> None:
        super().__init__(events, **kwargs)
        self.handles = handles

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for h in self.handles:
                if h.output is None:
                    h.cancel()


def event_stream(job: Job, handles: list[RequestHandle], tokens: Tokens) -> EventStream:
    """The streamed answer of ``job``: its server-sent events as they are generated (one choice per handle)."""
    return sse_response(handles, _events(job, handles, tokens))
