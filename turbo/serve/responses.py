"""What the HTTP server answers: OpenAI's response and chunk shapes, server-sent events, and the error shape.

- :class:`APIError`: an HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``;
  :func:`engine_error` turns an engine exception into one (typed errors keep their status, others are 500s).
- :class:`Job`: one generation to answer (a chat completion, a completion or a session turn) and its options;
  :func:`reply_body` is its JSON answer, :func:`event_stream` its server-sent events (``data: {...}`` chunks in
  OpenAI's shapes, ending with ``data: [DONE]``; an error after the stream began is one ``data: {"error": ...}``
  event before it).
- :class:`Logprobs`: log-probability entries in the chat (``logprobs.content``) or completions
  (``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) shape.
"""
from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse, StreamingResponse

from lite.formats import LiteturboError

from ..engine import GenerationOutput
from ..errors import OverCapacity, http_status
from ..loop import RequestHandle

log = logging.getLogger("liteturbo.server")

# the chosen token's logprob when it is not among the 20 most likely: the value OpenAI's API documents for that case
UNLIKELY_LOGPROB = -9999.0

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                500: "internal_error", 503: "overloaded_error"}


class APIError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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


def usage(out: GenerationOutput) -> dict:
    """OpenAI's ``usage`` object of an output (with ``prompt_tokens_details.cached_tokens``)."""
    n = len(out.token_ids)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": n, "total_tokens": out.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


# --- log-probabilities -----------------------------------------------------------------------------------------------

