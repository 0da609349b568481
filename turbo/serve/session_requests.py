"""Reading the sessions API's own bodies: ``POST /v1/sessions`` (:func:`read_new_session`) and a turn,
``POST /v1/sessions/{id}/chat`` (:func:`read_turn`), each into one plain request object, with the checks of
:mod:`turbo.serve.protocol` (every failure an :class:`~turbo.serve.responses.APIError` naming the field and the fix).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import tools
from .protocol import Body, check_model, read_on_disconnect, read_sampling
from .responses import APIError
from .sessions import session_id_problem
from .structured import read_constraint


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
