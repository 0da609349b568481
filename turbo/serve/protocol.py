"""Reading HTTP requests: a JSON body under a size limit, then each endpoint's fields checked one by one.

Every check that fails raises :class:`~turbo.http_errors.APIError` (400, 404 or 413) whose message names the
field and the fix; a field nobody reads is refused by :meth:`Body.done`, never ignored. The sampling fields follow
:data:`turbo.config.SAMPLING_FIELDS` (the table ``GenerationConfig`` reads too). Each endpoint's body becomes one
plain request object: :func:`read_chat` (``POST /v1/chat/completions``), :func:`read_completion`
(``POST /v1/completions``), :func:`read_new_session` (``POST /v1/sessions``) and :func:`read_turn`
(``POST /v1/sessions/{id}/chat``). :func:`gen_config` layers sampling fields into a
:class:`~turbo.config.GenerationConfig`. Nothing here builds an app or calls the engine.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request

from lite.formats import LiteturboError

from ..config import LIST_KINDS, SAMPLING, SAMPLING_FIELDS, GenerationConfig, SamplingField, bound_text
from ..http_errors import APIError
from ..session_ids import session_id_problem
from ..sglang_route import ROUTER_FILLS, ROUTER_MODEL
from . import tools
from .structured import read_constraint

MAX_LOGPROBS = SAMPLING["logprobs"].hi  # what the engine's sampler returns at most (20)


# --- the body ------------------------------------------------------------------------------------------------------

def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


async def read_json(request: Request, limit: int, allow_empty: bool = False) -> dict:
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
    where = _lone_surrogate(data)
    if where is not None:  # valid JSON, but no text: it cannot be tokenized, stored or sent back
        top = where.removeprefix("a key of ").split("[")[0].split(".")[0]
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                            f"which is not text; send valid Unicode", param=None if top == "the body" else top)
    return data


def _lone_surrogate(data: Any) -> str | None:
    """Where in ``data`` (a field path like ``messages[1].content``) a string or key holds a lone surrogate."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "the body"
        elif isinstance(v, dict):
            for k, x in v.items():
                key = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii() and _lone_surrogate(k) is not None:
                    return f"a key of {path or 'the body'}"
                todo.append((key, x))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


