"""The HTTP server: an OpenAI-compatible API and a stateful sessions API over one engine.

``create_app(engine)`` builds a FastAPI app; ``serve(model, host, port, ...)`` loads the engine and runs it under
uvicorn (``liteturbo serve``). Endpoints (see docs/serving.md for every field):

- ``GET /``: a web chat page (``turbo/serve/static/chat.html``) over the sessions API;
- ``GET /health``; ``GET /metrics`` (Prometheus: :mod:`turbo.serve.metrics`); ``GET /v1/models`` (one model) and
  ``GET /v1/models/{id}``;
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: ``n`` choices, log-probabilities, structured outputs
  (``response_format``, vLLM's ``guided_*``) and, for chats, tool calling (``tools`` / ``tool_choice``); streamed as
  server-sent events in OpenAI's chunk shapes (ending with ``data: [DONE]``) or not; a field the server cannot
  honour (``audio``, ``echo``, ``best_of`` > 1, several prompts, ...) or does not know is refused with a 400 naming
  it, never ignored;
- ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``: OpenAI's Responses API, its stored responses
  continued as session turns (:mod:`turbo.serve.responses_api`);
- ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API (:mod:`turbo.serve.anthropic`;
  errors on these paths in Anthropic's shape, keys also as ``x-api-key``);
- ``POST /v1/sessions``, ``POST /v1/sessions/{id}/chat``, ``GET`` / ``DELETE /v1/sessions/{id}``: chats whose KV
  cache stays in the engine between turns, so a turn prefills only its new tokens (also reachable as the
  ``session_id`` extension field of ``/v1/chat/completions``); kept by a
  :class:`~turbo.engine_proc.sessions.SessionRegistry` (ids, idle expiry, caps), in memory, and with a session dir saved
  after every turn and restored at start. With API keys, sessions and stored responses belong to the key that made
  them (:func:`check_key` gives each request its key's owner tag): under another key they answer as unknown ids.

The routes are module-level functions on two routers (``root`` and ``v1``, whose every route needs an API key when
the server has keys); each reads what it serves from ``request.app.state.served`` (a :class:`Served`). Reading and
checking request bodies is :mod:`turbo.serve.protocol`; queueing and answering a request's choices is
:mod:`turbo.serve.answer`; the response shapes and server-sent events are :mod:`turbo.serve.responses`; tool calling
is :mod:`turbo.serve.tools`.

The routes talk to an :class:`~turbo.engine_proc.client.EngineClient`: ``liteturbo serve`` runs the engine core in a
process of its own (:class:`~turbo.engine_proc.mp_client.MPClient`, :mod:`turbo.engine_proc.process`), so this
process's event loop only answers HTTP; ``create_app(engine)`` serves an engine of this process through its
:class:`~turbo.loop.EngineLoop` (:class:`~turbo.engine_proc.inproc.InprocClient`). Either way the model's forward
never runs on the asyncio event loop; request checks and tokenization run in the thread pool. A client that
disconnects (streaming or not) cancels its request, which frees its KV blocks at the engine's next turn. When the
engine process dies, open requests end with 503 naming the cause, ``/health`` answers 503 and the server exits.

Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` (:class:`~turbo.http_errors.APIError`): 400 bad
request (the message names the field and the fix), 401 missing or wrong API key, 404 unknown model / session /
route, 409 session busy, 413 body too large, 503 over capacity (with ``Retry-After``), 500 engine failure. After a
stream has started, an error arrives as one ``data: {"error": ...}`` event before ``data: [DONE]``.
"""
from __future__ import annotations

import hmac
import os
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lite.formats import LiteturboError, make_dirs

from ..config import GenerationConfig
from ..engine import Engine
from ..core import encode
from ..errors import Conflict, NotFound
from ..session_ids import owner_of
from ..sglang_route import ROUTING_KEY_HEADER
from ..loop import EngineLoop
from ..tool_parsers import reading as tool_reading
from ..reasoning_parsers import ReasoningParser, parser_for_template as reasoning_for_template, prompt_opens_reasoning
from ..engine_proc.client import EngineClient
from ..engine_proc.inproc import InprocClient
from ..engine_proc.mp_client import MPClient
from ..http_errors import APIError
from . import anthropic, protocol, responses_api
from .answer import respond, submit_choices, wait_all
from .logprobs import Logprobs, Tokens
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import MAX_LOGPROBS, gen_config, is_int, read_json
from .responses import Job, engine_error, usage
from .response_store import ResponseStore
from ..engine_proc.sessions import SessionRegistry
from .tools import ToolParser, ToolRequest, call_grammar, choose_parser, render_prompt

