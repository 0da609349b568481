"""liteturbo's C++ CPU kernels (``backends/csrc/*.cpp``), compiled at first use with torch's ``cpp_extension``:
W4A16 kernels (a few rows and many rows over one packed weight; the routed experts of a MoE layer in one call,
gate/up SiLU fused, and its routing), a weight-only int8 GEMV (the lm_head of decode steps), fused RMSNorm /
residual-add + RMSNorm / SiLU-and-mul / rotary, and paged attention (prefill and decode
rows through the block tables) over a 16/32-bit KV cache.

The build uses the machine's compiler with ``-O3 -march=native`` (AVX-512 BF16 where the CPU has it, else what the
compiler vectorizes for the CPU: AVX2 on most x86 machines) and is cached under ``$LITETURBO_HOME/torch_ext/``
keyed by the sources, the flags, torch's version and the CPU's flags, so a later process loads it in milliseconds.
When compiling is impossible (no compiler, no ninja, a failed build) :func:`load` warns once and returns ``None``,
and the torch backend keeps its pure-torch kernels. ``LITETURBO_CPU_EXT=0`` turns the extension off.

:func:`pack_w4_tiles` builds the weight layout the W4A16 kernels read (see ``backends/csrc/w4a16_gemm_cpu.cpp``);
:func:`unpack_nibbles_t` unpacks int32-packed 4-bit checkpoints (AWQ) to codes; both in one parallel pass of
``backends/csrc/w4_pack_cpu.cpp`` where the extension is ready (:func:`ready`: loaded or cached, never compiled for
them), else with torch ops.
"""
from __future__ import annotations

import hashlib
import os
import platform as _pyplatform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from .platform import liteturbo_home

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "ext.cpp", _CSRC / "w4a16_gemm_cpu.cpp", _CSRC / "w4_pack_cpu.cpp", _CSRC / "w8a16_gemv_cpu.cpp",
            _CSRC / "ops_cpu.cpp", _CSRC / "attention_cpu.cpp", _CSRC / "moe_cpu.cpp", _CSRC / "moe_route_cpu.cpp"]
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
    return _pyplatform.processor() or _pyplatform.machine()


def build_dir() -> Path:
    """Where the compiled extension is cached for this source, flags, torch version and CPU."""
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in _SOURCES + _HEADERS), " ".join(_FLAGS).encode(),
                                     torch.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return liteturbo_home() / "torch_ext" / f"liteturbo_cpu_{key}"


def load():
    """The compiled module, or ``None`` when disabled or when it cannot be built here (warned once, with the reason
    and the fallback). Functions: ``w4a16_tiles_gemv``, ``w4a16_tiles_mm``, ``has_w4_tiles``
    (``csrc/w4a16_gemm_cpu.cpp``); ``w4a16_experts_mm``, ``w4a16_moe``, ``has_w4_experts`` (``csrc/moe_cpu.cpp``: the
    experts of one MoE layer stacked in that layout, ``[E, N/32, K/4, 64]``); ``moe_route`` (``csrc/moe_route_cpu.cpp``:
    router logits, softmax, top-k); ``unpack_nibbles_t``, ``pack_w4_tiles_codes``
    (``csrc/w4_pack_cpu.cpp``);
    ``w8a16_gemv``, ``has_w8_gemv`` (``csrc/w8a16_gemv_cpu.cpp``); ``rms_norm``,
    ``add_rms_norm``, ``silu_and_mul``, ``rotary``, ``rotary_kv_write`` (``csrc/ops_cpu.cpp``); ``paged_attention``
    (``csrc/attention_cpu.cpp``).

    The first build on a machine says so on stderr (it takes ~25-60 s). A cached ``.so`` that is not a shared
    library (truncated, overwritten) is deleted first, so that the build relinks it (a few seconds)."""
    if not enabled():
        return None
    with _lock:
        if "module" in _state:
            return _state["module"]
        module, d = None, None
        try:
            d = build_dir()
            module = _build(d)
        except Exception as e:  # no compiler / ninja, a failed build: keep the torch kernels
            where = f" (build folder {d}; delete it to retry)" if d is not None else ""
            warnings.warn(f"liteturbo: cannot build or load the C++ CPU kernels ({_last_line(e)}){where}; using the "
                          f"pure-torch kernels (slower on CPU). A compiler problem: install g++ and `pip install "
                          f"ninja`; set LITETURBO_CPU_EXT=0 to silence this.", RuntimeWarning, stacklevel=2)
            module = None
        _state["module"] = module
        return module


def ready():
    """The compiled module when it is loaded in this process or cached for this machine (loads in milliseconds),
    else ``None``: never compiles. For load-time helpers (repacking) that have a torch fallback and must not make a
    ``lite`` command wait for a first build."""
    if not enabled():
        return None
    if "module" in _state:
        return _state["module"]
    if _state.get("not_built"):  # hashing the sources once per process, not once per weight of a load
        return None
    try:
        if _built(build_dir()):
            return load()
    except Exception:
        return None
    _state["not_built"] = True  # until load() builds it in this process (then "module" answers first)
    return None