def is_int(v: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


class Body:
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
        if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.bad(name, "an integer" + ("" if lo is None else " " + bound_text(lo, hi)))
        return int(v)

    def num(self, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            hi_open: bool = False) -> float | None:
        v = self.raw(name)
        if v is None:
            return None
        ok = (_is_num(v) and (lo is None or (v > lo if lo_open else v >= lo))
              and (hi is None or (v < hi if hi_open else v <= hi)))
        if not ok:
            raise self.bad(name, "a number" + ("" if lo is None else " " + bound_text(lo, hi, lo_open, hi_open)))
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


# --- sampling fields (turbo.config.SAMPLING_FIELDS) --------------------------------------------------------------

def _field_value(b: Body, f: SamplingField, name: str) -> Any:
    """The API field ``name`` of ``f`` as a :class:`GenerationConfig` value, ``None`` when not given."""
    if f.kind == "bool":
        return b.bool(name)
    if f.kind == "float":
        return b.num(name, f.lo, f.hi, f.lo_open, f.hi_open)
    if f.kind == "int":
        lo = f.lo if f.api_off is None else min(f.lo, f.api_off)
        closed_hi = f.hi if isinstance(f.hi, int) and not f.hi_open else None  # a named hi waits for gen_config
        v = b.int(name, lo=lo, hi=closed_hi)
        if v is not None and f.hi_open and v >= f.hi:
            raise b.bad(name, f"an integer {bound_text(f.lo, f.hi, f.lo_open, f.hi_open)}")
        return f.default if v is not None and v == f.api_off else v
    v = b.raw(name)
    if v is None:
        return None
    if f.kind == "bias":  # the values are checked by GenerationConfig (400 naming the token)
        if not isinstance(v, dict):
            raise b.bad(name, "an object mapping token ids to numbers in [-100, 100]")
        return v
    if f.kind == "strs" and isinstance(v, str):
        v = [v]
    ok = isinstance(v, list) and all((isinstance(x, str) and x) if f.kind == "strs" else (is_int(x) and x >= 0)
                                     for x in v)
    if not ok:
        raise b.bad(name, ("a non-empty string or " if f.kind == "strs" else "") + LIST_KINDS[f.kind])
    return v


def read_sampling(b: Body) -> dict:
    """The sampling / stopping fields that are present, as :class:`GenerationConfig` keywords."""
    g: dict[str, Any] = {}
    for f in SAMPLING_FIELDS:
        if f.api is None:
            continue
        names = (f.api, *f.api_aliases)
        given = [(n, v) for n, v in ((n, _field_value(b, f, n)) for n in names) if v is not None]
        if any(v != given[0][1] for _, v in given):
            (n1, v1), (n2, v2) = given[:2]
            raise APIError(400, f"'{n1}' ({v1}) and '{n2}' ({v2}) disagree; give one of them", param=f.api)
        if given:
            g[f.keyword] = given[-1][1]
    return g


def api_fields(g: dict) -> dict:
    """:func:`read_sampling`'s keywords under their API names (to show a session's defaults)."""
    return {(SAMPLING[k].api or k) if k in SAMPLING else k: v for k, v in g.items()}


def gen_config(session_len: int, *layers: dict) -> GenerationConfig:
    """One :class:`GenerationConfig` from layered keyword dicts (later ones win) over OpenAI's defaults (temperature
    1, as many tokens as the session holds); 400 when they do not fit."""
    kw: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": session_len}
    for layer in layers:
        kw.update(layer)
    for f in SAMPLING_FIELDS:  # bounds that name another field: known only now
        if not isinstance(f.hi, str):
            continue
        v, hi = kw.get(f.keyword, f.default), kw.get(f.hi, SAMPLING[f.hi].default)
        if v > hi:
            raise APIError(400, f"'{f.api}' ({v}) is larger than '{SAMPLING[f.hi].api}' ({hi}); lower it", param=f.api)
    try:
        return GenerationConfig(**kw)
    except LiteturboError as e:
        raise APIError(400, str(e)) from None


# --- fields every generating endpoint reads -------------------------------------------------------------------------

def check_model(b: Body, model_id: str) -> None:
    """404 when ``model`` is given and is not the served one (leaving it out is fine, and so is
    :data:`~turbo.sglang_route.ROUTER_MODEL`, what sglang-router writes in place of a missing one)."""
    model = b.raw("model")
    if model is not None and model != model_id and model != ROUTER_MODEL:
        raise APIError(404, f"the model {json.dumps(model)[:100]} does not exist; this server serves "
                            f"'{model_id}' (GET /v1/models)", param="model", code="model_not_found")


def _read_stream(b: Body) -> tuple[bool, bool]:
    """(stream, include_usage) from ``stream`` and ``stream_options``."""
    stream = bool(b.bool("stream"))
    opts = b.raw("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise APIError(400, "'stream_options' is only allowed with \"stream\": true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(
            opts.get("include_usage", False), bool):
        raise b.bad("stream_options", 'an object {"include_usage": true|false}')
    return stream, opts.get("include_usage", False)


_FUNCTIONS = "the deprecated functions API is not implemented; use tools / tool_choice"
_REFUSED_CHAT = (
    ("functions", lambda v: v == [], _FUNCTIONS),
    ("function_call", lambda v: v == "none", _FUNCTIONS),
    ("modalities", lambda v: v == ["text"], "only text output"),
    *((name, lambda v: False, "not implemented") for name in
      ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity", "metadata")),
    ("store", lambda v: v is False, "the server stores no completions"),
)
_REFUSED_COMPLETION = (
    ("echo", lambda v: v is False, "echoing the prompt is not implemented"),
    ("suffix", lambda v: v == "", "insertion (suffix) is not implemented"),
    ("best_of", lambda v: v == 1, "only best_of=1; send several requests and pick yourself"),
)


MAX_N = 64  # choices per request at most (the engine's default batch)


def read_common(b: Body, model_id: str, chat: bool) -> tuple[bool, bool, int]:
    """``model``, ``n``, ``stream``, ``stream_options``, ``user`` and the refused OpenAI fields. Returns
    (stream, include_usage, n)."""
    check_model(b, model_id)
    n = b.int("n", lo=1, hi=MAX_N) or 1
    stream, include_usage = _read_stream(b)
    b.str("user")  # an end-user id for the caller's own bookkeeping: nothing to do with it here
    for name, harmless, why in _REFUSED_CHAT if chat else _REFUSED_COMPLETION:
        b.refuse(name, harmless, why)
    return stream, include_usage, n


# --- prompts ---------------------------------------------------------------------------------------------------------

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


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def read_messages(raw: Any, link: bool = True) -> list[dict]:
    """Validated ``messages`` as ``[{"role", "content": str}]`` (``developer`` becomes ``system``); assistant tool
    calls and tool results as :func:`turbo.serve.tools.read_tool_message` reads them."""
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
            raise APIError(400, f"{where}.role {json.dumps(role)[:40]} is not supported; use system, developer, user, "
                                f"assistant or tool", param="messages")
        if role == "tool" or (role == "assistant" and "tool_calls" in m):
            out.append(tools.read_tool_message(m, where, _text_content))
            continue
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise APIError(400, f"{where} has unsupported field{'s' if len(extra) > 1 else ''} "
                                f"{', '.join(repr(x) for x in extra)}: only role and content are read "
                                f"(and tool_calls on assistant messages; names are not implemented)",
                           param="messages")
        out.append({"role": _ROLES[role], "content": _text_content(m.get("content"), where)})
    if link:  # a session's new tool message answers a call the session holds, not one of these messages
        tools.link_tool_messages(out)
    return out


def read_prompt(raw: Any) -> str | list[int]:
    """A completion prompt: a string or a list of token ids (or a list holding exactly one of those)."""
    several = ("several prompts in one request are not supported; send one request per prompt "
               "(they run together in the engine's batch)")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(is_int(t) for t in raw):
        if any(t < 0 for t in raw):
            raise APIError(400, "'prompt' token ids must be integers >= 0", param="prompt")
        return [int(t) for t in raw]
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > 1:
            raise APIError(400, f"'prompt' holds {len(raw)} prompts: {several}", param="prompt",
                           code="unsupported_field")
        return read_prompt(raw[0])
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt")


# --- one request per endpoint ----------------------------------------------------------------------------------------

@dataclass
class ChatRequest:
    """A checked ``POST /v1/chat/completions``. top_logprobs: alternatives per token, ``None`` without logprobs."""

    messages: list[dict]
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    session_id: str | None
    sampling: dict
    n: int = 1
    tools: tools.ToolRequest | None = None
    keep_partial: bool = False  # with session_id: on_disconnect "keep"
    # with session_id: open the session when it does not exist (a router keyed by a header, e.g. sglang-router's
    # x-smg-routing-key, passes no POST /v1/sessions); its system prompt is a leading system message
    create_session: bool = False


@dataclass
class CompletionRequest:
    """A checked ``POST /v1/completions``. logprobs: alternatives per token, ``None`` without logprobs."""

    prompt: str | list[int]
    stream: bool
    include_usage: bool
    logprobs: int | None
    sampling: dict
    n: int = 1


@dataclass
class NewSession:
    """A checked ``POST /v1/sessions``: the system prompt, the session's sampling defaults (keywords) and the id the
    client chose (``None``: the server picks one)."""

    system: str | None
    defaults: dict
    session_id: str | None = None


@dataclass
class Turn:
    """A checked ``POST /v1/sessions/{id}/chat``: the user's message, or (``tool_call_id``) a tool's result; the
    turn's tools (``None``: the session keeps the ones it had)."""

    content: str
    stream: bool
    sampling: dict
    tools: tools.ToolRequest | None = None
    tool_call_id: str | None = None
    keep_partial: bool = False  # on_disconnect "keep": a turn stopped early keeps its partial reply


def read_on_disconnect(b: Body) -> bool:
    """A session turn's ``on_disconnect``: ``"rollback"`` (the default: a turn whose client goes away leaves the session
    as it was) or ``"keep"`` (the partial reply stays as the assistant's turn); True for keep."""
    how = b.raw("on_disconnect", "rollback")
    if how not in ("rollback", "keep"):
        raise APIError(400, f"'on_disconnect' must be \"rollback\" (the default) or \"keep\", got {how!r}",
                       param="on_disconnect")
    return how == "keep"


def read_router_defaults(b: Body, endpoint: str) -> None:
    """Accept the fields sglang-router writes into ``endpoint``'s requests (:data:`~turbo.sglang_route.ROUTER_FILLS`)
    at the values it gives them; 400 naming the field otherwise."""
    for name, default in ROUTER_FILLS[endpoint].items():
        v = b.raw(name)
        if v is not None and (v != default or type(v) is not type(default)):
            raise APIError(400, f"'{name}' {json.dumps(v)[:40]} is not supported (liteturbo accepts only "
                                f"{json.dumps(default)}, as sglang-router sends it by default); leave it out",
                           param=name)
        b.refused.add(name)  # not listed among the fields it honours


def read_chat(data: dict, model_id: str, routing_key: str | None = None) -> ChatRequest:
    """A chat completion request's fields (400 / 404 naming the field). ``routing_key``: the request's
    ``x-smg-routing-key`` header (sglang-router's session affinity; it forwards the header but drops liteturbo's own
    body fields): a session id there (``sess-`` + 24 lowercase hex digits) makes the request a turn of that session,
    opened on first use, as ``session_id`` with ``create_session`` would; another key is only the router's."""
    b = Body(data, "a chat completion request")
    read_router_defaults(b, "chat")
    stream, include_usage, n = read_common(b, model_id, chat=True)
    sid = b.str("session_id")
    keyed = routing_key is not None and routing_key.startswith("sess-")  # meant as a session id
    if keyed and (why := session_id_problem(routing_key)):
        raise APIError(400, f"the header x-smg-routing-key {routing_key[:40]!r} starts like a session id but {why}",
                       param="x-smg-routing-key")
    if keyed and sid is not None and sid != routing_key:
        raise APIError(400, f"'session_id' {sid[:40]!r} and the header x-smg-routing-key {routing_key!r} name two "
                            "sessions: a router sends the request by the header; send one id (the header)",
                       param="session_id")
    by_header = sid is None and keyed
    if by_header:
        sid = routing_key
    messages = read_messages(b.raw("messages"), link=sid is None)
    want_lp, top = b.bool("logprobs"), b.int("top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want_lp:
        raise APIError(400, "'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
    if sid is not None and n > 1:
        raise APIError(400, "'n' > 1 cannot continue a session (one history, one reply); leave out session_id (or the "
                            "session id in x-smg-routing-key) or n", param="n")
    if sid is None and b.has("on_disconnect"):
        raise APIError(400, "'on_disconnect' applies to session turns only: add 'session_id' or leave it out",
                       param="on_disconnect")
    keep = read_on_disconnect(b)
    create = bool(b.bool("create_session")) or by_header
    if create and sid is None:
        raise APIError(400, "'create_session' opens the session named by 'session_id': add 'session_id' (sess- + 24 "
                            "lowercase hex digits, chosen by the client) or leave create_session out",
                       param="create_session")
    if create and (why := session_id_problem(sid)):
        raise APIError(400, f"'session_id' {why}", param="session_id")
    g = read_sampling(b) | read_constraint(b)
    calls = tools.read_tools(b.raw("tools"), b.raw("tool_choice"), b.raw("parallel_tool_calls"))
    b.done()
    return ChatRequest(messages, stream, include_usage, (top or 0) if want_lp else None, sid, g, n, calls, keep,
                       create)


def read_completion(data: dict, model_id: str) -> CompletionRequest:
    """A completion request's fields (400 / 404 naming the field)."""
    b = Body(data, "a completion request")
    read_router_defaults(b, "completion")
    stream, include_usage, n = read_common(b, model_id, chat=False)
    if not b.has("prompt"):
        raise APIError(400, "'prompt' is required: a string or a list of token ids", param="prompt")
    prompt = read_prompt(b.raw("prompt"))
    n_lp = b.int("logprobs", lo=0, hi=MAX_LOGPROBS)
    g = read_sampling(b) | read_constraint(b)
    b.done()
    return CompletionRequest(prompt, stream, include_usage, n_lp, g, n)


def read_new_session(data: dict) -> NewSession:
    """A new session's system prompt, sampling defaults and optional ``id`` (400 naming the field; an ``id`` must
    have the form of the ids the server makes, ``sess-`` + 24 lowercase hex digits)."""
    b = Body(data, "a session")
    system = b.str("system")
    sid = b.str("id")
    if sid is not None and (why := session_id_problem(sid)):
        raise APIError(400, f"'id' {why}", param="id")
    defaults = read_sampling(b)
    b.done()
    return NewSession(system, defaults, sid)


def read_turn(data: dict, model_id: str) -> Turn:
    """A session turn's fields (400 / 404 naming the field)."""
    b = Body(data, "a session turn")
    content = b.raw("content")
    if not isinstance(content, str) or not content.strip():
        raise APIError(400, "'content' must be a non-empty string: the user's message" if not isinstance(content, str)
                       or not content else "'content' is only whitespace: send the user's message", param="content")
    check_model(b, model_id)
    stream = bool(b.bool("stream"))
    role = b.raw("role", "user")
    if role not in ("user", "tool"):
        raise APIError(400, "'role' must be \"user\" (the default) or \"tool\" (a tool's result, with "
                            "'tool_call_id')", param="role")
    call_id = b.str("tool_call_id")
    if (role == "tool") != bool(call_id):
        raise APIError(400, "a tool result turn has \"role\": \"tool\" and the 'tool_call_id' it answers; a user "
                            "turn has neither", param="tool_call_id")
    g = read_sampling(b) | read_constraint(b)
    calls = tools.read_tools(b.raw("tools"), b.raw("tool_choice"), b.raw("parallel_tool_calls"))
    keep = read_on_disconnect(b)
    b.done()
    return Turn(content, stream, g, calls, call_id, keep)
