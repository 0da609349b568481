"""The ``qwen3_xml`` tool-call format (Qwen3-Coder; vLLM's ``qwen3_coder`` / ``qwen3_xml``): each call is an XML-style
block anywhere in the reply::

    <tool_call>
    <function=get_current_weather>
    <parameter=city>
    Dallas
    </parameter>
    <parameter=unit>
    fahrenheit
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags, less one newline after the opening tag and one before the
closing tag (a missing closing tag ends the value at the next parameter or at ``</function>``). It is typed by the
tool's schema (the request's ``tools``), as vLLM's ``qwen3_coder`` parser does (published examples: vLLM's
``tests/tool_use/test_qwen3coder_tool_parser.py``): a ``string`` (or an ``enum`` of strings) stays text;
``integer`` / ``number`` are read as numbers (a whole number as an integer), ``boolean`` as ``true`` / ``false``
(any case), ``null`` / ``None`` as null for a type that is not a string; ``object`` / ``array`` values as JSON, else
a Python literal (``{'k': 'v'}``); what does not convert stays text. A parameter the schema does not name, or any
parameter without ``tools``, is text. A block whose body is a JSON call object (what Qwen3's non-coder templates
write) is read as one too. A block that is neither is content.
"""
from __future__ import annotations

import ast
import json
import re

from .blocks import BlockFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
# a value ends at its closing tag, or (a tag the model left out, as vLLM's tests allow) at the next parameter or
# the function's end
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.S)


def _end(block: str) -> int | None:
    return len(block) if block.endswith(CLOSE) else None


# type names as vLLM's qwen3_coder parser reads them (models and users write "int", "float", "bool", "dict", ...)
_ALIASES = (("string", ("string", "str", "text", "varchar", "char", "enum")), ("boolean", ("bool", "binary")),
            ("integer", ("int", "uint", "long", "short", "unsigned")), ("number", ("num", "float", "double")),
            ("object", ("object", "dict")), ("array", ("array", "arr", "list")), ("null", ("null",)))


def _type(name: str) -> str | None:
    return next((t for t, prefixes in _ALIASES if any(name.startswith(p) for p in prefixes)), None)


def json_types(schema) -> set[str]:
    """The JSON types a property schema allows (``enum`` / ``const`` values' types and ``anyOf`` / ``oneOf``
    members included; vLLM's type aliases such as ``"int"`` or ``"float"`` read as JSON's)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = {_type(x) for x in (t if isinstance(t, list) else [t]) if isinstance(x, str)} - {None}
    for v in schema.get("enum", []) + ([schema["const"]] if "const" in schema else []):
        out.add({str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}.get(
            type(v), "object"))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            out |= json_types(sub)
    return out


def value(text: str, schema) -> object:
    """A parameter's text typed by its property ``schema`` (``None``: the parameter is not in the tool's schema,
    then the text is kept), as vLLM's qwen3_coder parser reads it (see the module docstring)."""
    types = json_types(schema)
    s = text.strip()
    if not types or types == {"string"}:
        return None if s == "null" and "null" in types else text
    if s in ("null", "None"):
        return None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if types & {"integer", "number"}:
        try:
            f = float(s)
            if f.is_integer() and abs(f) < 2 ** 53:
                return int(f)
            return f if "number" in types else text
        except ValueError:
            pass
    if types & {"object", "array", "null"} or types - {"string"}:
        try:
            return json.loads(s)
        except ValueError:
            try:
                return ast.literal_eval(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                pass
    return text


def _strip_newline(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def read(block: str, tools: dict | None) -> list[tuple[str, dict]] | None:
    """The calls of one ``<tool_call>`` ... ``</tool_call>`` block, or ``None`` when it holds none."""
    body = block[len(OPEN):-len(CLOSE)].strip()
    if body.startswith("{"):  # a hermes-style JSON call
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return None
        return [(obj["name"], args)]
    calls, pos = [], 0
    for m in _FUNCTION.finditer(body):
        if body[pos:m.start()].strip():
            return None
        name, inner = m.group(1).strip(), m.group(2)
        props = ((tools or {}).get(name) or {}).get("properties") or {}
        args, at = {}, 0
        for p in _PARAMETER.finditer(inner):
            if inner[at:p.start()].strip():
                return None
            key = p.group(1).strip()
            args[key] = value(_strip_newline(p.group(2)), props.get(key))
            at = p.end()
        if inner[at:].strip():
            return None
        calls.append((name, args))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


# llama.cpp's rule: Llama 3.1 / Functionary templates have "<function=" too, but not the other two
FORMAT = BlockFormat("qwen3_xml", (OPEN,), _end, read, template_marks=((OPEN, "<function=", "<parameter="),))