def unpack_nibbles_t(packed: torch.Tensor, order) -> torch.Tensor | None:
    """int32 ``[R, C]`` words of 8 nibbles → uint8 codes ``[C*8, R]`` (the unpacked matrix transposed), column
    ``c*8 + j`` from nibble position ``order[j]`` of word ``c``, in one parallel C++ pass; ``None`` where the
    extension is not ready (the caller keeps its torch path)."""
    ext = ready()
    if ext is None or packed.device.type != "cpu" or packed.dtype != torch.int32 or packed.dim() != 2:
        return None
    return ext.unpack_nibbles_t(packed, torch.as_tensor(list(order), dtype=torch.int64))


def status() -> str:
    """What the torch backend gets on this machine, without building anything: ``"off"`` (LITETURBO_CPU_EXT=0),
    ``"loaded"`` / ``"failed"`` (tried in this process), ``"built"`` (cached for this source, torch and CPU: loads at
    once), ``"not built yet"`` (compiles at the first engine start)."""
    if not enabled():
        return "off"
    if "module" in _state:
        return "loaded" if _state["module"] is not None else "failed"
    try:
        return "built" if _built(build_dir()) else "not built yet"
    except Exception:
        return "not built yet"


def _last_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[-1][:300] if msg else type(e).__name__


def _module_name(d: Path) -> str:
    return f"liteturbo_cpu_{d.name.rsplit('_', 1)[-1]}"


def _built(d: Path) -> bool:
    return (d / f"{_module_name(d)}.so").exists()


def _build(d: Path):
    from torch.utils.cpp_extension import load as cpp_load

    so = d / f"{_module_name(d)}.so"
    if so.exists():
        with open(so, "rb") as f:
            head = f.read(4)
        if head != b"\x7fELF":
            print(f"liteturbo: the cached C++ CPU kernels {so} are damaged ({so.stat().st_size} bytes, not a shared "
                  f"library); rebuilding", file=sys.stderr, flush=True)
            so.unlink()
    fresh = not _built(d)
    d.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(d)
    if fresh:
        print("liteturbo: compiling the C++ CPU kernels (once per machine, ~25-60 s) ...", file=sys.stderr, flush=True)
    return cpp_load(name=_module_name(d), sources=[str(p) for p in _SOURCES], extra_cflags=_FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(d), verbose=False)


STALE_LOCK_SECONDS = 180


def _clear_stale_lock(d: Path, poll_seconds: float = 1.0) -> None:
    """torch's builder waits on ``<build dir>/lock`` while another process compiles, with no time limit; a build
    killed midway (Ctrl-C) leaves the lock behind and every later start would wait forever. This waits (saying so on
    stderr) while the lock is younger than :data:`STALE_LOCK_SECONDS` (a build takes under a minute) and removes it,
    with a warning, once it is older."""
    lock = d / "lock"
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            warnings.warn(f"liteturbo: removing a stale build lock {lock} ({age / 60:.0f} minutes old; an interrupted "
                          f"build) before compiling the C++ CPU kernels", RuntimeWarning, stacklevel=3)
            lock.unlink(missing_ok=True)
            return
        if not said:
            print(f"liteturbo: waiting for another process's build of the C++ CPU kernels (lock {lock}, {age:.0f} s "
                  f"old; if no other liteturbo process is starting, an interrupted build left it: delete it, or it is "
                  f"removed when {STALE_LOCK_SECONDS} s old)", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_seconds)


def w4_tiles_expected() -> bool:
    """Whether the W4A16 kernels (``has_w4_tiles``) are expected here, without building anything: the extension is
    not turned off, has not failed in this process, and the CPU has AVX-512 F/BW/BF16 (what ``-march=native``
    needs for them). The planner sizes bf16 4-bit weights by it."""
    if not enabled() or ("module" in _state and _state["module"] is None):
        return False
    if _state.get("module") is not None:
        return bool(_state["module"].has_w4_tiles())
    flags = set(_cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512_bf16"} <= flags


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
    ext = ready()
    if ext is not None and codes.device.type == "cpu":  # one parallel pass (csrc/w4_pack_cpu.cpp)
        packed = ext.pack_w4_tiles_codes(codes.to(torch.uint8))
    else:
        c = codes.to(torch.uint8).view(n // 32, 2, 16, k // 4, 2, 2)  # [block, sub-block, channel, quad, high, pair]
        packed = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 3, 1, 2, 4).reshape(n // 32, k // 4, 64).contiguous()

    def lanes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[N, G]`` → ``[N/32, G, 2, 16]`` (per channel block and group, the two sub-blocks' 16 channels)."""
        return t.to(dtype).view(n // 32, 2, 16, g).permute(0, 3, 1, 2).contiguous()
    return packed, lanes(zeros, torch.int16), lanes(scales, torch.bfloat16)
