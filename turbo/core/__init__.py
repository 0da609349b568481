"""The engine floor: step data, scheduler, block manager, runner, model, sampler, detokenizer, inputs, memory
accounting, start-up and :class:`~turbo.core.engine.EngineCore`. Imports nothing of turbo above it but
:mod:`turbo.config` and :mod:`turbo.errors`.

The names below are its public API: what the floors above it (``turbo/engine.py``, ``session.py``, ``loop.py``,
``perplexity.py``, the HTTP front ``turbo/serve/`` and the engine process ``turbo/engine_proc/``) import, always as
``from turbo.core import NAME`` (``tests/test_structure.py`` checks it). They load lazily, so the HTTP front that
only needs the tokenizer helpers does not import the model code.
"""
from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_PUBLIC = {
    "EngineCore": "engine",
    "Request": "request",
    "GenerationOutput": "request",
    "StepInput": "request",
    "saved_kv_ref": "kv_tier",
    "encode": "inputs",
    "chat_template_ids": "inputs",
    "load_tokenizer": "startup",
    "pack_serving_layout": "startup",
    "trim_heap": "heap",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"turbo.core has no public name {name!r}; the public API is {__all__}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
