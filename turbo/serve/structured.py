"""Reading structured-output fields of the HTTP API into a constraint of :class:`~turbo.config.GenerationConfig`.

Accepted, at most one per request (each a 400 naming the field when malformed or when two are given):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object)
  or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``;
- vLLM's extras: ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_choice`` (a list of
  strings), ``guided_grammar`` (Lark in llguidance's dialect; GBNF, recognised by ``::=``, is converted by the
  engine), ``guided_decoding_backend`` (only ``auto``/``llguidance``/``guidance``: the one
  backend here), and the newer ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``).

The result is :class:`~turbo.config.GenerationConfig` keywords (``json_schema``, ``regex``, ``choice``, ``grammar``);
the grammar itself is compiled by the engine when the request is added (llguidance, :mod:`turbo.core.guided`), whose
refusal is a 400 naming the reason. Nothing here calls the engine.
"""
from __future__ import annotations

import json
from typing import Any

from ..http_errors import APIError

_BACKENDS = ("auto", "llguidance", "guidance")
_SO_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_schema"}


def _schema(v: Any, where: str) -> dict | bool:
    """A JSON schema given as an object (or its JSON text): 400 naming ``where`` otherwise."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise APIError(400, f"'{where}' is not valid JSON ({e}); give a JSON schema object", param=where) from None
    if not isinstance(v, (dict, bool)):
        raise APIError(400, f"'{where}' must be a JSON schema (an object)", param=where)
    return v


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise APIError(400, f"'{where}' must be a non-empty string", param=where)
    return v


def _choice(v: Any, where: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise APIError(400, f"'{where}' must be a non-empty list of non-empty strings", param=where)
    return v


def _response_format(v: Any) -> dict:
    where = "response_format"
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param=where)
    kind = v["type"]
    extra = sorted(set(v) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in v):
        raise APIError(400, f"'response_format' of type {kind!r} has unexpected keys "
                            f"{extra or ['json_schema']}", param=where)
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    js = v.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js and "name" not in js:
        raise APIError(400, "'response_format.json_schema' must be an object {\"name\": ..., \"schema\": {...}, "
                            "\"strict\": true}", param=where)
    bad = sorted(set(js) - {"name", "schema", "strict", "description"})
    if bad:
        raise APIError(400, f"'response_format.json_schema' has unknown keys {bad}", param=where)
    if "strict" in js and not isinstance(js["strict"], bool):
        raise APIError(400, "'response_format.json_schema.strict' must be true or false", param=where)
    # OpenAI: a missing schema means any JSON object; strict or not, the reply is held to the schema here
    return {"json_schema": _schema(js.get("schema", {"type": "object"}), "response_format.json_schema.schema")}


def _structured_outputs(v: Any) -> dict:
    where = "structured_outputs"
    if not isinstance(v, dict):
        raise APIError(400, "'structured_outputs' must be an object with one of json, regex, choice, grammar, "
                            "json_object", param=where)
    unknown = sorted(set(v) - set(_SO_KEYS) - {"backend"})
    if unknown:
        raise APIError(400, f"'structured_outputs' has unsupported keys {unknown}; this server reads json, regex, "
                            f"choice, grammar and json_object", param=where)
    given = {k: x for k, x in v.items() if k in _SO_KEYS and x is not None and x is not False}
    if len(given) != 1:
        raise APIError(400, f"'structured_outputs' must give exactly one of {sorted(_SO_KEYS)}, got "
                            f"{sorted(given) or 'none'}", param=where)
    (k, x), = given.items()
    if k == "json_object":
        return {"json_schema": {"type": "object"}}
    read = {"json": _schema, "regex": _text, "choice": _choice, "grammar": _text}[k]  # GBNF: the engine converts
    return {_SO_KEYS[k]: read(x, f"{where}.{k}")}


_GUIDED = {"guided_json": ("json_schema", _schema), "guided_regex": ("regex", _text),
           "guided_choice": ("choice", _choice), "guided_grammar": ("grammar", _text)}


def read_constraint(b) -> dict:
    """The structured-output fields of request body ``b`` (a :class:`~turbo.serve.protocol.Body`) as
    :class:`~turbo.config.GenerationConfig` keywords (empty: unconstrained). 400 naming the field when one is
    malformed or when two constraints are given."""
    found: list[tuple[str, dict]] = []
    if b.has("response_format"):
        found.append(("response_format", _response_format(b.raw("response_format"))))
    if b.has("structured_outputs"):
        found.append(("structured_outputs", _structured_outputs(b.raw("structured_outputs"))))
    for name, (kw, read) in _GUIDED.items():
        if b.has(name) and b.raw(name) is not None:
            found.append((name, {kw: read(b.raw(name), name)}))
    backend = b.str("guided_decoding_backend")
    if backend is not None and backend.split(":")[0] not in _BACKENDS:
        raise APIError(400, f"'guided_decoding_backend' {backend!r} is not available; this server's constrained "
                            f"decoding is llguidance (give 'auto' or leave it out)", param="guided_decoding_backend")
    found = [(n, kw) for n, kw in found if kw]
    if len(found) > 1:
        raise APIError(400, f"give one structured-output constraint, not {' and '.join(n for n, _ in found)}",
                       param=found[1][0])
    return found[0][1] if found else {}
