"""Tool calling for the OpenAI-compatible server: the request's tools, tool messages, the prompt, the grammar that
forces a call, and the finish reason. It follows OpenAI's semantics, and vLLM's where OpenAI says nothing.

- :func:`read_tools` checks ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into a :class:`ToolRequest`
  (every error an :class:`~turbo.http_errors.APIError` 400 naming the field and the fix).
- :func:`read_tool_message` and :func:`link_tool_messages` read assistant messages with ``tool_calls`` and ``tool``
  messages into the dicts chat templates take (Hugging Face's convention; ``arguments`` as a dict);
  :func:`~turbo.serve.protocol.read_messages` calls them.
- :func:`render_prompt` renders a conversation with a request's tools: :func:`turbo.chat_render.render_prompt`
  (the chat template when it handles tools, else the documented Hermes-style fallback, SmolLM2's case). With
  ``tool_choice: "none"`` the tools are still in the prompt (as vLLM does by default) but the reply is not read for
  calls (``ToolRequest.parses``).
- :func:`choose_parser` picks the reply format from the chat template (or ``--tool-call-parser``); the parsers
  are :mod:`turbo.tool_parsers` (one module per format behind a registry; :class:`ToolParser`, :class:`ToolCall`
  re-exported here).
- :func:`call_grammar` (:mod:`turbo.serve.tool_grammar`, re-exported here) is the grammar that forces a call in
  the parser's format for ``tool_choice`` "required" or a named function, and for "auto" a lazy grammar: free text,
  and a call once its marker is written (so no reply is a malformed call).
- :func:`finish_reason` is ``"tool_calls"`` when a reply made calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from .. import chat_render
from ..chat_render import template_handles_tools, template_text  # noqa: F401 - this module's API too
from ..http_errors import APIError
from .tool_grammar import call_grammar
from ..tool_parsers import PARSERS, ToolCall, ToolParser, parser_for_template

__all__ = ["Tool", "ToolRequest", "read_tools", "read_tool_message", "link_tool_messages", "render_prompt",
           "template_handles_tools", "call_grammar", "finish_reason", "ToolCall", "ToolParser", "choose_parser",
           "PARSERS"]

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


def choose_parser(tokenizer, explicit: str | None = None) -> str:
    """The tool-call format of a model: ``explicit`` when given (``--tool-call-parser``; an unknown name raises a
    :class:`~lite.formats.LiteturboError` listing ``PARSERS``), else the one its chat template writes
    (:func:`turbo.tool_parsers.parser_for_template`), else hermes (what the fallback prompt of templates without
    tools asks for)."""
    if explicit is not None:
        return ToolParser(explicit).name
    return parser_for_template(template_text(tokenizer))


@dataclass(frozen=True)
class Tool:
    """One function the model may call. parameters: its arguments' JSON schema (an object schema)."""

    name: str
    description: str | None
    parameters: dict
    strict: bool = False

    def openai(self) -> dict:
        """The tool as OpenAI's ``tools`` list holds it (what chat templates take)."""
        f: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            f["description"] = self.description
        f["parameters"] = self.parameters
        return {"type": "function", "function": f}


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools. choice: "none", "auto", "required" or "named" (then ``named`` is the function);
    parallel: ``parallel_tool_calls``."""

    tools: tuple[Tool, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the reply is read for calls (not for ``tool_choice: "none"``)."""
        return self.choice != "none"

    @property
    def max_calls(self) -> int | None:
        """The most calls a reply keeps (1 without parallel calls or with a named function; None: no limit)."""
        return None if self.parallel and self.choice != "named" else 1

    def openai(self) -> list[dict]:
        """The tools as OpenAI's ``tools`` list (what chat templates take)."""
        return [t.openai() for t in self.tools]

    @property
    def schemas(self) -> dict[str, dict]:
        """``{name: parameters schema}``: what a parser that types arguments by the schema reads (qwen3_xml)."""
        return {t.name: t.parameters for t in self.tools}


def _bad(param: str, what: str) -> APIError:
    return APIError(400, what, param=param)


