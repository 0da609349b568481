"""oneDNN's shape-keyed caches are bounded at engine start (backends/onednn_caches.py): 360 bf16 linears of new row
counts grow the live heap by hundreds of MiB with torch's defaults, by little once bounded, in fresh processes."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from backends.onednn_caches import CACHE_CAPACITY, bound_onednn_caches

_PROBE = textwrap.dedent("""
    import ctypes, sys
    class MI2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uord ford keep".split()]
    libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI2
    if sys.argv[1] == "bounded":
        from backends.onednn_caches import bound_onednn_caches
        bound_onednn_caches()
    import torch
    torch.set_num_threads(1)
    w = torch.randn(1536, 576, dtype=torch.bfloat16)
    for m in range(1, 40):  # warm-up: the first shapes, and torch's own one-off allocations
        torch.nn.functional.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
    before = libc.mallinfo2().uord
    for m in range(40, 400):  # a new row count per call, as prefill steps give
        torch.nn.functional.linear(torch.randn(m, 576, dtype=torch.bfloat16), w)
    print((libc.mallinfo2().uord - before) / 2**20)
    """)


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def test_a_users_value_is_kept_and_unset_ones_are_bounded(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert bound_onednn_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CACHE_CAPACITY), "LRU_CACHE_CAPACITY": "7"}
    with pytest.raises(ValueError, match="capacity"):
        bound_onednn_caches(-1)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="measures the heap with glibc's mallinfo2")
def test_bounded_caches_stop_the_heap_growing_with_new_shapes():
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    grew = {how: float(subprocess.run([sys.executable, "-c", _PROBE, how], env=env, capture_output=True, text=True,
                                      check=True, timeout=300).stdout.split()[-1]) for how in ("default", "bounded")}
    # here (AVX-512 BF16): ~208 MiB with the defaults (1024 entries each), ~16 MiB bounded (64)
    if grew["default"] <= 60:
        pytest.skip(f"this CPU's bf16 GEMM does not keep oneDNN primitives per shape ({grew})")
    assert grew["bounded"] < 40, grew