API_KEYS_ENV = "LITETURBO_API_KEYS"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 23333


@dataclass
class Served:
    """What one app serves, at ``app.state.served``: the engine client (in this process or in the engine
    process), the model id clients name, the API keys (empty: no authentication), the body size limit and the
    sessions' server-side metadata (id -> (sampling defaults, creation time); none for sessions the registry
    restored)."""

    client: EngineClient
    model_id: str
    keys: list[bytes]
    max_request_bytes: int
    owns_client: bool
    metrics: ServerMetrics
    chat_page: str
    tokens: Tokens
    started: int = field(default_factory=lambda: int(time.time()))
    session_meta: dict[str, tuple[dict, int]] = field(default_factory=dict)
    persist: bool = False  # save sessions under the session dir after every turn
    tool_parser: ToolParser | None = None  # the model's tool-call format (turbo/serve/tools.py)
    base: dict = field(default_factory=dict)  # the server's sampling defaults under every request's (--speculative)
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses
    reasoning: ReasoningParser | None = None  # a thinking model's format (turbo/reasoning_parsers.py)
    response_sessions: responses_api.ResponseSessions = field(default_factory=responses_api.ResponseSessions)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "liteturbo",
                "max_model_len": self.client.session_len}

    def gen(self, *layers: dict) -> GenerationConfig:
        """A request's :class:`~turbo.config.GenerationConfig` (400 when the layers do not fit)."""
        return gen_config(self.client.session_len, self.base, *layers)

    def chat_ids(self, messages: list[dict], tool_req: ToolRequest | None) -> list[int]:
        """Token ids of a conversation ready for the reply: the chat template (with the tools, or the fallback
        rendering of :mod:`turbo.serve.tools` for a template without tool support)."""
        if tool_req is None and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            return self.client.chat_template_ids(messages)
        return encode(self.client.tokenizer, render_prompt(self.client.tokenizer, messages, tool_req),
                      add_special_tokens=False)

    def reasoning_layer(self, ids: list[int], layers: tuple[dict, ...]) -> tuple[bool | None, dict]:
        """For a thinking model: (whether the prompt ``ids`` opened the reasoning block, the keywords that put a
        constraint in ``layers`` after the reasoning); ``(None, {})`` without a reasoning parser."""
        if self.reasoning is None:
            return None, {}
        tail = self.client.tokenizer.decode(ids[-64:], skip_special_tokens=False)
        opened = prompt_opens_reasoning(tail)
        constrained = any(layer.get(k) is not None for layer in layers
                          for k in ("json_schema", "regex", "choice", "grammar"))
        return opened, ({"after_reasoning": "open" if opened else "optional"} if constrained else {})

    def tool_constraint(self, tool_req: ToolRequest | None, sampling: dict, reasoning: bool = False) -> dict:
        """The grammar of the request's calls, as keywords: ``tool_choice`` "required" or a named function forces a
        call (400 when the request also gives a structured-output constraint); "auto" leaves text free but holds a
        call the reply starts to the format and the tool's schema (none with a structured-output constraint).
        ``reasoning``: the grammar will stand after the reasoning (:meth:`reasoning_layer`)."""
        grammar = call_grammar(tool_req, self.tool_parser.name, self.client.tokenizer, reasoning) \
            if tool_req else None
        if grammar is None:
            return {}
        constrained = any(sampling.get(k) is not None for k in ("json_schema", "regex", "choice", "grammar"))
        if tool_req.choice == "auto":  # a call the reply starts must end well; a structured output wins
            return {} if constrained else {"grammar": grammar}
        if constrained:
            raise APIError(400, "tool_choice \"required\" or a named function already constrains the reply; leave "
                                "out response_format / guided_* or use tool_choice \"auto\"", param="tool_choice")
        return {"grammar": grammar}

    def defaults(self, sid: str, stored: dict) -> tuple[dict, int | None]:
        """Session ``sid``'s sampling defaults and creation time: as this app created it, else ``stored`` (what the
        registry kept: a session restored, or created by another replica) and no time."""
        return self.session_meta.get(sid, (stored, None))


def served(request: Request) -> Served:
    """The :class:`Served` of the app answering ``request``."""
    return request.app.state.served