def _check_schema(name: str, schema: Any, where: str) -> dict:
    """A function's ``parameters``: a JSON object schema that llguidance compiles (400 naming the tool if not)."""
    import llguidance

    if not isinstance(schema, dict):
        raise _bad("tools", f"{where}.parameters of '{name}' must be a JSON schema object, got "
                            f"{json.dumps(schema)[:80]}")
    if schema.get("type", "object") != "object":
        raise _bad("tools", f"{where}.parameters of '{name}' must be a schema of \"type\": \"object\" (arguments are "
                            f"a JSON object), got \"type\": {json.dumps(schema['type'])[:40]}")
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError) as e:
        error = str(e)
    if error:
        raise _bad("tools", f"{where}.parameters of '{name}' is a JSON schema this server cannot enforce: "
                            f"{error.strip()[:300]}; simplify the schema (llguidance supports most of JSON schema "
                            f"draft 2020-12; no lookaround in patterns, only known formats)")
    return schema


def _read_tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise _bad("tools", f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"description\": ..., \"parameters\": {{...}}}}}}; only function tools are supported")
    extra = sorted(set(t) - {"type", "function"}) or sorted(set(t["function"]) - {"name", "description",
                                                                                  "parameters", "strict"})
    if extra:
        raise _bad("tools", f"{where} has unsupported field {extra[0]!r}; a function tool has type and function "
                            f"(name, description, parameters, strict)")
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad("tools", f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                            f"{json.dumps(name)[:80]}")
    desc, strict = f.get("description"), f.get("strict")
    if desc is not None and not isinstance(desc, str):
        raise _bad("tools", f"{where}.function.description of '{name}' must be a string")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("tools", f"{where}.function.strict of '{name}' must be true or false")
    params = f.get("parameters")
    if params is None:  # OpenAI: a function without parameters takes none
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    else:
        params = _check_schema(name, params, where)
    return Tool(name, desc, params, bool(strict))


def _read_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in _CHOICES:
        return choice, None
    ok = (isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "function"}
          and isinstance(choice["function"], dict) and set(choice["function"]) == {"name"})
    if not ok:
        raise _bad("tool_choice", f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": "
                                  f"\"function\", \"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:100]}")
    name = choice["function"]["name"]
    if name not in names:
        raise _bad("tool_choice", f"'tool_choice' names the function {json.dumps(name)[:80]}, which is not in "
                                  f"'tools' ({', '.join(names) or 'none given'}); name one of them")
    return "named", name


def read_tools(body_tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The checked ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request (``None`` for a field
    not given); ``None`` when there are no tools (absent or ``[]``). ``tool_choice`` defaults to "auto" with
    tools; without tools only "none" is accepted (as vLLM does; OpenAI refuses it too). Raises
    :class:`~turbo.http_errors.APIError` (400) naming the field: tools that are not a list of function tools,
    a bad or repeated name, ``parameters`` that are not an object schema llguidance compiles, an unknown choice or
    one naming a function not in ``tools``, a ``parallel_tool_calls`` that is not a boolean."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls", f"'parallel_tool_calls' must be true or false, got "
                                          f"{json.dumps(parallel_tool_calls)[:80]}")
    if body_tools is None or body_tools == []:
        if tool_choice is not None and tool_choice != "none":
            raise _bad("tool_choice", "'tool_choice' needs 'tools': give the functions the model may call, or leave "
                                      "'tool_choice' out")
        return None
    if not isinstance(body_tools, list):
        raise _bad("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    tools = tuple(_read_tool(i, t) for i, t in enumerate(body_tools))
    names = [t.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise _bad("tools", f"'tools' names the function '{dup}' twice; give each function once")
    choice, named = _read_choice(tool_choice, names)
    return ToolRequest(tools, choice, named, True if parallel_tool_calls is None else parallel_tool_calls)


# --- messages --------------------------------------------------------------------------------------------------------

def _read_call(c: Any, where: str) -> dict:
    """One ``tool_calls`` entry of an assistant message, ``arguments`` decoded (it must hold a JSON object)."""
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON object text>"}}'
    if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict) \
            or set(c) - {"id", "type", "function"} or set(c["function"]) - {"name", "arguments"}:
        raise _bad("messages", f"{where} must be {shape}")
    f = c["function"]
    if not isinstance(c.get("id"), str) or not c["id"]:
        raise _bad("messages", f"{where}.id must be a non-empty string: the id tool messages answer")
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise _bad("messages", f"{where}.function.name must be the called function's name")
    args = f.get("arguments")
    try:
        decoded = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise _bad("messages", f"{where}.function.arguments must be a JSON object as a string, e.g. "
                               f"\"{{\\\"city\\\": \\\"Paris\\\"}}\", got {json.dumps(args)[:80]}")
    return {"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": decoded}}


