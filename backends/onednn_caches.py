"""oneDNN's shape-keyed caches, bounded: how many compiled primitives torch's CPU GEMMs and convolutions keep.

torch's 16-bit CPU linears (and some attention paths) run oneDNN primitives compiled for one input shape, kept in
two LRU caches: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 1024 entries) and ideep's
computation cache (``LRU_CACHE_CAPACITY``, default 1024). A serving engine meets a new row count at almost every
prefill step (the tokens a step computes vary), so both fill with one-off shapes, each entry holding its scratch
memory: here the engine process of ``liteturbo serve`` grew by ~2.4 MiB of live heap per random-shape step, 18 %
in the 10-minute soak (bench/soak.py), and would keep growing until both caches held 1024 entries. Turning them off
(capacity 0) stops the growth but made batch-1 decode 2.5x slower; 64 entries each keep the shapes a step repeats
(decode batch sizes, chunk sizes) at the same decode and prefill speed and stopped the growth (docs/serving.md).

:func:`bound_onednn_caches` sets both variables when the user has not, before the first primitive is made: oneDNN
and ideep read them once, at their first use in the process (so it runs at engine start, before the first forward;
a process that already ran a 16-bit CPU GEMM keeps its caches as they are).
"""
from __future__ import annotations

import os

CACHE_CAPACITY = 64
_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = CACHE_CAPACITY) -> dict[str, str]:
    """Set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` to ``capacity`` where unset (a user's own
    value is kept); returns both variables' values now. Raises ``ValueError`` for a negative ``capacity``."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    for name in _VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in _VARIABLES}
