"""The grammar of tool calls (Lark text in llguidance's dialect, for ``GenerationConfig(grammar=)``), per format of
:mod:`turbo.tool_parsers`: what forces a call for ``tool_choice`` "required" or a named function, and the lazy
grammar of "auto" (free text; a call, once its marker is written, follows the format and the tool's schema to its
end, as llguidance's docs write tool calling), so that no reply is a malformed call.

The arguments follow the tool's ``parameters`` schema, rewritten by :mod:`turbo.serve.schema_walk` (local ``$ref``
rebased, objects closed: a missing ``additionalProperties`` reads as false). JSON is written with ``", "`` /
``": "`` or compact separators and no other whitespace (``_JSON_STYLE``), so that a model cannot pad it forever.

- JSON formats: each call a ``%json`` object ``{"name": <const>, "arguments": <schema>}`` (llama3_json:
  ``"parameters"``). hermes: ``<tool_call>\\n{...}\\n</tool_call>`` blocks joined by ``\\n``; llama3_json: objects
  joined by ``"; "``; mistral / granite: the marker then a JSON array.
- qwen3_xml: ``<tool_call>\\n<function=NAME>\\n`` then the schema's properties in its order (the required ones
  always, the others optional), each ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``, then
  ``</function>\\n</tool_call>``. A string property's value is raw text up to ``\\n</parameter>`` (an ``enum`` of
  strings: one of them; with ``maxLength``: one line of ``minLength`` to ``maxLength`` characters; ``pattern`` and
  ``format`` are not enforced); any other value is ``%json`` of its schema.
- pythonic: ``[NAME(KEY=VALUE, ...), ...]`` with the properties in schema order (required always, others optional),
  each value ``%json`` of its schema (JSON's ``true`` / ``false`` / ``null`` are read by the pythonic parser).
- deepseek_v3: ``<｜tool▁calls▁begin｜>`` then each call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``, then
  ``<｜tool▁calls▁end｜>``.

A marker that is one special token of the model is matched as that token (``<[id]>``: its bytes never match text).
"""
from __future__ import annotations

import json
from ..tool_parsers import ToolParser
from ..tool_parsers import deepseek_v3, pythonic, qwen3_xml
from .schema_walk import close_objects, rebase_refs

# the requests' types are turbo.serve.tools' ToolRequest and Tool (which imports this module: not imported here)

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}
_ARRAY_MARKS = {"mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>"}


def call_grammar(tools: "turbo.serve.tools.ToolRequest", parser: str, tokenizer=None,
                 reasoning: bool = False) -> str | None:
    """The grammar of a reply to a request with ``tools`` in ``parser``'s format: for ``tool_choice`` "required"
    one call (one or more with ``parallel_tool_calls``) of any of the tools, for a named function exactly one call
    of it, for "auto" free text in which a started call follows the same rules; ``None`` for "none".
    ``tokenizer`` (optional) lets a marker that is a special token of the model be matched as that token.
    ``reasoning``: the grammar is the answer after a reasoning block (``GenerationConfig.after_reasoning``), so the
    free text of "auto" never opens with ``<think>`` (such a reply is the reasoning, read by the grammar around this
    one; without this, free text that may start anywhere would also read the reasoning and whatever follows it).
    Unknown ``parser``: LiteturboError."""
    ToolParser(parser)
    if tools.choice not in ("required", "named", "auto"):
        return None
    chosen = [t for t in tools.tools if tools.choice in ("required", "auto") or t.name == tools.named]
    many = tools.parallel and tools.choice != "named"
    build = {"qwen3_xml": _qwen3_xml, "pythonic": _pythonic, "deepseek_v3": _deepseek_v3}.get(parser, _json_calls)
    grammar = build(parser, chosen, tools.choice == "auto", many, tokenizer)
    if reasoning and tools.choice == "auto":  # the formats whose call stands at the start (llama3_json, pythonic,
        # mistral, granite) have a TEXT alternative; the others' free text is a lazy head and a TAIL, already right
        grammar = grammar.replace("\nTEXT: ", "\nTEXT: " + _NOT_THINKING + " & ", 1)
    return grammar


# text that does not open a reasoning block (after leading whitespace), for the free text of "auto" (``reasoning``)
_NOT_THINKING = r"/(?s:.*)/ & ~/[ \t\n\r]*<think>(?s:.*)/"


def _marker(text: str, tokenizer) -> str:
    """A marker in Lark: the special token's id (``<[id]>``) when the tokenizer has it as one special token (its
    bytes then never match text), else the string."""
    if tokenizer is not None:
        tid = tokenizer.get_added_vocab().get(text) if hasattr(tokenizer, "get_added_vocab") else None
        special = getattr(getattr(tokenizer, "added_tokens_decoder", {}).get(tid), "special", False)
        if tid is not None and (special or text in getattr(tokenizer, "all_special_tokens", ())):
            return f"<[{tid}]>"
    return json.dumps(text)