def read_tool_message(m: dict, where: str, content_of: Callable[[Any, str], str]) -> dict:
    """A ``tool`` message, or an ``assistant`` message with ``tool_calls``, as a chat template takes it:
    ``{"role": "tool", "content": str, "tool_call_id": str}`` or ``{"role": "assistant", "content": str (""
    when null or absent), "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}]}``
    (``tool_calls`` ``[]`` or null gives a plain assistant message). ``content_of(content, where)`` reads a content
    field (a string or text parts). Raises :class:`~turbo.http_errors.APIError` (400) naming the message."""
    if m.get("role") == "tool":
        extra = sorted(set(m) - {"role", "content", "tool_call_id", "name"})
        if extra:
            raise _bad("messages", f"{where} has unsupported field {extra[0]!r}: a tool message has role, "
                                   f"content and tool_call_id")
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise _bad("messages", f"{where} (role \"tool\") needs 'tool_call_id': the id of the assistant's "
                                   f"tool call it answers")
        return {"role": "tool", "content": content_of(m.get("content"), where), "tool_call_id": m["tool_call_id"]}
    extra = sorted(set(m) - {"role", "content", "tool_calls"})
    if extra:
        raise _bad("messages", f"{where} has unsupported field {extra[0]!r}: an assistant message with tool calls "
                               f"has role, content and tool_calls")
    calls = [] if m.get("tool_calls") is None else m["tool_calls"]
    if not isinstance(calls, list):
        raise _bad("messages", f"{where}.tool_calls must be a list of calls")
    content = m.get("content")
    out = {"role": "assistant", "content": "" if content is None else content_of(content, where)}
    if calls:
        out["tool_calls"] = [_read_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        ids = [c["id"] for c in out["tool_calls"]]
        if len(set(ids)) < len(ids):
            raise _bad("messages", f"{where}.tool_calls repeats an id; give each call its own id")
    return out


def link_tool_messages(messages: list[dict]) -> None:
    """Check that every tool message answers a call of the assistant message before it (other tool messages may
    come between), as OpenAI does, and give it that call's function as ``name`` (some templates show it)."""
    calls: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            calls = {c["id"]: c["function"]["name"] for c in m.get("tool_calls", ())}
            continue
        if m["tool_call_id"] not in calls:
            made = f"its calls are {', '.join(calls)}" if calls else "it made no tool calls"
            raise _bad("messages", f"messages[{i}] answers tool_call_id {json.dumps(m['tool_call_id'])[:80]}, but "
                                   f"the assistant message before it made no such call ({made}); a tool message "
                                   f"must follow the assistant message whose call it answers")
        m["name"] = calls[m["tool_call_id"]]


# --- the prompt ------------------------------------------------------------------------------------------------------

def render_prompt(tokenizer, messages: list[dict], tools: ToolRequest | None = None) -> str:
    """:func:`turbo.chat_render.render_prompt` with a request's tools (the fallback rendering is described there)."""
    return chat_render.render_prompt(tokenizer, messages, tools.openai() if tools else None)


def finish_reason(engine_reason: str, calls: list, tools: ToolRequest | None = None) -> str:
    """OpenAI's ``finish_reason`` of a reply: ``"tool_calls"`` when it made calls and ended on its own (stop), else
    the engine's reason (``"length"`` stays: the last call's arguments may be cut off). A named ``tool_choice``
    keeps ``"stop"``, as OpenAI (and vLLM) answer it."""
    if calls and engine_reason == "stop" and not (tools is not None and tools.choice == "named"):
        return "tool_calls"
    return engine_reason
