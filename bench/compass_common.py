"""What both processes of the GPU harness (bench/gpu_compass.py) share: the section table, the real and dry-run
shapes, the results file (one JSON object per line, appended and flushed), errors, the status file, and small
helpers for processes, the profiler trace and pytest's summary.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MIB = 1 << 20

# name, what it measures, minimum seconds at --budget-s 450 (scaled with the budget), share of the time left on the
# GPU, and in the dry run (where the interpreter makes the engine sections relatively slower)
SECTIONS = [
    ("env", "environment and ceilings", 5, 3, 2),
    ("w4a16", "W4A16 linear vs cuBLAS / dequant+matmul / torch int4", 20, 25, 18),
    ("attention", "paged decode attention, KV bf16/int8/int4", 15, 13, 16),
    ("check", "float64 check of what was timed", 3, 3, 3),
    ("checkpoint", "random 8B-shaped AWQ checkpoint: build and load", 15, 13, 8),
    ("decode", "engine decode: batch 1 and 32x(128+128)", 15, 20, 20),
    ("logits", "GPU vs CPU float32 log-probabilities", 8, 6, 15),
    ("tests", "GPU-relevant tests (pytest-xdist)", 20, 17, 10),
]
NAMES = [s[0] for s in SECTIONS]
TEST_FILES = ["tests/test_triton_kernels.py", "tests/test_triton_w4a16.py", "tests/test_triton_attention.py",
              "tests/test_triton_rotary.py",
              "tests/test_triton_engine.py", "tests/test_cuda_graphs.py", "tests/test_kernels.py",
              "tests/test_platform.py"]

# --- shapes: the real run (Llama-3-8B) and the dry run -----------------------------------------------------------
REAL = dict(
    w4_shapes=[("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    w4_ms=(1, 2, 4, 8, 16, 32), w4_dtypes=("bfloat16", "float16"), group=128, min_copies=2, max_copies=64,
    graph_ops=64, reps=5,
    att=dict(ctx=4096, batches=(1, 2, 4, 8, 16, 32), layers=32, heads=32, kv_heads=8, head_dim=128, block=64),
    kv_dtypes=("bfloat16", "int4", "int8"),
    model=dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, group=128),
    model_dtype="bfloat16", probe_vocab=8192, vocab_extra_s=5.0,
    decode=dict(prompt=128, new=128, requests=32, prof_short=4, prof_long=16, warm_new=4), logits_tokens=(24, 8),
    decode_kv=("auto", "int4", "int8"),
    tiny=dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=512, group=128),
    xdist_workers=8, test_timeout=300,
)
DRY = dict(
    w4_shapes=[("qkv", 256, 384), ("down", 512, 256)],
    w4_ms=(1, 32), w4_dtypes=("bfloat16", "float16"), group=128, min_copies=2, max_copies=2,
    graph_ops=2, reps=1,
    # one layer, 40 tokens (3 blocks, the last partial): the interpreter spends ~10 ms per program of the quantizing KV write
    att=dict(ctx=40, batches=(1, 2), layers=1, heads=4, kv_heads=2, head_dim=64, block=16),
    kv_dtypes=("bfloat16", "int4", "int8"),
    # float32 here: the interpreter emulates bf16 slowly; the harness's code path is the same
    model=dict(hidden=128, inter=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=256, group=128),
    model_dtype="float32", probe_vocab=256, vocab_extra_s=0.0,
    decode=dict(prompt=4, new=2, requests=2, prof_short=1, prof_long=2, warm_new=1), logits_tokens=(8, 4),
    decode_kv=("auto", "int4"),
    tiny=dict(hidden=128, inter=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=256, group=128),
    xdist_workers=2, test_timeout=120,
)


# =================================================================================================================
# rows
# =================================================================================================================
def _clean(v):
    """JSON-safe value: non-finite floats → None, tensors/others → str, containers recursively."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    try:
        f = float(v)  # numpy / torch scalars
        return f if math.isfinite(f) else None
    except (TypeError, ValueError):
        return str(v)


def write_row(path: Path, t0: float, section: str, **fields) -> dict:
    """Append one row (one ``os.write`` of one line, so rows of two processes never interleave)."""
    row = {"section": section, "t": round(time.time() - t0, 2), **_clean(fields)}
    line = json.dumps(row, ensure_ascii=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return row


def read_rows(path: Path) -> list[dict]:
    """Rows of this run in ``results.jsonl``: those after the last ``run``/``start`` row (a file that already held
    an earlier run keeps it above); a damaged line is kept as an error row."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                row = {"section": "?", "error": f"unreadable row: {line[:200]}"}
            if row.get("section") == "run" and row.get("kind") == "start":
                rows = []
            rows.append(row)
    return rows


def err_text(e: BaseException) -> str:
    """An exception as one short line (type and message, at most 400 characters) for a results row."""
    return f"{type(e).__name__}: {str(e).strip()[:400]}"


class StickyCudaError(RuntimeError):
    """The GPU no longer answers (a sticky CUDA error): the process must end."""


# =================================================================================================================
# helpers shared by both processes
# =================================================================================================================
def log(msg: str) -> None:
    """A progress line on stderr (run.log), flushed."""
    print(msg, file=sys.stderr, flush=True)


def importable(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def inject_fault(section: str) -> None:
    """``GPU_COMPASS_FAULT=SECTION:KIND`` (raise, crash, hang, sticky): test the harness's own robustness."""
    spec = os.environ.get("GPU_COMPASS_FAULT", "")
    for item in spec.split(","):
        if ":" not in item:
            continue
        name, kind = item.split(":", 1)
        if name != section:
            continue
        if kind == "raise":
            raise RuntimeError(f"injected fault in {section}")
        if kind == "crash":
            os._exit(3)
        if kind == "hang":
            time.sleep(10 ** 6)
        if kind == "sticky":
            raise StickyCudaError(f"injected sticky CUDA error in {section}")


def write_status(work: Path, st: dict) -> None:
    """The child's progress (current section, its start) for the parent, replaced atomically."""
    tmp = work / "status.json.tmp"
    tmp.write_text(json.dumps(st))
    os.replace(tmp, work / "status.json")


def read_status(work: Path) -> dict:
    """What :func:`write_status` last wrote, ``{}`` when nothing (readable) is there yet."""
    try:
        return json.loads((work / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def kill_group(pgid: int) -> None:
    """End a process group this harness started (its own child and what that child started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(1.0)


def step_count(eng) -> int | None:
    """The engine's step counter (``stats()["steps"]``), or None if it has none."""
    try:
        v = eng.stats().get("steps")
        return int(v) if v is not None else None
    except Exception:  # noqa: BLE001
        return None


def gpu_busy(trace: Path) -> tuple[float, int]:
    """Seconds during which the GPU ran kernels, copies or memsets (union of intervals), and the kernel count,
    from a chrome trace of torch.profiler."""
    ev = json.loads(trace.read_text()).get("traceEvents", [])
    spans, kernels = [], 0
    for e in ev:
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") == "X" and cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
            kernels += cat == "kernel"
    spans.sort()
    busy, end = 0.0, -1e30
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1e6, kernels


def pytest_summary(text: str) -> str:
    for line in reversed(text.splitlines()):
        s = line.strip().strip("=").strip()
        if re.search(r"\d+ (passed|failed|errors?|skipped|tests? collected|deselected)|no tests ran", s):
            return s[:300]
    return (text.strip().splitlines() or ["(no output)"])[-1][:300]


# =================================================================================================================
# the compass table
# =================================================================================================================