# --- auth and errors -----------------------------------------------------------------------------------------------

def _parse_keys(api_keys: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if api_keys is None:
        api_keys = os.environ.get(API_KEYS_ENV, "")
    if isinstance(api_keys, str):
        api_keys = api_keys.split(",")
    if not isinstance(api_keys, (list, tuple)) or not all(isinstance(k, str) for k in api_keys):
        raise LiteturboError(f"api_keys must be a list of strings or one comma-separated string, got {api_keys!r}")
    return [k.strip() for k in api_keys if k.strip()]


async def check_key(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's
    clients send it) with one of the server's keys (if any). The key's owner tag
    (:func:`~turbo.session_ids.owner_of`; ``None`` without keys) is ``request.state.owner``: what the request makes
    (sessions, stored responses) is that owner's, and another owner's does not exist for it."""
    request.state.owner = None
    keys = served(request).keys
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    token = token.strip().encode()
    if not auth and request.headers.get("x-api-key"):  # Anthropic's clients send the key this way
        scheme, token, auth = "bearer", request.headers["x-api-key"].strip().encode(), "x-api-key"
    # compare with every key (constant time each), so the time taken does not tell which one nearly matched
    ok = scheme.lower() == "bearer" and sum(hmac.compare_digest(token, k) for k in keys) > 0
    if not ok:
        why = "no API key was given" if not auth else "the API key is not valid"
        raise APIError(401, f"{why}; send the header 'Authorization: Bearer <key>' with one of the server's "
                            f"--api-keys", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    request.state.owner = owner_of(token)


def owner(request: Request) -> str | None:
    """The owner tag of ``request``'s API key (:func:`check_key`), ``None`` when the server has no keys."""
    return getattr(request.state, "owner", None)


async def _api_error(request: Request, e: APIError):
    if request.url.path.startswith("/v1/messages"):  # Anthropic's clients read their own error shape
        return JSONResponse(anthropic.error_body(e), status_code=e.status, headers=e.headers)
    return e.response()


async def _engine_failure(request: Request, e: Exception):
    return await _api_error(request, engine_error(e))


async def _http_error(request: Request, e: StarletteHTTPException):
    if e.status_code in (404, 405) and request.url.path.startswith("/v1"):
        try:  # without a valid key, /v1 answers 401 whatever the path (routes are not revealed)
            await check_key(request)
        except APIError as auth:
            return await _api_error(request, auth)
    if e.status_code == 404:
        msg = (f"no endpoint {request.method} {request.url.path}; the endpoints are /, /health, /metrics, "
               f"/v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/sessions "
               f"(docs/serving.md)")
    elif e.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path}"
    else:
        msg = str(e.detail)
    return await _api_error(request, APIError(e.status_code, msg))


async def _validation_error(request: Request, e: RequestValidationError):
    return await _api_error(request, APIError(400, f"bad request: {e.errors()}"))


async def on_session(s: Served, fn, sid: str, *args, **kw):
    """``fn(sid, *args, **kw)`` in the thread pool (the registry may close expired sessions, which waits for the
    engine's step); 404 for an unknown id (or another key's session)."""
    try:
        return await run_in_threadpool(fn, sid, *args, **kw)
    except NotFound as e:
        s.session_meta.pop(sid, None)
        raise APIError(404, str(e), param="session_id", code="session_not_found") from None


# --- routes ----------------------------------------------------------------------------------------------------------

root = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])


@root.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(await run_in_threadpool(served(request).metrics.render), media_type=CONTENT_TYPE_LATEST)


@root.get("/health")
async def health(request: Request):
    s = served(request)
    if not s.client.running:
        return APIError(503, s.client.exit_reason or "the engine loop is not running").response()
    stalled = getattr(s.client, "stalled", None)  # the engine process's watchdog (turbo/engine_proc/mp_client.py)
    if stalled:
        return APIError(503, stalled).response()
    return {"status": "ok", "model": s.model_id}


# the web chat page (docs/serving.md, "Web chat page"): static HTML + JS over the sessions API, outside /v1 (no key)
@root.get("/model_info", include_in_schema=False)
@root.get("/server_info", include_in_schema=False)
@root.get("/get_model_info", include_in_schema=False)
@root.get("/get_server_info", include_in_schema=False)
async def model_info(request: Request):
    """What sglang-router asks a worker when it registers it (SGLang's own endpoints): the id it lists at
    ``/v1/models`` is ``served_model_name`` / ``model_path``, here the id clients pass as ``model``."""
    s = served(request)
    return {"model_path": s.model_id, "served_model_name": s.model_id, "is_generation": True, "max_context_length": s.client.session_len, "tp_size": 1, "dp_size": 1}


