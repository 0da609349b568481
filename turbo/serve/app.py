"""The HTTP server: an OpenAI-compatible API and a stateful sessions API over one :class:`~turbo.engine.Engine`.

``create_app(engine)`` builds a FastAPI app; ``serve(model, host, port, ...)`` loads the engine and runs it under
uvicorn (``liteturbo serve``). Endpoints (see docs/serving.md for every field):

- ``GET /``: a web chat page (``turbo/serve/static/chat.html``) over the sessions API;
- ``GET /health``; ``GET /metrics`` (Prometheus: :mod:`turbo.metrics`); ``GET /v1/models`` (one model) and
  ``GET /v1/models/{id}``;
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streamed as server-sent events in OpenAI's chunk
  shapes (ending with ``data: [DONE]``) or not; a field the server cannot honour (tools, ``n`` > 1, ``logit_bias``,
  ``echo``, ...) or does not know is refused with a 400 naming it, never ignored;
- ``POST /v1/sessions``, ``POST /v1/sessions/{id}/chat``, ``GET`` / ``DELETE /v1/sessions/{id}``: chats whose KV
  cache stays in the engine between turns, so a turn prefills only its new tokens (also reachable as the
  ``session_id`` extension field of ``/v1/chat/completions``); kept by a :class:`~turbo.session.SessionRegistry`
  (ids, idle expiry, caps), in memory, and with a session dir saved after every turn and restored at start.

All generation goes through one :class:`~turbo.loop.EngineLoop`: the model's forward runs on its background thread,
never on the asyncio event loop; request checks and tokenization run in the thread pool. A client that disconnects
(streaming or not) cancels its request, which frees its KV blocks at the loop's next turn.

Errors are JSON ``{"error": {"message", "type", "param", "code"}}``: 400 bad request (the message names the field
and the fix), 401 missing or wrong API key, 404 unknown model / session / route, 409 session busy, 413 body too
large, 503 over capacity (with ``Retry-After``), 500 engine failure. After a stream has started, an error arrives
as one ``data: {"error": ...}`` event before ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import numbers
import os
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lite.formats import LiteturboError

from ..config import GenerationConfig
from ..engine import Engine, GenerationOutput
from ..errors import NotFound, OverCapacity, http_status
from ..loop import EngineLoop, RequestHandle
from ..session import Session
from .sessions import SessionRegistry

log = logging.getLogger("liteturbo.server")

API_KEYS_ENV = "LITETURBO_API_KEYS"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 23333
# the chosen token's logprob when it is not among the 20 most likely: the value OpenAI's API documents for that case
UNLIKELY_LOGPROB = -9999.0
_MAX_LOGPROBS = 20  # what the engine's sampler returns at most

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


def _engine_error(e: BaseException) -> APIError:
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


# --- reading request bodies -------------------------------------------------------------------------------------

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


async def _read_json(request: Request, limit: int, allow_empty: bool = False) -> dict:
    """The body as a JSON object; 413 beyond ``limit`` bytes, 400 when it is not a JSON object."""
    declared = request.headers.get("content-length")
    too_big = (f"the request body is larger than the server's limit of {limit} bytes; send less (the limit is "
               f"--max-request-bytes / create_app(max_request_bytes=))")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise APIError(413, too_big, code="request_too_large")
        except ValueError:
            raise APIError(400, f"the Content-Length header {declared!r} is not a number") from None
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise APIError(413, too_big, code="request_too_large")
    if not buf.strip():
        if allow_empty:
            return {}
        raise APIError(400, "the request body is empty; send a JSON object (Content-Type: application/json)")
    try:
        data = json.loads(bytes(buf), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays/objects too deeply; send a flat JSON object") from None
    if not isinstance(data, dict):
        kinds = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
        raise APIError(400, f"the request body must be a JSON object, got a JSON {kinds.get(type(data), 'value')}")
    return data


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


class _Body:
    """A request's JSON fields, read one by one with checks that name the field; :meth:`done` refuses the rest.

    A field set to ``null`` counts as not given."""

    def __init__(self, data: dict, what: str) -> None:
        self.data, self.what, self.seen, self.refused = data, what, set(), set()

    def has(self, name: str) -> bool:
        self.seen.add(name)
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        v = self.data.get(name)
        return default if v is None else v

    def bad(self, name: str, must: str) -> APIError:
        return APIError(400, f"'{name}' must be {must}, got {json.dumps(self.data.get(name))[:100]}", param=name)

    def int(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.raw(name)
        if v is None:
            return None
        rng = (f" >= {lo}" if hi is None else f" in [{lo}, {hi}]") if lo is not None else ""
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.bad(name, f"an integer{rng}")
        return int(v)

    def num(self, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float | None:
        v = self.raw(name)
        if v is None:
            return None
        if lo is None:
            rng = ""
        elif hi is None:
            rng = f" {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f" in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        ok = _is_num(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
        if not ok:
            raise self.bad(name, f"a number{rng}")
        return float(v)

    def bool(self, name: str) -> bool | None:
        v = self.raw(name)
        if v is not None and not isinstance(v, bool):
            raise self.bad(name, "true or false")
        return v

    def str(self, name: str) -> str | None:
        v = self.raw(name)
        if v is not None and not isinstance(v, str):
            raise self.bad(name, "a string")
        return v

    def refuse(self, name: str, harmless: Callable[[Any], bool], why: str) -> None:
        """400 when ``name`` is given with a value other than a harmless one (``why`` says what is missing)."""
        v = self.raw(name)
        self.refused.add(name)
        if v is not None and not harmless(v):
            raise APIError(400, f"'{name}' is not supported by this server: {why}", param=name,
                           code="unsupported_field")

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise APIError(400, f"unrecognized field{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(repr(u) for u in unknown)} in {self.what}; the fields it honours are "
                                f"{', '.join(sorted(self.seen - self.refused))} (docs/serving.md)", param=unknown[0],
                           code="unsupported_field")


# the sampling and stopping fields every generating endpoint (and a session's defaults) reads
def _sampling(b: _Body) -> dict:
    """The sampling / stopping fields that are present, as :class:`GenerationConfig` keywords."""
    g: dict[str, Any] = {}
    mt, mct = b.int("max_tokens", lo=1), b.int("max_completion_tokens", lo=1)
    if mt is not None and mct is not None and mt != mct:
        raise APIError(400, f"'max_tokens' ({mt}) and 'max_completion_tokens' ({mct}) disagree; give one of them",
                       param="max_tokens")
    if mct or mt:
        g["max_new_tokens"] = mct or mt
    for name, kw in (("temperature", dict(lo=0.0)), ("top_p", dict(lo=0.0, hi=1.0, lo_open=True)),
                     ("min_p", dict(lo=0.0, hi=1.0)), ("presence_penalty", dict(lo=-2.0, hi=2.0)),
                     ("frequency_penalty", dict(lo=-2.0, hi=2.0)), ("repetition_penalty", dict(lo=0.0, lo_open=True))):
        v = b.num(name, **kw)
        if v is not None:
            g[name] = v
    top_k = b.int("top_k", lo=-1)
    if top_k is not None:
        g["top_k"] = max(top_k, 0)  # -1 (vLLM's spelling) and 0 both mean off
    stop = b.raw("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise b.bad("stop", "a non-empty string or a list of non-empty strings")
        g["stop"] = stop
    ids = b.raw("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise b.bad("stop_token_ids", "a list of token ids (integers >= 0)")
        g["stop_token_ids"] = ids
    seed = b.int("seed", lo=0)
    if seed is not None:
        if seed >= 2**63:
            raise b.bad("seed", "an integer in [0, 2**63)")
        g["seed"] = seed
    ignore_eos = b.bool("ignore_eos")
    if ignore_eos is not None:
        g["ignore_eos"] = ignore_eos
    min_tokens = b.int("min_tokens", lo=0)
    if min_tokens is not None:
        g["min_new_tokens"] = min_tokens
    return g


_API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _api_fields(g: dict) -> dict:
    """:func:`_sampling`'s keywords under their API names (to show a session's defaults)."""
    return {_API_NAMES.get(k, k): v for k, v in g.items()}


def _gen_config(engine: Engine, *layers: dict) -> GenerationConfig:
    """One :class:`GenerationConfig` from layered keyword dicts (later ones win); 400 when they do not fit."""
    kw: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": engine.session_len}  # OpenAI's defaults
    for layer in layers:
        kw.update(layer)
    if kw.get("min_new_tokens", 0) > kw["max_new_tokens"]:
        raise APIError(400, f"'min_tokens' ({kw['min_new_tokens']}) is larger than 'max_tokens' "
                            f"({kw['max_new_tokens']}); lower it", param="min_tokens")
    try:
        return GenerationConfig(**kw)
    except LiteturboError as e:
        raise APIError(400, str(e)) from None


def _check_model(b: _Body, model_id: str) -> None:
    """404 when ``model`` is given and is not the served one (leaving it out is fine)."""
    model = b.raw("model")
    if model is not None and model != model_id:
        raise APIError(404, f"the model {json.dumps(model)[:100]} does not exist; this server serves "
                            f"'{model_id}' (GET /v1/models)", param="model", code="model_not_found")


def _check_common(b: _Body, model_name: str, chat: bool) -> tuple[bool, bool]:
    """``model``, ``n``, ``stream``, ``stream_options``, ``user`` and the refused OpenAI fields. Returns
    (stream, include_usage)."""
    _check_model(b, model_name)
    n = b.int("n", lo=1)
    if n is not None and n != 1:
        raise APIError(400, f"'n'={n}: only n=1 is supported; send {n} requests instead (with different seeds)",
                       param="n", code="unsupported_field")
    stream = bool(b.bool("stream"))
    opts = b.raw("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise APIError(400, "'stream_options' is only allowed with \"stream\": true", param="stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(
                opts.get("include_usage", False), bool):
            raise b.bad("stream_options", 'an object {"include_usage": true|false}')
        include_usage = opts.get("include_usage", False)
    b.str("user")  # an end-user id for the caller's own bookkeeping: nothing to do with it here
    b.refuse("logit_bias", lambda v: v == {}, "per-token logit biases are not implemented")
    if chat:
        b.refuse("tools", lambda v: v == [], "tool / function calling is not implemented")
        b.refuse("tool_choice", lambda v: v == "none", "tool / function calling is not implemented")
        b.refuse("parallel_tool_calls", lambda v: False, "tool / function calling is not implemented")
        b.refuse("functions", lambda v: v == [], "function calling is not implemented")
        b.refuse("function_call", lambda v: v == "none", "function calling is not implemented")
        b.refuse("response_format", lambda v: v == {"type": "text"},
                 "only {\"type\": \"text\"}; JSON mode and json_schema (constrained decoding) are not implemented")
        b.refuse("modalities", lambda v: v == ["text"], "only text output")
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity", "metadata"):
            b.refuse(name, lambda v: False, "not implemented")
        b.refuse("store", lambda v: v is False, "the server stores no completions")
    else:
        b.refuse("echo", lambda v: v is False, "echoing the prompt is not implemented")
        b.refuse("suffix", lambda v: v == "", "insertion (suffix) is not implemented")
        b.refuse("best_of", lambda v: v == 1, "only best_of=1; send several requests and pick yourself")
    return stream, include_usage


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}.content[{j}] must be a text part "
                                    f"{{\"type\": \"text\", \"text\": \"...\"}}, got type {json.dumps(kind)}: only "
                                    f"text input is supported", param="messages")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise APIError(400, f"{where}.content[{j}] has unsupported keys {extra}",
                               param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(400, f"{where}.content must be a string or a non-empty list of text parts", param="messages")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _messages(raw: Any) -> list[dict]:
    """Validated ``messages`` as ``[{"role", "content": str}]`` (``developer`` becomes ``system``)."""
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                       param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object with 'role' and 'content'", param="messages")
        role = m.get("role")
        if role not in _ROLES:
            raise APIError(400, f"{where}.role {json.dumps(role)[:40]} is not supported; use system, developer, user "
                                f"or assistant (tool messages are not implemented)", param="messages")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise APIError(400, f"{where} has unsupported field{'s' if len(extra) > 1 else ''} "
                                f"{', '.join(repr(x) for x in extra)}: only role and content are read "
                                f"(names and tool calls are not implemented)", param="messages")
        out.append({"role": _ROLES[role], "content": _text_content(m.get("content"), where)})
    return out


def _prompt(raw: Any) -> str | list[int]:
    """A completion prompt: a string or a list of token ids (or a list holding exactly one of those)."""
    several = ("several prompts in one request are not supported; send one request per prompt "
               "(they run together in the engine's batch)")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        if any(t < 0 for t in raw):
            raise APIError(400, "'prompt' token ids must be integers >= 0", param="prompt")
        return [int(t) for t in raw]
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > 1:
            raise APIError(400, f"'prompt' holds {len(raw)} prompts: {several}", param="prompt",
                           code="unsupported_field")
        return _prompt(raw[0])
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")


# --- response pieces ------------------------------------------------------------------------------------------------

def _usage(out: GenerationOutput) -> dict:
    n = len(out.token_ids)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": n, "total_tokens": out.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


class _Tokens:
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
class _Logprobs:
    """Which log-probabilities a request returns: ``top`` alternatives per token (chat: top_logprobs; completions:
    logprobs). The engine is asked for the 20 most likely, so the chosen token's own logprob is found among them
    (it is always the first for greedy decoding); one outside them is reported as :data:`UNLIKELY_LOGPROB`."""

    top: int
    chat: bool

    @staticmethod
    def chosen(tid: int, top: list[tuple[int, float]]) -> float:
        return next((lp for t, lp in top if t == tid), UNLIKELY_LOGPROB)

    def entries(self, tokens: _Tokens, ids: list[int], lps: list[list[tuple[int, float]]], offset: int):
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


@dataclass
class _Job:
    """One generation to answer: what kind of response, and its options."""

    kind: str  # "chat", "completion" or "session"
    stream: bool
    include_usage: bool = False
    logprobs: _Logprobs | None = None
    session_id: str | None = None
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


class _EventStream(StreamingResponse):
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


@dataclass
class _SessionEntry:
    """A session of the registry and what the server keeps beside it: its sampling defaults (API fields)."""

    session: Session
    defaults: dict
    created: int | None = None


# --- the app ----------------------------------------------------------------------------------------------------

def _parse_keys(api_keys: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if api_keys is None:
        api_keys = os.environ.get(API_KEYS_ENV, "")
    if isinstance(api_keys, str):
        api_keys = api_keys.split(",")
    if not isinstance(api_keys, (list, tuple)) or not all(isinstance(k, str) for k in api_keys):
        raise LiteturboError(f"api_keys must be a list of strings or one comma-separated string, got {api_keys!r}")
    return [k.strip() for k in api_keys if k.strip()]


def create_app(engine: Engine, loop: EngineLoop | None = None, model_name: str | None = None,
               api_keys: str | list[str] | None = None, max_request_bytes: int = 1 << 20,
               sessions: SessionRegistry | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    loop: the :class:`EngineLoop` that drives the engine (default: the engine's own, :attr:`Engine.loop`, which
    ``Engine.astream`` shares; it is stopped when the app shuts down and restarts on its next use; one given is
    started if it is not running, and left running). model_name: the model id clients
    pass as ``model`` (default: the checkpoint folder's name). api_keys: Bearer tokens, one of which every ``/v1``
    request must carry (a list, or one comma-separated string); ``None`` reads the environment variable
    ``LITETURBO_API_KEYS``; empty = no authentication. max_request_bytes: larger bodies get 413. sessions: the
    :class:`~turbo.session.SessionRegistry` behind ``/v1/sessions`` (default: ``SessionRegistry(engine)``, with its
    idle expiry and caps). Raises ``LiteturboError`` for bad arguments.
    """
    if not isinstance(engine, Engine):
        raise LiteturboError(f"create_app needs an Engine, got {type(engine).__name__}")
    if not _is_int(max_request_bytes) or max_request_bytes < 1:
        raise LiteturboError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    keys = [k.encode() for k in _parse_keys(api_keys)]
    owned = loop is None
    loop = (loop or engine.loop).start()  # the engine's own loop (astream shares it) unless one is given
    if loop.engine is not engine:
        raise LiteturboError("the EngineLoop drives another Engine; pass the loop of this engine")
    model_id = model_name or engine.path.name
    started = int(time.time())
    if sessions is None:
        sessions = SessionRegistry(engine)
    if not isinstance(sessions, SessionRegistry) or sessions.engine is not engine:
        raise LiteturboError("sessions must be a SessionRegistry of this engine")
    session_meta: dict[str, tuple[dict, int]] = {}  # id -> (sampling defaults, creation time)
    if sessions.session_dir is not None:
        restored = sessions.restore()  # sessions saved by an earlier run (with --session-dir)
        if restored:
            print(f"[liteturbo] restored {restored} session(s) from {sessions.session_dir}", file=sys.stderr)

    def persist(sid: str):
        """What runs when a turn of ``sid`` ends: save it under the session dir (nothing without one)."""
        return (lambda: sessions.persist(sid)) if sessions.session_dir is not None else None
    tokens = _Tokens(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owned:
            await run_in_threadpool(loop.stop)

    app = FastAPI(title="liteturbo", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.loop, app.state.sessions, app.state.model_name = engine, loop, sessions, model_id

    # --- errors ---------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(LiteturboError)
    async def _lt_error(request: Request, e: LiteturboError):
        return _engine_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code in (404, 405) and request.url.path.startswith("/v1"):
            try:  # without a valid key, /v1 answers 401 whatever the path (routes are not revealed)
                await check_key(request)
            except APIError as auth:
                return auth.response()
        if e.status_code == 404:
            msg = (f"no endpoint {request.method} {request.url.path}; the endpoints are /, /health, /metrics, "
                   f"/v1/models, /v1/chat/completions, /v1/completions, /v1/sessions (docs/serving.md)")
        elif e.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
        else:
            msg = str(e.detail)
        return APIError(e.status_code, msg).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return APIError(400, f"bad request: {e.errors()}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return _engine_error(e).response()

    # --- auth -------------------------------------------------------------------------------------------------
    async def check_key(request: Request) -> None:
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip().encode()
        # compare with every key (constant time each), so the time taken does not tell which one nearly matched
        ok = scheme.lower() == "bearer" and sum(hmac.compare_digest(token, k) for k in keys) > 0
        if not ok:
            why = "no API key was given" if not auth else "the API key is not valid"
            raise APIError(401, f"{why}; send the header 'Authorization: Bearer <key>' with one of the server's "
                                f"--api-keys", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    # --- running a generation -----------------------------------------------------------------------------
    async def wait_for(request: Request, handle: RequestHandle) -> GenerationOutput | None:
        """The request's output; ``None`` if the client went away (the request is cancelled then)."""
        async def collect():
            async for _ in handle:
                pass
            return handle.output

        task = asyncio.ensure_future(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    break
                if await request.is_disconnected():
                    handle.cancel()
                    return None
            try:
                out = task.result()
            except BaseException as e:  # noqa: BLE001 - the request's own error, answered as JSON
                raise _engine_error(e) from None
            if out.finish_reason == "cancelled":
                raise APIError(503, "the request was cancelled: the server is shutting down; retry")
            return out
        finally:
            if not task.done():
                task.cancel()
                handle.cancel()

    def chunk_base(job: _Job) -> dict:
        if job.kind == "chat":
            return {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": model_id,
                    "system_fingerprint": None}
        if job.kind == "completion":
            return {"id": job.id, "object": "text_completion", "created": job.created, "model": model_id,
                    "system_fingerprint": None}
        return {"id": job.id, "object": "session.turn.chunk", "created": job.created, "model": model_id,
                "session_id": job.session_id}

    def piece_chunk(job: _Job, text: str, lp: Any, first: bool = False) -> dict:
        base = chunk_base(job)
        if job.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None if lp is None else {"content": lp},
                      "finish_reason": None}
        elif job.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
        else:
            return dict(base, delta=text, finish_reason=None)
        return dict(base, choices=[choice], **({"usage": None} if job.include_usage else {}))

    def final_chunks(job: _Job, out: GenerationOutput, lp: Any) -> list[dict]:
        base = chunk_base(job)
        if job.kind == "session":
            return [dict(base, delta="", finish_reason=out.finish_reason, usage=_usage(out))]
        if job.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None if lp is None else {"content": lp},
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": lp, "finish_reason": out.finish_reason}
        chunks = [dict(base, choices=[choice], **({"usage": None} if job.include_usage else {}))]
        if job.include_usage:
            chunks.append(dict(base, choices=[], usage=_usage(out)))
        return chunks

    def logprob_ids(handle: RequestHandle, start: int, end: int | None = None):
        """(ids, top logprobs) of generated tokens ``start:end`` (stop ids left out: their text is not shown)."""
        req = handle.request
        n = len(req.output_ids) if end is None else end  # logprobs are appended before output_ids
        ids, lps = req.output_ids[start:n], req.logprobs[start:n]
        keep = [i for i, t in enumerate(ids) if t not in req.stop_ids]
        return [ids[i] for i in keep], [lps[i] for i in keep], n

    async def stream_events(job: _Job, handle: RequestHandle) -> AsyncIterator[str]:
        sent, chars = 0, 0  # tokens whose logprobs went out, characters of text that went out
        try:
            if job.kind == "chat":
                yield _sse(piece_chunk(job, "", [] if job.logprobs else None, first=True))
            async for piece in handle:
                lp = None
                if job.logprobs:
                    ids, lps, sent_to = logprob_ids(handle, sent)
                    lp, sent = job.logprobs.entries(tokens, ids, lps, chars), sent_to
                chars += len(piece)
                yield _sse(piece_chunk(job, piece, lp))
            out = handle.output
            if out.finish_reason == "cancelled":
                raise APIError(503, "the request was cancelled: the server is shutting down; retry")
            lp = None
            if job.logprobs:
                ids, lps, _ = logprob_ids(handle, sent, len(out.token_ids))
                lp = job.logprobs.entries(tokens, ids, lps, chars)
            for c in final_chunks(job, out, lp):
                yield _sse(c)
        except Exception as e:  # noqa: BLE001 - after the 200 went out, an error is one event in the stream
            yield _sse(_engine_error(e).body())
        finally:
            if handle.output is None:  # the client went away (or the error ended it): free its blocks
                handle.cancel()
        yield _DONE

    async def respond(request: Request, job: _Job, handle: RequestHandle) -> Response:
        if job.stream:
            return _EventStream(handle, stream_events(job, handle), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await wait_for(request, handle)
        if out is None:
            return Response(status_code=499)  # nobody is listening any more
        if job.kind == "session":
            return JSONResponse({"id": job.id, "object": "session.turn", "created": job.created, "model": model_id,
                                 "session_id": job.session_id, "content": out.text,
                                 "finish_reason": out.finish_reason, "usage": _usage(out)})
        lp = None
        if job.logprobs:
            ids, lps, _ = logprob_ids(handle, 0, len(out.token_ids))
            lp = job.logprobs.entries(tokens, ids, lps, 0)
        if job.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None if lp is None else {"content": lp}, "finish_reason": out.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
            obj = "text_completion"
        return JSONResponse({"id": job.id, "object": obj, "created": job.created, "model": model_id,
                             "system_fingerprint": None, "choices": [choice], "usage": _usage(out)})

    async def get_session(sid: str) -> _SessionEntry:
        # in the thread pool: the registry may close expired sessions, which waits for the engine's step
        try:
            session = await run_in_threadpool(sessions.get, sid)
        except NotFound as e:
            session_meta.pop(sid, None)
            raise APIError(404, str(e), param="session_id", code="session_not_found") from None
        defaults, created = session_meta.get(sid, ({}, None))  # none for sessions the registry restored
        return _SessionEntry(session, defaults, created)

    # --- endpoints --------------------------------------------------------------------------------------------
    from .metrics import CONTENT_TYPE_LATEST, ServerMetrics

    metrics = ServerMetrics(engine, sessions=lambda: len(sessions))
    loop.observers.append(metrics.observe)
    app.state.metrics = metrics

    @app.get("/metrics")
    async def prometheus_metrics():
        from fastapi.responses import Response

        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        if not loop.running:
            return APIError(503, "the engine loop is not running").response()
        return {"status": "ok", "model": model_id}

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": started, "owned_by": "liteturbo",
                "max_model_len": engine.session_len}

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str):
        if name != model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves '{model_id}'",
                           param="model", code="model_not_found")
        return model_card()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        b = _Body(await _read_json(request, max_request_bytes), "a chat completion request")
        stream, include_usage = _check_common(b, model_id, chat=True)
        messages = _messages(b.raw("messages"))
        want_lp, top = b.bool("logprobs"), b.int("top_logprobs", lo=0, hi=_MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise APIError(400, "'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        sid = b.str("session_id")
        g = _sampling(b)
        b.done()
        lp = _Logprobs(top or 0, chat=True) if want_lp else None
        job = _Job("chat", stream, include_usage, lp, id=f"chatcmpl-{uuid.uuid4().hex[:24]}")
        if sid is not None:
            entry = await get_session(sid)
            if messages[-1]["role"] != "user":
                raise APIError(400, "with 'session_id' the last message must be the user's new message (the "
                                    "session keeps the earlier ones)", param="messages")
            gen = _gen_config(engine, entry.defaults, g, {"logprobs": _MAX_LOGPROBS} if lp else {})
            handle = await run_in_threadpool(loop.submit_chat, entry.session, messages[-1]["content"], gen, 0,
                                             persist(sid))
        else:
            gen = _gen_config(engine, g, {"logprobs": _MAX_LOGPROBS} if lp else {})

            def submit():
                return loop.submit(engine.chat_template_ids(messages), gen)

            handle = await run_in_threadpool(submit)
        return await respond(request, job, handle)

    @v1.post("/completions")
    async def completions(request: Request):
        b = _Body(await _read_json(request, max_request_bytes), "a completion request")
        stream, include_usage = _check_common(b, model_id, chat=False)
        if not b.has("prompt"):
            raise APIError(400, "'prompt' is required: a string or a list of token ids", param="prompt")
        prompt = _prompt(b.raw("prompt"))
        n_lp = b.int("logprobs", lo=0, hi=_MAX_LOGPROBS)
        g = _sampling(b)
        b.done()
        lp = _Logprobs(n_lp, chat=False) if n_lp is not None else None
        gen = _gen_config(engine, {"max_new_tokens": 16}, g, {"logprobs": _MAX_LOGPROBS} if lp else {})
        handle = await run_in_threadpool(loop.submit, prompt, gen)
        job = _Job("completion", stream, include_usage, lp, id=f"cmpl-{uuid.uuid4().hex[:24]}")
        return await respond(request, job, handle)

    @v1.post("/sessions", status_code=201)
    async def create_session(request: Request):
        b = _Body(await _read_json(request, max_request_bytes, allow_empty=True), "a session")
        system = b.str("system")
        defaults = _sampling(b)
        b.done()
        _gen_config(engine, defaults)  # bad defaults fail now, not at the first turn
        sid, _ = await run_in_threadpool(sessions.create, system)  # OverCapacity (503) when full
        created = int(time.time())
        for gone in set(session_meta) - {i for i, _ in sessions.items()}:  # expired in the registry
            session_meta.pop(gone, None)
        session_meta[sid] = (defaults, created)
        return JSONResponse(status_code=201, content={"id": sid, "object": "session", "created": created,
                                                      "model": model_id, "system": system,
                                                      "defaults": _api_fields(defaults)})

    @v1.post("/sessions/{sid}/chat")
    async def session_chat(sid: str, request: Request):
        entry = await get_session(sid)
        b = _Body(await _read_json(request, max_request_bytes), "a session turn")
        content = b.raw("content")
        if not isinstance(content, str) or not content.strip():
            raise APIError(400, "'content' must be a non-empty string: the user's message", param="content")
        _check_model(b, model_id)
        stream = bool(b.bool("stream"))
        g = _sampling(b)
        b.done()
        gen = _gen_config(engine, entry.defaults, g)
        handle = await run_in_threadpool(loop.submit_chat, entry.session, content, gen, 0, persist(sid))
        job = _Job("session", stream, session_id=sid, id=f"turn-{uuid.uuid4().hex[:24]}")
        return await respond(request, job, handle)

    @v1.get("/sessions/{sid}")
    async def session_info(sid: str):
        entry = await get_session(sid)
        s = entry.session
        last = s.last
        return {"id": sid, "object": "session", "created": entry.created, "model": model_id, "system": s.system,
                "messages": list(s.messages), "busy": s.busy, "tokens": len(s.seq.token_ids),
                "kv_resident_tokens": s.seq.num_computed, "defaults": _api_fields(entry.defaults),
                "last_usage": None if last is None else _usage(last)}

    @v1.delete("/sessions/{sid}")
    async def delete_session(sid: str):
        try:
            await run_in_threadpool(sessions.delete, sid)  # Conflict (409) while a reply generates
        except NotFound as e:
            raise APIError(404, str(e), param="session_id", code="session_not_found") from None
        session_meta.pop(sid, None)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    app.include_router(v1)

    # the web chat page (docs/serving.md, "Web chat page"): static HTML + JS over the sessions API, outside /v1 (no key)
    from importlib import resources
    from fastapi.responses import HTMLResponse

    chat_page = (resources.files(__package__) / "static" / "chat.html").read_text(encoding="utf-8")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def web_chat():
        return HTMLResponse(chat_page)

    return app


def serve(model: str | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, model_name: str | None = None,
          api_keys: str | list[str] | None = None, max_request_bytes: int = 1 << 20, log_level: str = "info",
          session_dir: str | None = None, max_sessions: int = 256, session_idle_timeout: float = 3600.0,
          **engine_options) -> None:
    """Load ``model`` (name or checkpoint folder) into an :class:`Engine` with ``engine_options``
    (:class:`~turbo.config.EngineConfig` fields) and serve it with uvicorn on ``host:port`` until interrupted.
    ``api_keys``: see :func:`create_app` (``None`` reads ``LITETURBO_API_KEYS``). ``session_dir``,
    ``max_sessions``, ``session_idle_timeout``: the :class:`~turbo.session.SessionRegistry` (sessions saved after
    every turn and restored at start with a session dir). Raises ``LiteturboError`` for a bad model or option."""
    import uvicorn

    if not _is_int(port) or not 0 <= port <= 65535:
        raise LiteturboError(f"port must be an integer in [0, 65535], got {port!r}")
    if not _is_int(max_request_bytes) or max_request_bytes < 1:  # checked before the (slow) model load
        raise LiteturboError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    keys = _parse_keys(api_keys)
    engine = Engine(model, **engine_options)
    sessions = SessionRegistry(engine, max_sessions=max_sessions, idle_timeout=session_idle_timeout,
                               session_dir=session_dir)
    app = create_app(engine, model_name=model_name, api_keys=keys, max_request_bytes=max_request_bytes,
                     sessions=sessions)
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[liteturbo] warning: serving on {host} without --api-keys: anyone who can reach this port can use "
              f"the model", file=sys.stderr)
    print(f"[liteturbo] serving '{app.state.model_name}' ({engine.backend.name} backend on {engine.platform.device}, "
          f"session_len {engine.session_len}) at http://{host}:{port}/v1"
          f"{' (API keys required)' if keys else ''}", file=sys.stderr)
    # on Ctrl+C, open streams get 5 s to end; then their requests are cancelled and the engine loop stops
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
