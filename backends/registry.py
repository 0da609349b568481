"""The backend registry: backend name → backend class, the one table that :func:`backends.get_backend` and
:meth:`backends.platform.Platform.usable_backends` read.

The built-in backends (``torch``, ``triton``, ``ascend``) are entered by where they live (module, class name) and
imported the first time the table is read: each of them imports :mod:`backends.platform`, which reads this table, so
naming them here by import would close a circle. :func:`register_backend` adds a class (or replaces one). This
module imports no other module of ``backends``.
"""
from __future__ import annotations

import importlib

# name → a backend class, or (module, class name) of a built-in not imported yet
_REGISTRY: dict[str, type | tuple[str, str]] = {
    "torch": ("backends.torch_backend", "TorchBackend"),
    "triton": ("backends.triton", "TritonBackend"),
    "ascend": ("backends.ascend", "AscendBackend"),
}


def register_backend(name: str, cls: type) -> None:
    """Make ``cls(device=..., **kwargs)`` (a :class:`~backends.base.Backend` subclass) available as
    ``get_backend(name)``; ``cls.unsupported_reason(platform)`` says where it cannot run."""
    _REGISTRY[name] = cls


def available_backends() -> list[str]:
    """Names accepted by :func:`backends.get_backend` (besides ``"auto"``), sorted."""
    return sorted(_REGISTRY)


def backend_class(name: str) -> type:
    """The class registered as ``name`` (importing a built-in on first use). Raises ``KeyError`` for a name not
    registered."""
    entry = _REGISTRY[name]
    if isinstance(entry, tuple):
        module, attr = entry
        entry = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return entry


def backend_classes() -> dict[str, type]:
    """The registry: name → backend class, in registration order."""
    return {name: backend_class(name) for name in list(_REGISTRY)}