def _not_containing(marker: str) -> str:
    """A Lark terminal: any text without ``marker`` in it (llguidance's ``&`` / ``~`` operators)."""
    return f"/(?s:.*)/ & ~/(?s:.*){_regex_lit(marker)}(?s:.*)/"


def _regex_lit(text: str) -> str:
    """``text`` as a literal inside a llguidance ``/.../`` regex."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in text)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _anywhere(open_text: str, rest: str, many: bool, tokenizer) -> str:
    """"auto" for a format whose calls may stand anywhere in the text and open with ``open_text``: free text, the
    ``block`` rule (``rest``: what follows the marker) at most once without ``many``, and no marker outside a call."""
    open_ = _marker(open_text, tokenizer)
    if open_.startswith("<["):  # a special token: text can never spell it
        head, tail, head_rule = f"HEAD? {open_}", "TAIL: /(?s:.*)/", "HEAD: /(?s:.+)/"
    else:
        head, tail = "head", f"TAIL: {_not_containing(open_text)}"
        head_rule = f"head[lazy]: /(?s:.*)/ {open_}"
    return f"start: call{'*' if many else '?'} TAIL\ncall: {head} {rest}\n{head_rule}\n{tail}\n"


def _defs(chosen: list) -> dict:
    return {f"tool{i}": rebase_refs(close_objects(t.parameters), f"#/$defs/tool{i}") for i, t in enumerate(chosen)}


def _json_calls(parser: str, chosen: list, auto: bool, many: bool, tokenizer) -> str:
    """hermes, llama3_json, mistral, granite."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    defs = _defs(chosen)
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, key: {"$ref": f"#/$defs/tool{i}"}},
              "required": ["name", key], "additionalProperties": False} for i, t in enumerate(chosen)]
    body = json.dumps({"x-guidance": _JSON_STYLE, "$defs": defs, "anyOf": calls}, ensure_ascii=False)
    if parser in _ARRAY_MARKS:
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if many else {"maxItems": 1})}
        arr = json.dumps({"x-guidance": _JSON_STYLE, "$defs": defs, **array}, ensure_ascii=False)
        mark = _marker(_ARRAY_MARKS[parser], tokenizer)
        calls_rule = f"{mark} \" \"? calls\ncalls: %json {arr}\n"
        if not auto:
            return f"start: {calls_rule}"
        text = "/(?s:.*)/" if mark.startswith("<[") else _not_containing(_ARRAY_MARKS[parser])
        return f"start: TEXT | {calls_rule}TEXT: {text}\n"
    if parser == "llama3_json":
        rest = ' ("; " call)*' if many else ""
        if not auto:
            return f"start: call{rest}\ncall: %json {body}\n"
        tag = _marker("<|python_tag|>", tokenizer)
        text = r"/(?s:.*)/ & ~/[ \t\n\r]*\{(?s:.*)/"
        if not tag.startswith("<["):
            text += r" & ~/[ \t\n\r]*<\|python_tag\|>(?s:.*)/"
        return f"start: TEXT | {tag}? WS? call{rest}\ncall: %json {body}\nTEXT: {text}\nWS: /[ \\t\\n\\r]+/\n"
    open_, close, nl = _marker("<tool_call>", tokenizer), _marker("</tool_call>", tokenizer), _lit("\n")
    if auto:
        return _anywhere("<tool_call>", f"\"\\n\"? body \"\\n\"? {close}", many, tokenizer) + f"body: %json {body}\n"
    return (f"start: call{' (' + nl + ' call)*' if many else ''}\n"
            f"call: {open_} {nl} body {nl} {close}\nbody: %json {body}\n")


def _value_schema(tool, i: int, prop) -> str:
    """``%json`` of one property's schema (its refs rebased to the tool's schema, placed under ``$defs``)."""
    tool_schema = rebase_refs(close_objects(tool.parameters), f"#/$defs/tool{i}")
    # a $ref inside the property points into the tool's schema (its document), now at #/$defs/tool{i}
    sub = rebase_refs(close_objects(prop), f"#/$defs/tool{i}") if isinstance(prop, dict) else {}
    return "%json " + json.dumps({"x-guidance": _JSON_STYLE, "$defs": {f"tool{i}": tool_schema}, **sub},
                                 ensure_ascii=False)


def _params(tool) -> tuple[list[tuple[str, object]], set[str]]:
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    return [(k, v) for k, v in props.items() if isinstance(k, str)], required


