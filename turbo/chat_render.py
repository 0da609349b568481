"""Rendering a conversation for the model, with tools: the chat template when it handles tools, else a fallback.

A chat template that handles tools (its text mentions ``tools``) gets them itself (``apply_chat_template(tools=...)``).
A template without tool support (SmolLM2's, the default model's) gets the **fallback**: the tools are listed as JSON,
one per line inside ``<tools></tools>``, in a system message (after the user's own system message when there is
one), with the instruction to answer a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(the Hermes format); earlier assistant calls are written the same way into the assistant's text, and tool results
become user messages holding ``<tool_response>\\n...\\n</tool_response>`` blocks (consecutive results in one
message). Then the model's own template renders the result. Used by the server (:mod:`turbo.serve.tools`) and by
sessions (:mod:`turbo.session`); messages are Hugging Face's chat-template dicts (assistant ``tool_calls`` with
``arguments`` as a dict, ``tool`` messages with ``content`` and ``tool_call_id``), tools OpenAI's ``tools`` list.
"""
from __future__ import annotations

import json
from typing import Any

from .errors import InvalidRequest


def template_text(tokenizer) -> str:
    """The tokenizer's chat template text ("" when it has none; several named templates are joined)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(v for v in t.values() if isinstance(v, str))
    return t if isinstance(t, str) else ""


_FALLBACK = (
    "# Tools\n\nYou may call functions to help with the user's request. The functions are listed as JSON inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a JSON object holding its "
    "name and its arguments inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
    "{{\"name\": <function name>, \"arguments\": <the arguments as a JSON object>}}\n</tool_call>\n"
    "Each function's result comes back inside <tool_response></tool_response>.")


def _fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template without tool support (the module docs say how)."""
    out: list[dict] = []
    last_tool = False
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if last_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m.get("tool_calls"):
            blocks = ["<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments":
                                                   c["function"]["arguments"]}, ensure_ascii=False) + "\n</tool_call>"
                      for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + blocks)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        last_tool = m["role"] == "tool"
    if tools:
        text = _FALLBACK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def template_handles_tools(tokenizer, tools: list[dict] | None = None) -> bool:
    """Whether the chat template used with ``tools`` mentions ``tools`` (then it renders them itself)."""
    try:
        text = tokenizer.get_chat_template(tools=tools)
    except (AttributeError, ValueError, TypeError):
        text = template_text(tokenizer)
    return "tools" in text


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation (from :func:`~turbo.serve.protocol.read_messages`) with the generation
    prompt: the model's chat template with ``tools``, or the fallback of the module docs when the template does
    not handle tools; without tools and tool messages exactly ``apply_chat_template(messages,
    add_generation_prompt=True, tokenize=False)``. Raises :class:`~turbo.errors.InvalidRequest` (400) when the
    tokenizer has no chat template or the template refuses the conversation."""
    import jinja2

    if not template_text(tokenizer):
        raise InvalidRequest("the model's tokenizer has no chat template; use /v1/completions with a plain prompt")
    kw: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
    spec = tools or None
    try:
        if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            return tokenizer.apply_chat_template(messages, **kw)
        if template_handles_tools(tokenizer, spec):
            return tokenizer.apply_chat_template(messages, tools=spec, **kw)
        return tokenizer.apply_chat_template(_fallback(messages, tools), **kw)
    except jinja2.TemplateError as e:
        raise InvalidRequest(f"the model's chat template refused this conversation: {e}") from None
