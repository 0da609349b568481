"""Kernel backends behind one small interface, chosen through an explicit registry: the package's public names.

``get_backend("auto" | "torch" | "triton" | "ascend", device)`` returns a :class:`Backend` (:mod:`backends.base`): the
torch reference (:mod:`backends.torch_backend`, on CPUs with the C++ kernels of :mod:`backends.cpu_ext` where they
build), the Triton kernels for CUDA/ROCm (:mod:`backends.triton`) or the Ascend one for NPUs (:mod:`backends.ascend`).
A backend allocates the paged KV cache (:mod:`backends.kv_cache`: 16-bit, int8, int4) and runs the kernels over it;
what crosses the interface is plain data (:mod:`backends.types`). The registry itself (``register_backend``,
``available_backends``, ``backend_classes``) is :mod:`backends.registry`, re-exported here: modules inside the
package import it, never this ``__init__``. ``"auto"`` asks the device's :class:`~backends.platform.Platform`
(Triton on CUDA/ROCm, Ascend on NPUs, torch elsewhere); :mod:`backends.platform` also names the cache folder
(``liteturbo_home``). ``backends`` imports only torch (and triton inside :mod:`backends.triton`, only when that
backend is used): it knows nothing of ``lite`` or ``turbo``.
"""
from __future__ import annotations

import torch

from .ascend import AscendBackend
from .base import Backend
from .kv_cache import KV_CACHE_DTYPES, KVCacheSpec, KVQuantParams, PagedKVCache
from .platform import Platform, current_platform
from .registry import available_backends, backend_class, backend_classes, register_backend
from .torch_backend import TorchBackend
from .triton import TritonBackend
from .types import AttentionMetadata, ExpertsHandle, LinearSpec, QuantizedWeight


def get_backend(name: str = "auto", device: torch.device | str = "auto", **kwargs) -> Backend:
    """Instantiate a backend by name on ``device`` (``auto``, ``cpu``, ``cuda[:N]``, ``npu[:N]``). ``"auto"`` picks
    the best one that runs on the device (:meth:`Platform.default_backend`).

    Raises ``ValueError`` naming the registered backends when ``name`` is unknown, and naming the reason and the
    fix when the backend cannot run on ``device`` (e.g. Triton on a CPU without ``TRITON_INTERPRET=1``).
    """
    plat = current_platform(device)
    if not isinstance(name, str):
        raise ValueError(f"backend must be a name ({', '.join(['auto'] + available_backends())}), got {name!r}")
    name = name.strip().lower()
    if name == "auto":
        name = plat.default_backend()
    if name not in available_backends():
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(['auto'] + available_backends())}")
    cls = backend_class(name)
    why = cls.unsupported_reason(plat)
    if why:
        raise ValueError(f"backend {name!r} cannot run on {plat.kind} ({plat.device}): {why}")
    return cls(device=plat.device, **kwargs)


__all__ = ["Backend", "TorchBackend", "TritonBackend", "AscendBackend", "Platform", "current_platform", "backend_classes", "KV_CACHE_DTYPES", "KVCacheSpec", "KVQuantParams", "PagedKVCache", "AttentionMetadata", "ExpertsHandle", "LinearSpec", "QuantizedWeight", "get_backend",
           "register_backend", "available_backends"]