def _qwen3_xml(parser: str, chosen: list, auto: bool, many: bool, tokenizer) -> str:
    rules, names = [], []
    for i, t in enumerate(chosen):
        params, required = _params(t)
        items = []
        for j, (key, prop) in enumerate(params):
            types = qwen3_xml.json_types(prop)
            if types == {"string"} and isinstance(prop, dict) and isinstance(prop.get("enum"), list):
                value = "(" + " | ".join(_lit(v + "\n</parameter>") for v in prop["enum"] if isinstance(v, str)) + ")"
            elif types == {"string"} and isinstance(prop, dict) and isinstance(prop.get("maxLength"), int):
                lo = prop.get("minLength") if isinstance(prop.get("minLength"), int) else 0
                value = f"/[^\\n]{{{lo},{prop['maxLength']}}}/ {_lit(chr(10) + '</parameter>')}"  # one line, bounded
            elif types == {"string"}:
                value = "svalue"
            else:
                value = f"{_value_schema(t, i, prop)} {_lit(chr(10) + '</parameter>')}"
            rules.append(f"t{i}p{j}: {_lit(f'<parameter={key}>' + chr(10))} {value} {_lit(chr(10))}")
            items.append(f"t{i}p{j}" + ("" if key in required else "?"))
        rules.append(f"t{i}: {_lit(f'<function={t.name}>' + chr(10))} {' '.join(items)} "
                     f"{_lit('</function>' + chr(10))}")
        names.append(f"t{i}")
    close = _marker(qwen3_xml.CLOSE, tokenizer)
    body = (f"body: {' | '.join(names)}\n" + "\n".join(rules) + "\n"
            + 'svalue[lazy]: /(?s:.*)/ "\\n</parameter>"\n')
    if auto:
        return _anywhere(qwen3_xml.OPEN, f"\"\\n\" body {close}", many, tokenizer) + body
    open_ = _marker(qwen3_xml.OPEN, tokenizer)
    call = f"call: {open_} \"\\n\" body {close}\n"
    return f"start: call{' (' + _lit(chr(10)) + ' call)*' if many else ''}\n{call}{body}"


def _pythonic(parser: str, chosen: list, auto: bool, many: bool, tokenizer) -> str:
    rules, names = [], []
    for i, t in enumerate(chosen):
        params, required = _params(t)
        n = len(params)
        for j, (key, prop) in enumerate(params):
            rules.append(f"t{i}p{j}: {_lit(key + '=')} {_value_schema(t, i, prop)}")
        # t{i}s{j}: params j.. with none written yet; t{i}r{j}: params j.. after one was written (", " first)
        for j in range(n, -1, -1):
            if j == n:
                rules += [f"t{i}s{j}: \"\"", f"t{i}r{j}: \"\""]
                continue
            opt = params[j][0] not in required
            rules.append(f"t{i}s{j}: t{i}p{j} t{i}r{j + 1}" + (f" | t{i}s{j + 1}" if opt else ""))
            rules.append(f"t{i}r{j}: \", \" t{i}p{j} t{i}r{j + 1}" + (f" | t{i}r{j + 1}" if opt else ""))
        rules.append(f"t{i}: {_lit(t.name + '(')} t{i}s0 \")\"")
        names.append(f"t{i}")
    rest = ' (", " call)*' if many else ""
    grammar = f"calls: \"[\" call{rest} \"]\"\ncall: {' | '.join(names)}\n" + "\n".join(rules) + "\n"
    if not auto:
        return "start: calls\n" + grammar
    start = _marker(pythonic.START, tokenizer)
    text = r"/(?s:.*)/ & ~/[ \t\n\r]*\[(?s:.*)/"
    if not start.startswith("<["):
        text += rf" & ~/[ \t\n\r]*{_regex_lit(pythonic.START)}(?s:.*)/"
    return f"start: TEXT | WS? {start}? calls\nTEXT: {text}\nWS: /[ \\t\\n\\r]+/\n" + grammar


def _deepseek_v3(parser: str, chosen: list, auto: bool, many: bool, tokenizer) -> str:
    defs = _defs(chosen)
    m = {k: _marker(v, tokenizer) for k, v in (("begin", deepseek_v3.CALL_BEGIN), ("end", deepseek_v3.CALL_END),
                                                 ("sep", deepseek_v3.SEP), ("close", deepseek_v3.CALLS_END))}
    rules = []
    for i, t in enumerate(chosen):
        args = json.dumps({"x-guidance": _JSON_STYLE, "$defs": defs, "$ref": f"#/$defs/tool{i}"}, ensure_ascii=False)
        rules.append(f"t{i}: {m['begin']} \"function\" {m['sep']} {_lit(t.name + chr(10) + '```json' + chr(10))} "
                     f"%json {args} {_lit(chr(10) + '```')} {m['end']}")
    rest = f"dcall{'+' if many else ''} {m['close']}"
    grammar = f"dcall: {' | '.join(f't{i}' for i in range(len(chosen)))}\n" + "\n".join(rules) + "\n"
    if auto:
        return _anywhere(deepseek_v3.CALLS_BEGIN, "calls", False, tokenizer) + f"calls: {rest}\n" + grammar
    return f"start: {_marker(deepseek_v3.CALLS_BEGIN, tokenizer)} {rest}\n" + grammar