@root.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def web_chat(request: Request):
    return HTMLResponse(served(request).chat_page)


@v1.get("/models")
async def list_models(request: Request):
    return {"object": "list", "data": [served(request).model_card()]}


@v1.get("/models/{name:path}")
async def get_model(name: str, request: Request):
    s = served(request)
    if name != s.model_id:
        raise APIError(404, f"the model {name!r} does not exist; this server serves '{s.model_id}'",
                       param="model", code="model_not_found")
    return s.model_card()


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    s = served(request)
    req = protocol.read_chat(await read_json(request, s.max_request_bytes), s.model_id,
                             request.headers.get(ROUTING_KEY_HEADER))
    lp = None if req.top_logprobs is None else Logprobs(req.top_logprobs, chat=True)
    reads = req.tools if req.tools is not None and req.tools.parses else None
    job = Job("chat", s.model_id, req.stream, req.include_usage, lp, tools=reads,
              tool_parser=s.tool_parser if reads else None)
    want_lp = {"logprobs": MAX_LOGPROBS} if lp else {}
    c = s.client
    if req.session_id is None:
        layers = (req.sampling, s.tool_constraint(req.tools, req.sampling, s.reasoning is not None), want_lp)
        ids = await run_in_threadpool(s.chat_ids, req.messages, req.tools)
        job.prompt_open, after = s.reasoning_layer(ids, layers)
        job.reasoning = s.reasoning if job.prompt_open is not None else None
        gen = s.gen(*layers, after)
        handles = await run_in_threadpool(submit_choices, c, ids, gen, req.n)
        return await respond(request, job, handles)
    me = owner(request)
    if req.create_session:
        await _open_session(s, req.session_id, req.messages, me)
    stored = await on_session(s, c.check_session, req.session_id, me)  # 404 first
    last = req.messages[-1]
    if last["role"] not in ("user", "tool"):
        raise APIError(400, "with 'session_id' (or a session id in x-smg-routing-key) the last message must be the new "
                            "one, the user's or a tool's result (the session keeps the earlier ones)", param="messages")
    if not isinstance(last["content"], str) or not last["content"].strip():
        raise APIError(400, "with 'session_id' the last message is the turn's text: it is empty or only whitespace",
                       param="messages")
    gen = s.gen(s.defaults(req.session_id, stored)[0], req.sampling, s.tool_constraint(req.tools, req.sampling),
                want_lp)
    read = _session_reading(s, reads)
    job.call_id_prefix = read and read["call_id_prefix"]
    handle = await on_session(s, c.submit_chat, req.session_id, last["content"], gen, s.persist,
                              req.tools.openai() if req.tools else None, last.get("tool_call_id"), req.keep_partial,
                              read, owner=me)
    return await respond(request, job, [handle])


async def _open_session(s: Served, sid: str, messages: list[dict], me: str | None) -> None:
    """``create_session``: open session ``sid`` for owner ``me`` unless it exists (here, or in the session dir another
    replica shares), its system prompt the leading system message of ``messages`` (taken only now, when it is
    created). Another owner's session of that id is not opened again: the turn then finds no session (404)."""
    try:
        await on_session(s, s.client.check_session, sid, me)
        return
    except APIError:
        pass
    system = messages[0]["content"] if len(messages) > 1 and messages[0]["role"] == "system" else None
    if system is not None and not isinstance(system, str):
        raise APIError(400, "with 'create_session' the system message's content must be a string", param="messages")
    try:
        await run_in_threadpool(s.client.session_create, system, sid, {}, me)
    except Conflict:
        pass  # opened meanwhile (a retry of this request, another replica): continue it


@v1.post("/messages")
async def messages(request: Request):
    s = served(request)
    req = anthropic.read_request(await read_json(request, s.max_request_bytes), s.model_id)
    job = anthropic.new_job(s.model_id, req.stream, req, s.tool_parser)
    gen = s.gen(req.sampling, s.tool_constraint(req.tools, req.sampling))
    ids = await run_in_threadpool(s.chat_ids, req.messages, req.tools)
    handle = await run_in_threadpool(s.client.submit, ids, gen)
    stops, tok = list(gen.stop), s.client.tokenizer
    if req.stream:
        return anthropic.event_stream(job, handle, stops, tok, len(ids))
    outs = await wait_all(request, [handle], job)
    if outs is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(anthropic.message_body(job, outs[0], stops, tok))


