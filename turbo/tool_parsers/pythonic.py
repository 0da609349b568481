"""The ``pythonic`` tool-call format (Llama 3.2 and Llama 4; vLLM's ``pythonic`` / ``llama4_pythonic``): the reply
is a Python list of calls with keyword arguments, optionally between Llama 4's ``<|python_start|>`` and
``<|python_end|>``::

    [get_weather(city='San Francisco', metric='celsius'), get_time(zone="PST")]

Argument values are Python literals (strings, numbers, ``True`` / ``False`` / ``None``, lists, dicts; JSON's
``true`` / ``false`` / ``null`` too, which the grammar of :mod:`turbo.serve.tool_grammar` writes), as JSON in the
call. The list must start the reply (after whitespace); a reply that starts otherwise, or a list that is not calls
of this form (positional arguments, a call of something that is not a name), is content. Published examples: Meta's
``models/llama3_2/text_prompt_format.md`` ("Model Response Format") and vLLM's pythonic parser tests. Unlike vLLM's
parser (which needs the whole reply to be the list), text after the list is kept as content.
"""
from __future__ import annotations

import ast

from .blocks import BlockFormat

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _end(block: str) -> int | None:
    """The length of the list once its ``]`` closes it (the text parses as a Python expression)."""
    if not block.endswith("]"):
        return None
    try:
        ast.parse(block.removeprefix(START).strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return len(block)


def _literal(node: ast.AST) -> object:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [_literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    v = ast.literal_eval(node)
    if isinstance(v, (complex, bytes, set, frozenset)) or isinstance(v, float) and v != v:
        raise ValueError("not a JSON value")
    return v


def read(block: str, tools: dict | None) -> list[tuple[str, dict]] | None:
    """The calls of the list, or ``None`` when it is not a list of keyword-argument calls."""
    try:
        tree = ast.parse(block.removeprefix(START).strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                    and all(k.arg is not None for k in call.keywords)):
                return None
            calls.append((call.func.id, {k.arg: _literal(k.value) for k in call.keywords}))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


# vLLM's pythonic templates for Llama 3.2 and 4, and Meta's docs, all spell the format out with "[func_name1(";
# Llama 4's own Hugging Face template asks for JSON instead (llama3_json)
FORMAT = BlockFormat("pythonic", ("[", START), _end, read, start_only=True, trailer=END,
                     template_marks=("[func_name1(",))
