"""liteturbo's C++ CPU kernels (``backends/csrc/*.cpp``), compiled at first use with torch's ``cpp_extension``:
a W4A16 GEMM, fused RMSNorm / residual-add + RMSNorm / SiLU-and-mul / rotary, and paged attention (prefill and decode
rows through the block tables) over a 16/32-bit KV cache.

The build uses the machine's compiler with ``-O3 -march=native`` (AVX-512 BF16 where the CPU has it, else what the
compiler vectorizes for the CPU: AVX2 on most x86 machines) and is cached under ``$LITETURBO_HOME/torch_ext/``
keyed by the sources, the flags, torch's version and the CPU's flags, so a later process loads it in milliseconds.
When compiling is impossible (no compiler, no ninja, a failed build) :func:`load` warns once and returns ``None``,
and the torch backend keeps its pure-torch kernels. ``LITETURBO_CPU_EXT=0`` turns the extension off.

:func:`pack_w4_tiles` builds the weight layout the W4A16 GEMM reads (see ``backends/csrc/w4a16_gemm_cpu.cpp``).
"""
from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "ext.cpp", _CSRC / "w4a16_gemm_cpu.cpp", _CSRC / "ops_cpu.cpp", _CSRC / "attention_cpu.cpp"]
_HEADERS = [_CSRC / "avx512_math.h"]  # part of the cache key, not compiled on their own
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]  # no FMA contraction: round as torch does
_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    """False when ``LITETURBO_CPU_EXT`` is ``0``/``false``/``off``."""
    return os.environ.get("LITETURBO_CPU_EXT", "1").strip().lower() not in ("0", "false", "off", "no")


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_dir() -> Path:
    """Where the compiled extension is cached for this source, flags, torch version and CPU."""
    from lite.formats.checkpoint import liteturbo_home

    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in _SOURCES + _HEADERS), " ".join(_FLAGS).encode(),
                                     torch.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return liteturbo_home() / "torch_ext" / f"liteturbo_cpu_{key}"


def load():
    """The compiled module, or ``None`` when disabled or when it cannot be built here (warned once, with the reason
    and the fallback). Functions: ``w4a16_tiles_mm``, ``has_w4_tiles`` (``csrc/w4a16_gemm_cpu.cpp``); ``rms_norm``,
    ``add_rms_norm``, ``silu_and_mul``, ``rotary`` (``csrc/ops_cpu.cpp``); ``paged_attention``
    (``csrc/attention_cpu.cpp``)."""
    if not enabled():
        return None
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        try:
            from torch.utils.cpp_extension import load as cpp_load

            d = build_dir()
            d.mkdir(parents=True, exist_ok=True)
            _clear_stale_lock(d)
            module = cpp_load(name=f"liteturbo_cpu_{d.name.rsplit('_', 1)[-1]}", sources=[str(p) for p in _SOURCES],
                              extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(d), verbose=False)
        except Exception as e:  # no compiler / ninja, a failed build: keep the torch kernels
            msg = str(e).strip().splitlines()
            warnings.warn(f"liteturbo: cannot compile the C++ CPU kernels ({msg[-1][:300] if msg else type(e).__name__}); "
                          f"using the pure-torch kernels (slower W4A16 on CPU). Install a C++ compiler and "
                          f"`pip install ninja`, or set LITETURBO_CPU_EXT=0 to silence this.", RuntimeWarning,
                          stacklevel=2)
            module = None
        _state["module"] = module
        return module


STALE_LOCK_SECONDS = 600


def _clear_stale_lock(d: Path) -> None:
    """torch's builder waits on ``<build dir>/lock`` while another process compiles; a build killed midway (Ctrl-C)
    leaves it behind and every later start would wait forever. A lock older than :data:`STALE_LOCK_SECONDS` (a build
    takes well under a minute) is removed, with a warning."""
    import time

    lock = d / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"liteturbo: removing a stale build lock {lock} ({age / 60:.0f} minutes old; an interrupted "
                      f"build) before compiling the C++ CPU kernels", RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


def pack_w4_tiles(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                             torch.Tensor]:
    """The layout of ``w4a16_tiles_mm`` (``backends/csrc/w4a16_gemm_cpu.cpp``) from uint8 codes ``[N, K]`` in
    ``[0, 16)``, integer zero points ``[N, G]`` and scales ``[N, G]`` (``N`` a multiple of 32, ``K`` of 4):
    ``(packed uint8 [N/32, K/4, 64], zeros int16 [N/32, G, 2, 16], scales bfloat16 [N/32, G, 2, 16])``: half a byte
    per weight plus 4 bytes per group and output channel."""
    n, k = codes.shape
    if n % 32 or k % 4:
        raise ValueError(f"the tiled W4A16 layout needs out_features % 32 == 0 and in_features % 4 == 0, got {n}x{k}")
    g = zeros.shape[1]
    c = codes.to(torch.uint8).view(n // 32, 2, 16, k // 4, 2, 2)  # [block, sub-block, channel, quad, high, pair]
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 3, 1, 2, 4).reshape(n // 32, k // 4, 64).contiguous()

    def lanes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).view(n // 32, 2, 16, g).permute(0, 3, 1, 2).contiguous()
    return packed, lanes(zeros, torch.int16), lanes(scales, torch.bfloat16)