@v1.post("/messages/count_tokens")
async def count_tokens(request: Request):
    s = served(request)
    data = await read_json(request, s.max_request_bytes)
    req = protocol.read_chat(anthropic.translate(data, count_only=True), s.model_id)
    return {"input_tokens": len(await run_in_threadpool(s.chat_ids, req.messages, req.tools))}


@v1.post("/responses")
async def create_response(request: Request):
    s = served(request)
    r = await run_in_threadpool(responses_api.read_request, await read_json(request, s.max_request_bytes),
                                s.model_id, s.responses, owner(request))
    chat = r.chat
    reads = chat.tools if chat.tools is not None and chat.tools.parses else None
    job = Job("chat", s.model_id, chat.stream, tools=reads, tool_parser=s.tool_parser if reads else None)
    gen = s.gen(chat.sampling, s.tool_constraint(chat.tools, chat.sampling))
    answer = responses_api.Answer(r, job, s.model_id)
    if r.store:
        read = _session_reading(s, reads)
        job.call_id_prefix = read and read["call_id_prefix"]
        handle, answer.session_id = await run_in_threadpool(responses_api.submit, s.client, r, gen, s.persist, read,
                                                            s.response_sessions)
    else:
        ids = await run_in_threadpool(s.chat_ids, chat.messages, chat.tools)
        handle = await run_in_threadpool(s.client.submit, ids, gen)
    if chat.stream:
        return responses_api.event_stream(answer, handle, s.responses)
    outs = await wait_all(request, [handle], job)
    if outs is None:
        return Response(status_code=499)  # nobody is listening any more
    body, message = answer.body(outs[0])
    await run_in_threadpool(answer.record, s.responses, body, message)
    return JSONResponse(body)


def _stored(s: Served, rid: str, me: str | None):
    r = s.responses.get(rid, me)
    if r is None:  # also another key's: it does not exist for this one
        raise APIError(404, f"no stored response {rid!r}", param="response_id", code="response_not_found")
    return r


@v1.get("/responses/{rid}")
async def get_response(rid: str, request: Request):
    return _stored(served(request), rid, owner(request)).body


@v1.delete("/responses/{rid}")
async def delete_response(rid: str, request: Request):
    s = served(request)
    _stored(s, rid, owner(request))
    await run_in_threadpool(s.responses.delete, rid)
    return {"id": rid, "object": "response", "deleted": True}


def _session_reading(s, reads) -> dict | None:
    """How a session turn's reply is read for calls (:func:`turbo.tool_parsers.reading`), when the request reads
    them: the session keeps the calls with the ids this front sends (same parser, ``max_calls`` and id prefix)."""
    return tool_reading(s.tool_parser.name, reads.max_calls) if reads else None


@v1.post("/completions")
async def completions(request: Request):
    s = served(request)
    req = protocol.read_completion(await read_json(request, s.max_request_bytes), s.model_id)
    lp = None if req.logprobs is None else Logprobs(req.logprobs, chat=False)
    gen = s.gen({"max_new_tokens": 16}, req.sampling, {"logprobs": MAX_LOGPROBS} if lp else {})
    handles = await run_in_threadpool(submit_choices, s.client, req.prompt, gen, req.n)
    return await respond(request, Job("completion", s.model_id, req.stream, req.include_usage, lp), handles)


@v1.post("/sessions", status_code=201)
async def create_session(request: Request):
    s = served(request)
    req = protocol.read_new_session(await read_json(request, s.max_request_bytes, allow_empty=True))
    s.gen(req.defaults)  # bad defaults fail now, not at the first turn
    # 400 / 409 for a bad or taken client-chosen id, 503 when full
    sid = await run_in_threadpool(s.client.session_create, req.system, req.session_id, req.defaults, owner(request))
    created = int(time.time())
    for gone in set(s.session_meta) - set(await run_in_threadpool(s.client.session_ids)):  # expired ones
        s.session_meta.pop(gone, None)
    s.session_meta[sid] = (req.defaults, created)
    return JSONResponse(status_code=201, content={"id": sid, "object": "session", "created": created,
                                                  "model": s.model_id, "system": req.system,
                                                  "defaults": protocol.api_fields(req.defaults)})


