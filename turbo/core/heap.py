"""Giving freed heap memory back to the operating system (glibc's ``malloc_trim``).

A long-running engine allocates and frees large temporary tensors again and again: a session's KV exported and
written after every turn (tens of MB at a few thousand tokens), a saved session's KV read back. glibc serves
allocations under its mmap threshold (which rises to 32 MB as large blocks are freed) from its heap arenas and keeps
freed pages there, so the process's resident memory creeps up with the fragments (a 10-minute soak of
``liteturbo serve`` grew its engine process by ~20 %). :func:`trim_heap` asks glibc to return free pages (``malloc_trim(0)``:
the top of each arena and, since glibc 2.8, free pages inside it), at most once per ``min_interval`` seconds; where
there is no glibc (musl, macOS, Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

_lock = threading.Lock()
_last = 0.0
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    _malloc_trim = _libc.malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


def trim_heap(min_interval: float = 1.0) -> bool:
    """Return the heap's free pages to the OS, unless it was done less than ``min_interval`` seconds ago or the C
    library has no ``malloc_trim``; whether it ran."""
    global _last
    if _malloc_trim is None:
        return False
    with _lock:
        now = time.monotonic()
        if now - _last < min_interval:
            return False
        _last = now
    _malloc_trim(0)
    return True