class Tokens:
    """Token id -> (text, UTF-8 bytes) for log-probability entries (cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        got = self.cache.get(tid)
        if got is None:
            text = self.tokenizer.decode([tid])
            got = self.cache[tid] = (text, list(text.encode("utf-8")))
        return got


@dataclass
class Logprobs:
    """Which log-probabilities a request returns: ``top`` alternatives per token (chat: top_logprobs; completions:
    logprobs). The engine is asked for the 20 most likely, so the chosen token's own logprob is found among them
    (it is always the first for greedy decoding); one outside them is reported as :data:`UNLIKELY_LOGPROB`."""

    top: int
    chat: bool

    @staticmethod
    def chosen(tid: int, top: list[tuple[int, float]]) -> float:
        return next((lp for t, lp in top if t == tid), UNLIKELY_LOGPROB)

    def entries(self, tokens: Tokens, ids: list[int], lps: list[list[tuple[int, float]]], offset: int):
        """Chat: a list of ``{"token", "logprob", "bytes", "top_logprobs"}``; completions: the ``tokens`` /
        ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` object (``offset``: characters before)."""
        if self.chat:
            out = []
            for tid, top in zip(ids, lps):
                text, raw = tokens(tid)
                alts = [{"token": tokens(t)[0], "logprob": lp, "bytes": tokens(t)[1]} for t, lp in top[:self.top]]
                out.append({"token": text, "logprob": self.chosen(tid, top), "bytes": raw, "top_logprobs": alts})
            return out
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, top in zip(ids, lps):
            text = tokens(tid)[0]
            res["tokens"].append(text)
            res["token_logprobs"].append(self.chosen(tid, top))
            res["top_logprobs"].append({tokens(t)[0]: lp for t, lp in top[:self.top]})
            res["text_offset"].append(offset)
            offset += len(text)
        return res


def _logprob_ids(handle: RequestHandle, start: int, end: int | None = None):
    """(ids, top logprobs, end) of generated tokens ``start:end`` (stop ids left out: their text is not shown)."""
    req = handle.request
    n = len(req.output_ids) if end is None else end  # logprobs are appended before output_ids
    ids, lps = req.output_ids[start:n], req.logprobs[start:n]
    keep = [i for i, t in enumerate(ids) if t not in req.stop_ids]
    return [ids[i] for i in keep], [lps[i] for i in keep], n


# --- one generation's answer -----------------------------------------------------------------------------------------

_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "session": "turn-"}


@dataclass
class Job:
    """One generation to answer: what kind of response (``"chat"``, ``"completion"`` or ``"session"``), for which
    model id, and its options. ``id`` defaults to a fresh one with the kind's prefix."""

    kind: str
    model: str
    stream: bool
    include_usage: bool = False
    logprobs: Logprobs | None = None
    session_id: str | None = None
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{_ID_PREFIX[self.kind]}{uuid.uuid4().hex[:24]}"

    def logprob_entries(self, tokens: Tokens, handle: RequestHandle, start: int, end: int | None, offset: int):
        """(entries of generated tokens ``start:end``, the end) or (``None``, ``start``) without logprobs."""
        if self.logprobs is None:
            return None, start
        ids, lps, n = _logprob_ids(handle, start, end)
        return self.logprobs.entries(tokens, ids, lps, offset), n


def _chunk_base(job: Job) -> dict:
    if job.kind == "chat":
        return {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
                "system_fingerprint": None}
    if job.kind == "completion":
        return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                "system_fingerprint": None}
    return {"id": job.id, "object": "session.turn.chunk", "created": job.created, "model": job.model,
            "session_id": job.session_id}


def piece_chunk(job: Job, text: str, lp: Any, first: bool = False) -> dict:
    """The chunk of a streamed text piece (``first``: the chat's opening chunk with the role)."""
    base = _chunk_base(job)
    if job.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None if lp is None else {"content": lp},
                  "finish_reason": None}
    elif job.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
    else:
        return dict(base, delta=text, finish_reason=None)
    return dict(base, choices=[choice], **({"usage": None} if job.include_usage else {}))


def final_chunks(job: Job, out: GenerationOutput, lp: Any) -> list[dict]:
    """The chunks that end a stream: the finish reason, then the usage when asked for."""
    base = _chunk_base(job)
    if job.kind == "session":
        return [dict(base, delta="", finish_reason=out.finish_reason, usage=usage(out))]
    if job.kind == "chat":
        choice = {"index": 0, "delta": {}, "logprobs": None if lp is None else {"content": lp},
                  "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": "", "logprobs": lp, "finish_reason": out.finish_reason}
    chunks = [dict(base, choices=[choice], **({"usage": None} if job.include_usage else {}))]
    if job.include_usage:
        chunks.append(dict(base, choices=[], usage=usage(out)))
    return chunks


def reply_body(job: Job, out: GenerationOutput, tokens: Tokens, handle: RequestHandle) -> dict:
    """The JSON answer of a finished, non-streamed job."""
    if job.kind == "session":
        return {"id": job.id, "object": "session.turn", "created": job.created, "model": job.model,
                "session_id": job.session_id, "content": out.text, "finish_reason": out.finish_reason,
                "usage": usage(out)}
    lp, _ = job.logprob_entries(tokens, handle, 0, len(out.token_ids), 0)
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": None if lp is None else {"content": lp}, "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        obj = "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "system_fingerprint": None,
            "choices": [choice], "usage": usage(out)}


async def _events(job: Job, handle: RequestHandle, tokens: Tokens) -> AsyncIterator[str]:
    """The job's server-sent events, ending with ``data: [DONE]``; leaving early cancels the request."""
    sent, chars = 0, 0  # tokens whose logprobs went out, characters of text that went out
    try:
        if job.kind == "chat":
            yield sse(piece_chunk(job, "", [] if job.logprobs else None, first=True))
        async for piece in handle:
            lp, sent = job.logprob_entries(tokens, handle, sent, None, chars)
            chars += len(piece)
            yield sse(piece_chunk(job, piece, lp))
        out = handle.output
        if out.finish_reason == "cancelled":
            raise cancelled_error()
        lp, _ = job.logprob_entries(tokens, handle, sent, len(out.token_ids), chars)
        for c in final_chunks(job, out, lp):
            yield sse(c)
    except Exception as e:  # noqa: BLE001 - after the 200 went out, an error is one event in the stream
        yield sse(engine_error(e).body())
    finally:
        if handle.output is None:  # the client went away (or the error ended it): free its blocks
            handle.cancel()
    yield DONE


class EventStream(StreamingResponse):
    """A server-sent-event response that cancels its request however it ends, even when the client went away
    before the first event (then the event generator never starts, so its own ``finally`` never runs)."""

    def __init__(self, handle: RequestHandle, events: AsyncIterator[str], **kwargs) -> None:
        super().__init__(events, **kwargs)
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.handle.output is None:
                self.handle.cancel()


def event_stream(job: Job, handle: RequestHandle, tokens: Tokens) -> EventStream:
    """The streamed answer of ``job``: its server-sent events as they are generated."""
    return EventStream(handle, _events(job, handle, tokens), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