@v1.post("/sessions/{sid}/chat")
async def session_chat(sid: str, request: Request):
    s = served(request)
    me = owner(request)
    stored = await on_session(s, s.client.check_session, sid, me)  # 404 before reading the body
    turn = protocol.read_turn(await read_json(request, s.max_request_bytes), s.model_id)
    gen = s.gen(s.defaults(sid, stored)[0], turn.sampling, s.tool_constraint(turn.tools, turn.sampling))
    reads = turn.tools if turn.tools is not None and turn.tools.parses else None
    read = _session_reading(s, reads)
    handle = await on_session(s, s.client.submit_chat, sid, turn.content, gen, s.persist,
                              turn.tools.openai() if turn.tools else None, turn.tool_call_id, turn.keep_partial,
                              read, owner=me)
    job = Job("session", s.model_id, turn.stream, session_id=sid, tools=reads,
              tool_parser=s.tool_parser if reads else None, call_id_prefix=read and read["call_id_prefix"])
    return await respond(request, job, [handle])


@v1.get("/sessions/{sid}")
async def session_info(sid: str, request: Request):
    s = served(request)
    info = await on_session(s, s.client.session_info, sid, owner(request))
    defaults, created = s.defaults(sid, info.pop("defaults"))
    last = info.pop("last")
    return {"id": sid, "object": "session", "created": created, "model": s.model_id, **info,
            "defaults": protocol.api_fields(defaults), "last_usage": None if last is None else usage([last])}


@v1.delete("/sessions/{sid}")
async def delete_session(sid: str, request: Request):
    s = served(request)
    await on_session(s, s.client.session_delete, sid, owner(request))  # Conflict (409) while a reply generates
    s.session_meta.pop(sid, None)
    return {"id": sid, "object": "session.deleted", "deleted": True}


# --- the app ---------------------------------------------------------------------------------------------------------

@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    s: Served = app.state.served
    if s.owns_client:
        await run_in_threadpool(s.client.close)


def _inproc_client(engine: Engine, loop: EngineLoop | None, sessions: SessionRegistry | None) -> InprocClient:
    """The in-process client of ``engine``: its loop started, its registry checked, a session dir restored."""
    if not isinstance(engine, Engine):
        raise LiteturboError(f"create_app needs an Engine (or an MPClient), got {type(engine).__name__}")
    loop = (loop or engine.loop).start()  # the engine's own loop (astream shares it) unless one is given
    if loop.engine is not engine:
        raise LiteturboError("the EngineLoop drives another Engine; pass the loop of this engine")
    if sessions is None:
        sessions = SessionRegistry(engine)
    if not isinstance(sessions, SessionRegistry) or sessions.engine is not engine:
        raise LiteturboError("sessions must be a SessionRegistry of this engine")
    if sessions.session_dir is not None:
        restored = sessions.restore()  # sessions saved by an earlier run (with --session-dir)
        if restored:
            print(f"[liteturbo] restored {restored} session(s) from {sessions.session_dir}", file=sys.stderr)
    return InprocClient(engine, loop, sessions)


