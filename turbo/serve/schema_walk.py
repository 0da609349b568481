"""Walking a JSON Schema by its schema positions: the one place that tells a subschema from data.

A user's schema is rewritten before it is compiled into a tool call's grammar (:func:`turbo.serve.tools.call_grammar`):
its local ``$ref`` pointers are rebased to where the schema now lives, and its objects are closed. Both rewrites must
touch schemas only. A key is a keyword or a name depending on where it stands: in ``{"properties": {"default":
{"$ref": "#/$defs/Level"}}}`` the key ``default`` is a property's name and its value a schema, while in ``{"default":
{"$ref": "x"}}`` the value is data, to be left exactly as written. So the walk follows JSON Schema 2020-12's
applicators (and draft-07's array ``items``, ``additionalItems``, ``definitions`` and schema-valued
``dependencies``):

- one subschema: ``additionalProperties``, ``additionalItems``, ``contains``, ``contentSchema``, ``else``, ``if``,
  ``items``, ``not``, ``propertyNames``, ``then``, ``unevaluatedItems``, ``unevaluatedProperties``;
- a list of subschemas: ``allOf``, ``anyOf``, ``oneOf``, ``prefixItems`` (and ``items`` given as a list);
- a map of names to subschemas: ``$defs``, ``definitions``, ``dependentSchemas``, ``patternProperties``,
  ``properties`` (and ``dependencies`` entries that are objects);
- everything else (``const``, ``enum``, ``default``, ``examples``, ``required``, unknown keys, ...) is data.
"""
from __future__ import annotations

from typing import Any, Callable

_ONE = ("additionalProperties", "additionalItems", "contains", "contentSchema", "else", "if", "items", "not",
        "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties", "dependencies")

__all__ = ["map_schemas", "rebase_refs", "close_objects"]


def map_schemas(schema: Any, fn: Callable[[dict, str], dict], parent: str = "") -> Any:
    """A copy of ``schema`` with ``fn(subschema, parent_keyword)`` applied to every (sub)schema object, innermost
    first; ``parent_keyword`` is the keyword the subschema stands under ("" for the root; ``"allOf"`` for a member
    of ``allOf``; ``"properties"`` for a property's schema). Data values are copied as they are, never visited.
    Booleans (``true``/``false`` schemas) and non-dicts are returned unchanged."""
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for k, v in schema.items():
        if k in _LIST and isinstance(v, list):
            out[k] = [map_schemas(s, fn, k) for s in v]
        elif k in _ONE and isinstance(v, dict):
            out[k] = map_schemas(v, fn, k)
        elif k in _MAP and isinstance(v, dict):
            out[k] = {name: map_schemas(s, fn, k) if isinstance(s, dict) else s for name, s in v.items()}
        else:
            out[k] = v
    return fn(out, parent)


def rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``"#"`` or ``"#/..."``) moved under ``base`` (a JSON pointer
    fragment such as ``"#/$defs/tool0"``, where the schema now lives): ``"#"`` → ``base``, ``"#/$defs/A"`` →
    ``base + "/$defs/A"``. Remote refs and data are left alone."""
    def fn(s: dict, _parent: str) -> dict:
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            s["$ref"] = base + ref[1:]
        return s
    return map_schemas(schema, fn)


def close_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` added to every object schema that lists ``properties``
    and says nothing about extra ones (no ``additionalProperties``, ``patternProperties`` or
    ``unevaluatedProperties``), as llama.cpp's schema-to-grammar reads a missing ``additionalProperties``: a model
    given an open object keeps inventing keys until its token limit. An explicit ``true`` (or a schema) is kept.
    Members of ``allOf`` and objects beside an ``allOf`` or a ``$ref`` stay open (closing a part would reject the
    properties of the others)."""
    def fn(s: dict, parent: str) -> dict:
        if parent != "allOf" and isinstance(s.get("properties"), dict) and not any(
                k in s for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref")):
            s["additionalProperties"] = False
        return s
    return map_schemas(schema, fn)
