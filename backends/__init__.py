"""Kernel backends behind one small interface, chosen through an explicit registry.

``get_backend("auto" | "torch", device)`` returns a :class:`Backend`; a backend allocates the paged KV cache
(:mod:`backends.kv_cache`: 16-bit, int8, int4) and runs the kernels over it. ``backends`` imports only torch.
"""
from __future__ import annotations

from typing import Callable

import torch

from .base import Backend
from .kv_cache import KV_CACHE_DTYPES, KVCacheSpec, KVQuantParams, PagedKVCache
from .torch_backend import TorchBackend
from .types import AttentionMetadata, QuantizedWeight

_REGISTRY: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``factory(device=..., **kwargs)`` available as ``get_backend(name)``."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """Names accepted by :func:`get_backend` (besides ``"auto"``)."""
    return sorted(_REGISTRY)


def get_backend(name: str = "auto", device: torch.device | str = "cpu", **kwargs) -> Backend:
    """Instantiate a backend by name. ``"auto"`` picks the best registered one for ``device``.

    Raises ``ValueError`` naming the registered backends when ``name`` is unknown.
    """
    if name == "auto":
        name = "torch"  # the only backend registered so far; Triton/Ascend plug in here
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(['auto'] + available_backends())}")
    return _REGISTRY[name](device=device, **kwargs)


register_backend("torch", TorchBackend)

__all__ = ["Backend", "TorchBackend", "KV_CACHE_DTYPES", "KVCacheSpec", "KVQuantParams", "PagedKVCache", "AttentionMetadata", "QuantizedWeight", "get_backend",
           "register_backend", "available_backends"]