def create_app(engine: Engine | MPClient, loop: EngineLoop | None = None, model_name: str | None = None,
               api_keys: str | list[str] | None = None, max_request_bytes: int = 1 << 20,
               sessions: SessionRegistry | None = None, session_dir: bool | None = None,
               tool_call_parser: str | None = None, speculative: int = 0,
               response_dir: str | None = None, reasoning_parser: str | None = "auto") -> FastAPI:
    """The FastAPI app serving ``engine``: an :class:`Engine` in this process, or an
    :class:`~turbo.engine_proc.mp_client.MPClient` of an engine process (then ``loop`` and ``sessions`` must be None and
    the app closes the client when it shuts down).

    loop: the :class:`EngineLoop` that drives the engine (default: the engine's own, :attr:`Engine.loop`, which
    ``Engine.astream`` shares; it is stopped when the app shuts down and restarts on its next use; one given is
    started if it is not running, and left running). model_name: the model id clients
    pass as ``model`` (default: the checkpoint folder's name). api_keys: Bearer tokens, one of which every ``/v1``
    request must carry (a list, or one comma-separated string); ``None`` reads the environment variable
    ``LITETURBO_API_KEYS``; empty = no authentication. max_request_bytes: larger bodies get 413. sessions: the
    :class:`~turbo.engine_proc.sessions.SessionRegistry` behind ``/v1/sessions`` (default: ``SessionRegistry(engine)``,
    with its idle expiry and caps). session_dir: whether sessions are saved after every turn (default: whether
    the registry has a session dir; an MPClient's engine process saves when this is true). tool_call_parser: the
    format tool calls are read in (:data:`turbo.serve.tools.PARSERS`; default: the one the chat template writes,
    else ``hermes``, see :func:`turbo.serve.tools.choose_parser`). speculative: the default of the requests'
    ``speculative`` (draft tokens per step from history, any sampling options; 0: off). response_dir: where the
    Responses API keeps stored responses (``<dir>/.responses/``; default: the in-process registry's session dir;
    ``None`` there: in memory only). reasoning_parser: a thinking model's format (:mod:`turbo.reasoning_parsers`:
    ``deepseek_r1``, ``qwen3``; ``"auto"``: the one its chat template writes, if any; ``None`` or ``"none"``: its
    reasoning stays in ``content``): chat completions then answer ``reasoning_content`` beside ``content`` and hold a
    structured-output or tool-call constraint only after the reasoning. Raises ``LiteturboError`` for bad arguments.
    """
    if not is_int(max_request_bytes) or max_request_bytes < 1:
        raise LiteturboError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    keys = [k.encode() for k in _parse_keys(api_keys)]
    if isinstance(engine, MPClient):
        if loop is not None or sessions is not None:
            raise LiteturboError("with an MPClient the engine process owns the loop and the sessions: pass neither")
        client, owned = engine, True
    else:
        client, owned = _inproc_client(engine, loop, sessions), loop is None
        session_dir = client.sessions.session_dir is not None if session_dir is None else session_dir
        response_dir = client.sessions.session_dir if response_dir is None else response_dir
    metrics = ServerMetrics(client, sessions=client.num_sessions)
    client.observers.append(metrics.observe)
    chat_page = (resources.files(__package__) / "static" / "chat.html").read_text(encoding="utf-8")
    s = Served(client, model_name or client.path.name, keys, max_request_bytes, owned, metrics, chat_page,
               Tokens(client.tokenizer), persist=bool(session_dir),
               tool_parser=ToolParser(choose_parser(client.tokenizer, tool_call_parser)),
               base={"speculative": speculative} if speculative else {}, responses=ResponseStore(response_dir),
               reasoning=_reasoning_parser(reasoning_parser, client.tokenizer))
    s.gen({})  # a bad default fails here, at start-up
    app = FastAPI(title="liteturbo", version="0.1.0", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.served, app.state.model_name, app.state.metrics = s, s.model_id, metrics
    if isinstance(client, InprocClient):
        app.state.engine, app.state.loop, app.state.sessions = client.engine, client.loop, client.sessions
    for exc, handler in ((APIError, _api_error), (LiteturboError, _engine_failure),
                         (StarletteHTTPException, _http_error), (RequestValidationError, _validation_error),
                         (Exception, _engine_failure)):
        app.add_exception_handler(exc, handler)
    app.include_router(root)
    app.include_router(v1)
    return app


def _reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The reasoning parser ``name`` asks for (``"auto"``: from the chat template; ``None`` / ``"none"``: none)."""
    if name in (None, "none"):
        return None
    if name == "auto":
        from ..chat_render import template_text
        name = reasoning_for_template(template_text(tokenizer))
        return None if name is None else ReasoningParser(name)
    return ReasoningParser(name)


def serve(model: str | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, model_name: str | None = None,
          api_keys: str | list[str] | None = None, max_request_bytes: int = 1 << 20, log_level: str = "info",
          session_dir: str | None = None, max_sessions: int = 256, session_idle_timeout: float = 3600.0,
          engine_process: bool = True, tool_call_parser: str | None = None, speculative: int = 0,
          stall_timeout: float = 20.0, reasoning_parser: str | None = "auto", **engine_options) -> None:
    """Load ``model`` (name or checkpoint folder) into an :class:`Engine` with ``engine_options``
    (:class:`~turbo.config.EngineConfig` fields) and serve it with uvicorn on ``host:port`` until interrupted.
    ``engine_process``: run the engine in a process of its own (:mod:`turbo.engine_proc.process`; default) or in
    this one. ``api_keys``: see :func:`create_app` (``None`` reads ``LITETURBO_API_KEYS``). ``session_dir``,
    ``max_sessions``, ``session_idle_timeout``: the :class:`~turbo.engine_proc.sessions.SessionRegistry` (sessions saved
    after every turn and restored at start with a session dir). ``tool_call_parser``: see :func:`create_app`.
    ``stall_timeout``: seconds an engine process may make no progress (answer nothing, idle or busy: the front pings
    it) before ``/health`` answers 503 and its open requests end (:class:`~turbo.engine_proc.mp_client.MPClient`).
    Raises ``LiteturboError`` for a bad model or option, and when the engine process died while serving (after the
    server stopped)."""
    if not is_int(port) or not 0 <= port <= 65535:
        raise LiteturboError(f"port must be an integer in [0, 65535], got {port!r}")
    if not is_int(max_request_bytes) or max_request_bytes < 1:  # checked before the (slow) model load
        raise LiteturboError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    keys = _parse_keys(api_keys)
    if tool_call_parser is not None:
        ToolParser(tool_call_parser)  # an unknown name fails before the (slow) model load
    if reasoning_parser not in (None, "auto", "none"):
        ReasoningParser(reasoning_parser)  # an unknown name fails before the (slow) model load
    _check_port(host, port)  # before the (slow) model load
    if session_dir is not None:  # before the (slow) model load
        make_dirs(Path(session_dir).expanduser(), "--session-dir")
    registry = dict(max_sessions=max_sessions, idle_timeout=session_idle_timeout, session_dir=session_dir)
    if engine_process:
        client = MPClient(model, engine_options, registry, stall_timeout=stall_timeout)
        if client.restored:
            print(f"[liteturbo] restored {client.restored} session(s) from {session_dir}", file=sys.stderr)
        app = create_app(client, model_name=model_name, api_keys=keys, max_request_bytes=max_request_bytes,
                         session_dir=session_dir is not None, tool_call_parser=tool_call_parser,
                         speculative=speculative, response_dir=session_dir, reasoning_parser=reasoning_parser)
    else:
        engine = Engine(model, **engine_options)
        app = create_app(engine, model_name=model_name, api_keys=keys, max_request_bytes=max_request_bytes,
                         sessions=SessionRegistry(engine, **registry), tool_call_parser=tool_call_parser,
                         speculative=speculative, reasoning_parser=reasoning_parser)
    _run(app, host, port, log_level, bool(keys))


def _check_port(host: str, port: int) -> None:
    """Raises ``LiteturboError`` when ``host:port`` cannot be listened on (taken, or not an address here)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(infos[0][4])
    except OSError as e:
        raise LiteturboError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host, "
                             f"or stop what uses it") from None


