"""turbo: the inference engine (paged KV cache, stateful sessions, W4A16 kernels through ``backends``).

``Engine``, ``EngineConfig``, ``GenerationConfig``, ``GenerationOutput`` and ``Session`` load on first use, so a
module of this package that needs none of them (the router, ``liteturbo route``; the remote chat client) imports no
engine code.
"""
from __future__ import annotations

import importlib

_PUBLIC = {"Engine": "engine", "GenerationOutput": "engine", "Session": "session",
           "EngineConfig": "config", "GenerationConfig": "config"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'turbo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