class ServerHeader:
    """ASGI middleware: every HTTP answer names the server that gave it (``x-liteturbo-server: HOST:PORT``), so a
    client behind a router (sglang-router passes it on) sees which replica answered. Pure ASGI: streams and
    disconnects pass through untouched."""

    def __init__(self, app, value: str) -> None:
        self.app, self.value = app, value.encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), (b"x-liteturbo-server", self.value)])
            await send(message)

        await self.app(scope, receive, send_named)


def _run(app: FastAPI, host: str, port: int, log_level: str, keys: bool) -> None:
    """Serve ``app`` with uvicorn until interrupted, or until its engine process dies (then raise why)."""
    import uvicorn  # only to run: create_app alone does not need it

    client = app.state.served.client
    app.add_middleware(ServerHeader, value=f"{host}:{port}")
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[liteturbo] warning: serving on {host} without --api-keys: anyone who can reach this port can use "
              f"the model", file=sys.stderr)
    print(f"[liteturbo] serving '{app.state.model_name}' ({client.backend_name} backend on {client.device}, "
          f"session_len {client.session_len}{', engine process' if isinstance(client, MPClient) else ''}) at "
          f"http://{host}:{port}/v1{' (API keys required)' if keys else ''}", file=sys.stderr)
    # on Ctrl+C, open streams get 4 s to end; then their requests are cancelled (each stream ends with its error
    # event and [DONE]) before uvicorn's 5 s grace ends, and the engine stops
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            timer = threading.Timer(4.0, client.cancel_all)
            timer.daemon = True
            timer.start()

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    dead = []
    if isinstance(client, MPClient):
        client.on_dead.append(lambda why: (dead.append(why), setattr(server, "should_exit", True)))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises Ctrl+C again once it has shut down: a normal stop
        pass
    finally:
        client.close()
    if dead:
        raise LiteturboError(f"stopped serving: {dead[0]}")
