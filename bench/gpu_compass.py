"""The one GPU call: every number liteturbo needs from a lent GPU, in priority order, within one deadline.

The command for the device tool (one call, at most 10 minutes; the harness stops itself after ``--budget-s``)::

    python bench/gpu_compass.py --out $OUT --budget-s 450          (run with timeout_s 560)

Rehearsal on a CPU (Triton's interpreter, tiny shapes, wall clocks; what the test suite runs)::

    python bench/gpu_compass.py --dry-run --out DIR                 (default budget 120 s)

Sections, in priority order (each gets a share of the time left; one that cannot get its minimum is skipped
with the reason; an exception inside one is recorded with its traceback and the run goes on):

1. ``env``: torch / triton / CUDA versions, device, SMs, L2; device-to-device copy bandwidth of a 2 GiB buffer
   (read + write bytes, CUDA events) and a bf16 dense matmul's TFLOP/s: the ceilings of the table.
2. ``w4a16``: the backend's W4A16 linear (``get_backend("triton", "cuda")``, ``prepare_w4a16`` /
   ``w4a16_linear``) at M = 1, 2, 4, 8, 16, 32 on Llama-3-8B's fused shapes (qkv 4096→6144, o 4096→4096,
   gate_up 4096→28672, down 14336→4096), bf16 and fp16, group size 128, beside cuBLAS 16-bit (``F.linear`` on the
   dequantized weight), the backend's dequantize + matmul path (``dequant_min_rows=1``) and torch's int4 kernel
   (``aten._weight_int4pack_mm``). Timed inside CUDA graphs of many calls over enough distinct weight copies
   that the weights exceed 4x the L2 (so they stream from HBM); compilation and warm-up are outside the timed
   region. GB/s are of the 4-bit weight bytes (N*K/2).
3. ``attention``: the backend's paged attention (``allocate_kv_cache``, ``KVCacheSpec``, ``attention`` with
   ``AttentionMetadata``) for decode at 4k context, batch 1-32, KV bf16 / int8 / int4, 32 layers of cache
   (Llama-3-8B: 32 heads, 8 KV heads, head dim 128), one graph over the layers: token x KV-head per second,
   effective GB/s (K and V bytes with scales), int4 vs bf16.
4. ``check``: what sections 2 and 3 timed (the graphs' own outputs) against float64 references (dequantized
   weight; attention over the cache's stored keys and values): max relative error = max|y - ref| / max|ref|.
5. ``checkpoint``: a random Llama-3-8B-shaped AWQ GEMM g128 checkpoint (safetensors + config.json + a word-level
   tokenizer) written in seconds, then loaded with ``turbo.Engine`` (load time). Probe loads of 1 and 2 layers
   (after a first one that pays the imports) predict the full load; when 32 layers cannot load in the section's
   time, fewer are used (recorded).
6. ``decode``: batch 1 (128-token prompt, 128 new tokens) and 32 requests x (128 + 128), per KV dtype
   (bfloat16, int4, int8; a new Engine each): tokens/s, ms per step; GPU-busy ms vs wall ms per decode step
   (torch.profiler over two short runs, differenced) and the roofline (weight + KV bytes per step / copy
   bandwidth).
7. ``logits``: GPU (Triton backend, float32) vs CPU (torch backend, float32) log-probabilities of the same greedy
   tokens on two tiny models (dense, and W4A16): max abs difference.
8. ``tests``: the GPU-relevant test files with pytest-xdist (``-n 8 --timeout``), log in ``tests.log``.

Output (``--out DIR``, default ``$OUT`` or ``./gpu_results``): ``results.jsonl`` (one JSON object per line,
appended and flushed as measured: ``section`` plus numbers, or ``skipped`` with the reason, or ``error`` with a
traceback), ``compass.txt`` (the table printed last: each number beside its ceiling / baseline and the ratio),
``tests.log`` and ``run.log`` (the sections' own output): 4 files.

Robustness: the sections run in a child process; the parent (which never touches the GPU) watches each
section's time and, when the child hangs, dies, or leaves the GPU unusable (a sticky CUDA error such as an
illegal address), ends it, records the error and starts a fresh child at the next section. Nothing here is
installed: the GPU machine has torch, triton, transformers, safetensors, pytest, pytest-xdist, pytest-timeout;
the repository root is put on ``sys.path``. ``GPU_COMPASS_FAULT=SECTION:raise|crash|hang|sticky`` injects a
failure into a section (for testing the harness itself).
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
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
    return f"{type(e).__name__}: {str(e).strip()[:400]}"


# =================================================================================================================
# the child: runs sections in order, from --start
# =================================================================================================================
class StickyCudaError(RuntimeError):
    """The GPU no longer answers (a sticky CUDA error): the process must end."""


class Child:
    def __init__(self, args) -> None:
        self.args, self.dry = args, args.dry_run
        self.out, self.work = Path(args.out), Path(args.work)
        self.rows_path = self.out / "results.jsonl"
        self.t0, self.deadline = args.t0, args.deadline
        self.cfg = DRY if self.dry else REAL
        import torch

        self.torch = torch
        self.cuda = (not self.dry) and torch.cuda.is_available()
        self.dev = "cuda" if self.cuda else "cpu"
        self.section = "?"
        self.sec_deadline = self.deadline
        self.state: dict = {}
        self.ceil = self._ceilings_from_rows()

    # --- rows and time ------------------------------------------------------------------------------------------
    def row(self, **fields) -> dict:
        r = write_row(self.rows_path, self.t0, self.section, **fields)
        log(f"[{self.section}] " + json.dumps({k: v for k, v in r.items() if k not in ("traceback",)})[:400])
        return r

    def left(self) -> float:
        """Seconds left in the current section."""
        return self.sec_deadline - time.time()

    def _ceilings_from_rows(self) -> dict:
        ceil = {}
        for r in read_rows(self.rows_path):
            if r.get("section") == "env":
                for k in ("copy_gbps", "l2_bytes", "sms", "matmul_tflops"):
                    if r.get(k) is not None:
                        ceil[k] = r[k]
        return ceil

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def healthy(self) -> bool:
        """Whether the device still runs work (False after a sticky CUDA error)."""
        if not self.cuda:
            return True
        try:
            t = self.torch.ones(4, device="cuda")
            return float((t + 1).sum().item()) == 8.0
        except Exception:  # noqa: BLE001
            return False

    def free(self) -> None:

        gc.collect()
        if self.cuda:
            try:
                self.torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    # --- timing -------------------------------------------------------------------------------------------------
    def measure(self, fns: list, target_ops: int, reps: int) -> dict:
        """Time one call of each of ``fns`` (the same op over distinct weight copies), called in turn.

        GPU: all warmed up (compiled) first, then a CUDA graph of >= ``target_ops`` calls replayed ``reps`` times
        between CUDA events; if capture fails, the same calls eagerly between events (``graph_error`` says why).
        CPU: wall clock. Returns ``us`` per call, ``timing``, ``ops`` timed, and ``out`` (fns[0]'s output from the
        timed run: what the float64 check compares)."""
        torch = self.torch
        outs = [f() for f in fns]  # compile + warm-up, outside the timed region
        self.sync()
        seq = fns * max(1, math.ceil(target_ops / len(fns)))
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(reps):
                outs = [f() for f in seq]
            dt = time.perf_counter() - t
            return dict(us=dt * 1e6 / (reps * len(seq)), timing="wall (no CUDA)", ops=reps * len(seq), out=outs[0],
                        graph="skipped: no CUDA (dry run)")
        graph_error = None
        if not self.args.no_graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for f in fns:
                        f()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    gouts = [f() for f in seq]
                g.replay()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(reps):
                    g.replay()
                e1.record()
                e1.synchronize()
                ms = e0.elapsed_time(e1)
                out = gouts[0].clone()
                del g, gouts
                return dict(us=ms * 1e3 / (reps * len(seq)), timing="cuda_graph", ops=reps * len(seq), out=out)
            except Exception as e:  # noqa: BLE001
                graph_error = err_text(e)
                if not self.healthy():
                    raise StickyCudaError(f"CUDA graph capture left the GPU unusable: {graph_error}") from e
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            outs = [f() for f in seq]
        e1.record()
        e1.synchronize()
        ms = e0.elapsed_time(e1)
        return dict(us=ms * 1e3 / (reps * len(seq)), timing="cuda_events (eager)", ops=reps * len(seq), out=outs[0],
                    graph_error=graph_error or "off (--no-graphs)")

    # --- the loop -----------------------------------------------------------------------------------------------
    def run(self, start: int, only: list[str]) -> int:
        total_budget = self.args.budget_s
        scale = total_budget / 450.0
        todo = [i for i in range(start, len(SECTIONS)) if SECTIONS[i][0] in only]
        col = 4 if self.dry else 3
        for n, i in enumerate(todo):
            name, title, need = SECTIONS[i][:3]
            share = SECTIONS[i][col]
            self.section = name
            now = time.time()
            rem = self.deadline - now
            need_s = need * scale
            shares = sum(SECTIONS[j][col] for j in todo[n:])
            soft = rem * share / shares
            if name == "tests":
                soft = rem  # the last section gets what is left
            soft = max(soft, min(need_s, rem))
            grace = max(8.0, 0.06 * total_budget)
            self.sec_deadline = now + soft
            write_status(self.work, dict(index=i, name=name, start=now, soft_deadline=now + soft,
                                         hard_deadline=now + soft + grace, pid=os.getpid()))
            if rem < need_s:
                self.row(skipped=f"{rem:.0f} s left of the global budget, the section needs at least {need_s:.0f} s")
                continue
            log(f"=== section {name} ({title}): {soft:.0f} s of {rem:.0f} s left")
            t = time.time()
            try:
                inject_fault(name)
                getattr(self, "sec_" + name)()
            except StickyCudaError as e:
                self.row(error=str(e)[:600], traceback=traceback.format_exc()[-4000:], fatal=True)
                return 75
            except Exception as e:  # noqa: BLE001
                self.row(error=err_text(e), traceback=traceback.format_exc()[-4000:])
                if not self.healthy():
                    self.row(error="the GPU no longer runs work after this error (sticky CUDA error); a fresh process "
                                   "takes the next section", fatal=True)
                    return 75
            log(f"=== section {name} done in {time.time() - t:.1f} s")
            self.free()
        return 0

    # =============================================================================================================
    # 1. environment and ceilings
    # =============================================================================================================
    def sec_env(self) -> None:
        torch = self.torch
        info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                    dry_run=self.dry, device=self.dev)
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001
            info["triton"] = f"not importable: {err_text(e)}"
        try:
            import transformers

            info["transformers"] = transformers.__version__
        except Exception as e:  # noqa: BLE001
            info["transformers"] = f"not importable: {err_text(e)}"
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
        for mod in ("xdist", "pytest_timeout"):
            info["has_" + mod] = _importable(mod)
        if self.cuda:
            p = torch.cuda.get_device_properties(0)
            info.update(device_name=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                        total_mem_gib=round(p.total_memory / GIB, 1))
            l2 = getattr(p, "L2_cache_size", None) or getattr(p, "l2_cache_size", None)
            info["l2_bytes"] = int(l2) if l2 else 60 * MIB
            info["l2_source"] = "device properties" if l2 else "assumed (H200: 60 MB)"
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
                info["nvidia_smi"] = q.stdout.strip()[:200]
            except Exception as e:  # noqa: BLE001
                info["nvidia_smi"] = err_text(e)
        else:
            info.update(device_name="cpu", sms=os.cpu_count(), l2_bytes=None)
        self.row(kind="info", **info)
        self.ceil.update(l2_bytes=info.get("l2_bytes"), sms=info.get("sms"))
        # copy bandwidth: read + write bytes per second of one large copy
        nbytes = 2 * GIB if self.cuda else 64 * MIB
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        src.fill_(1)
        dst = torch.empty_like(src)
        reps = 10 if self.cuda else 5
        r = self._time_op(lambda: dst.copy_(src), reps)
        gbps = 2 * nbytes / (r / 1e6) / 1e9
        self.ceil["copy_gbps"] = gbps
        self.row(kind="copy", bytes=nbytes, us=r, copy_gbps=gbps, timing="cuda_events" if self.cuda else "wall",
                 note="read+write bytes / time")
        src = dst = None  # noqa: F841
        self.free()
        # dense 16-bit matmul
        n = 8192 if self.cuda else 512
        dt = torch.bfloat16 if self.cuda else torch.float32
        a = torch.randn(n, n, dtype=dt, device=self.dev)
        b = torch.randn(n, n, dtype=dt, device=self.dev)
        us = self._time_op(lambda: a @ b, 10 if self.cuda else 3)
        tf = 2 * n ** 3 / (us / 1e6) / 1e12
        self.ceil["matmul_tflops"] = tf
        self.row(kind="matmul", n=n, dtype=str(dt).replace("torch.", ""), us=us, matmul_tflops=tf)

    def _time_op(self, fn, reps: int) -> float:
        """Microseconds per call of ``fn`` (eager; warmed up; CUDA events on GPU, wall clock on CPU)."""
        fn()
        self.sync()
        if self.cuda:
            e0, e1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) * 1e3 / reps
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e6 / reps

    # =============================================================================================================
    # 2. W4A16
    # =============================================================================================================
    def _rand_qw(self, n: int, k: int, gs: int, gen):
        """A random 4-bit weight (codes, zero points) with scales exact in both bf16 and fp16."""
        torch = self.torch
        from backends import QuantizedWeight

        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=self.dev, generator=gen)
        zeros = torch.randint(0, 16, (k // gs, n), dtype=torch.uint8, device=self.dev, generator=gen)
        scales = (torch.rand(k // gs, n, device=self.dev, generator=gen) * 2e-3 + 2e-3).to(torch.bfloat16).to(torch.float16)
        return QuantizedWeight(bits=4, group_size=gs, sym=False, qweight=codes, qzeros=zeros, scales=scales)

    def _copies(self, nbytes: int) -> int:
        c = self.cfg
        l2 = self.ceil.get("l2_bytes") or 60 * MIB
        if not self.cuda:
            return c["min_copies"]
        return int(min(c["max_copies"], max(c["min_copies"], math.ceil(4 * l2 / nbytes))))

    def sec_w4a16(self) -> None:
        torch = self.torch
        from backends import get_backend

        c = self.cfg
        gs = c["group"]
        b = get_backend("triton", self.dev)
        try:
            bdq = get_backend("triton", self.dev, dequant_min_rows=1)
            dq_why = None
        except Exception as e:  # noqa: BLE001
            bdq, dq_why = None, f"the triton backend takes no dequant_min_rows=1 ({err_text(e)})"
        int4 = self._torch_int4_ops()
        copy_gbps = self.ceil.get("copy_gbps")
        gen = torch.Generator(device=self.dev).manual_seed(0)
        blocks = [(dt, s) for dt in c["w4_dtypes"] for s in c["w4_shapes"]]
        weights: dict = {}  # shape name -> list of QuantizedWeight copies (shared by both dtypes)
        failed: dict = {}  # (impl, dtype, M) -> first error, so a broken kernel is not compiled again and again
        # the first block of each dtype compiles every M bucket: it gets a double share of the section's time
        weight = [2 if bi == 0 or blocks[bi - 1][0] != dt_ else 1 for bi, (dt_, _) in enumerate(blocks)]
        for bi, (dt_name, (sname, k, n)) in enumerate(blocks):
            dt = getattr(torch, dt_name)
            block_end = time.time() + self.left() * weight[bi] / sum(weight[bi:])
            w_bytes = n * k // 2
            ncopy = self._copies(w_bytes + (k // gs) * n * 3)
            base = dict(dtype=dt_name, shape=sname, K=k, N=n, group_size=gs)
            if self.left() < 2:
                self.row(**base, skipped="the section's time is spent")
                continue
            t = time.time()
            if sname not in weights:
                weights[sname] = [self._rand_qw(n, k, gs, gen) for _ in range(ncopy)]
                self._save_check("qw_" + sname, dict(qweight=weights[sname][0].qweight, qzeros=weights[sname][0].qzeros,
                                                     scales=weights[sname][0].scales, group_size=gs))
            qws = weights[sname]
            impls, handles, dqh, packs = {}, None, None, None
            tp = time.time()
            prep_note = None
            try:
                handles, prep_note = self._prepare(b, qws, dt)
                self.sync()
                prep_s = (time.time() - tp) / len(qws)
                impls["triton"] = [lambda h=h: b.w4a16_linear(self._x, h) for h in handles]
            except Exception as e:  # noqa: BLE001
                self.row(**base, impl="triton", error=f"prepare_w4a16: {err_text(e)}", traceback=traceback.format_exc()[-3000:])
                prep_s = None
            nd = self._copies(2 * n * k)
            dense = [q.dequantize(dt) for q in qws[:nd]]
            impls["cublas"] = [lambda w=w: torch.nn.functional.linear(self._x, w) for w in dense]
            if bdq is not None:
                try:
                    dqh = self._prepare(bdq, qws, dt)[0]
                    impls["dequant_mm"] = [lambda h=h: bdq.w4a16_linear(self._x, h) for h in dqh]
                except Exception as e:  # noqa: BLE001
                    self.row(**base, impl="dequant_mm", error=f"prepare_w4a16: {err_text(e)}")
            if int4 is not None:
                try:
                    packs = [int4["prep"](q, dt) for q in qws]
                    impls["torch_int4"] = [lambda p=p: int4["mm"](self._x, p, gs) for p in packs]
                except Exception as e:  # noqa: BLE001
                    self.row(**base, impl="torch_int4", skipped=f"torch's int4 kernel cannot take {dt_name} here: "
                                                                f"{err_text(e)}")
            self.row(**base, kind="setup", copies=ncopy, dense_copies=nd, weight_bytes=w_bytes,
                     bytes_all_copies=ncopy * w_bytes, prepare_s_per_weight=prep_s, prepare_note=prep_note,
                     setup_s=time.time() - t,
                     dequant_mm=dq_why or "backend(dequant_min_rows=1)",
                     torch_int4="aten._weight_int4pack_mm" if int4 is not None else self._int4_why)
            check = {}
            for m in c["w4_ms"]:
                self._x = torch.randn(m, k, dtype=dt, device=self.dev, generator=gen)
                outs = {}
                for impl, fns in impls.items():
                    if (m != c["w4_ms"][0] and time.time() > block_end) or self.left() < 1:
                        self.row(**base, M=m, impl=impl, skipped="this block's share of the section time is spent")
                        continue
                    if (impl, dt_name, m) in failed:
                        self.row(**base, M=m, impl=impl, skipped=f"failed at this dtype and M for another shape: "
                                                                 f"{failed[(impl, dt_name, m)]}")
                        continue
                    try:
                        r = self.measure(fns, c["graph_ops"], c["reps"])
                    except StickyCudaError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        failed[(impl, dt_name, m)] = err_text(e)[:200]
                        if impl == "torch_int4" and isinstance(e, (RuntimeError, NotImplementedError)):
                            self.row(**base, M=m, impl=impl, skipped=f"torch's int4 kernel failed: {err_text(e)}")
                        else:
                            self.row(**base, M=m, impl=impl, error=err_text(e), traceback=traceback.format_exc()[-3000:])
                        if not self.healthy():
                            raise StickyCudaError(f"{impl} {dt_name} {sname} M={m}: {err_text(e)}") from e
                        continue
                    nbytes = 2 * n * k if impl == "cublas" else w_bytes
                    gbps = nbytes / (r["us"] / 1e6) / 1e9
                    outs[impl] = r.pop("out")
                    self.row(**base, M=m, impl=impl, us=r["us"], gbps=gbps, bytes=nbytes,
                             frac_copy=gbps / copy_gbps if copy_gbps else None,
                             copies=len(fns), **{k_: v for k_, v in r.items() if k_ != "us"})
                if outs and (m == c["w4_ms"][0] or m == c["w4_ms"][-1]):
                    check[m] = dict(x=self._x, outs=outs)
            self._save_check(f"w4_{dt_name}_{sname}", dict(shape=sname, dtype=dt_name, K=k, N=n, cases=check))
            impls = dense = handles = dqh = packs = check = outs = None  # noqa: F841  (free before the next block)
            self._x = None
            if not any(s[0] == sname for _, s in blocks[bi + 1:]):  # the last block of this shape frees its copies
                weights.pop(sname, None)
            self.free()

    _int4_why = None

    def _prepare(self, backend, qws: list, dt) -> tuple[list, str | None]:
        """``backend.prepare_w4a16`` of every copy; weights on the device first, and if the backend refuses those,
        from CPU copies (what a checkpoint loader hands it)."""
        try:
            return [backend.prepare_w4a16(q, dt) for q in qws], None
        except Exception as e:  # noqa: BLE001
            if not self.cuda:
                raise
            first = err_text(e)
        from backends import QuantizedWeight

        out = []
        for q in qws:
            cq = QuantizedWeight(bits=q.bits, group_size=q.group_size, sym=q.sym, qweight=q.qweight.cpu(),
                                 qzeros=q.qzeros.cpu(), scales=q.scales.cpu())
            out.append(backend.prepare_w4a16(cq, dt))
        return out, f"prepared from CPU tensors (from device tensors: {first[:200]})"

    def _torch_int4_ops(self):
        """torch's own int4 (tinygemm) kernel: ``W = (q - 8) * s + z'`` with ``z' = (8 - zero) * s``."""
        torch = self.torch
        aten = torch.ops.aten
        if self.cuda:
            if not (hasattr(aten, "_convert_weight_to_int4pack") and hasattr(aten, "_weight_int4pack_mm")):
                self._int4_why = "this torch has no aten._weight_int4pack_mm"
                return None

            def prep(q, dt):
                codes = q.qweight
                packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()  # uint8 [N, K/2], even k high nibble
                w = aten._convert_weight_to_int4pack(packed, 8)
                s = q.scales.float()
                sz = torch.stack([s, (8.0 - q.qzeros.float()) * s], -1).to(dt).contiguous()
                return w, sz

            def mm(x, p, gs):
                return aten._weight_int4pack_mm(x, p[0], gs, p[1])
        else:
            if not (hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")):
                self._int4_why = "this torch has no aten._weight_int4pack_mm_for_cpu"
                return None

            def prep(q, dt):
                w = aten._convert_weight_to_int4pack_for_cpu(q.qweight.to(torch.int32).contiguous(), 8)
                s = q.scales.float()
                sz = torch.stack([s, (8.0 - q.qzeros.float()) * s], -1).to(dt).contiguous()
                return w, sz

            def mm(x, p, gs):
                return aten._weight_int4pack_mm_for_cpu(x, p[0], gs, p[1])
        return dict(prep=prep, mm=mm)

    def _save_check(self, name: str, obj: dict) -> None:
        """Material for the float64 check, kept on disk so that a fresh process can check it."""
        torch = self.torch

        def cpu(v):
            if isinstance(v, torch.Tensor):
                return v.detach().cpu()
            if isinstance(v, dict):
                return {k: cpu(x) for k, x in v.items()}
            return v

        torch.save(cpu(obj), self.work / f"check_{name}.pt")

    # =============================================================================================================
    # 3. attention
    # =============================================================================================================
    def sec_attention(self) -> None:
        torch = self.torch
        from backends import AttentionMetadata, KVCacheSpec, get_backend

        a = self.cfg["att"]
        b = get_backend("triton", self.dev)
        ctx, L, H, KVH, D, bs = a["ctx"], a["layers"], a["heads"], a["kv_heads"], a["head_dim"], a["block"]
        bmax = max(a["batches"])
        nb_seq = -(-ctx // bs)
        dt = torch.bfloat16
        scale = D ** -0.5
        copy_gbps = self.ceil.get("copy_gbps")
        gen = torch.Generator(device=self.dev).manual_seed(1)
        kvs = self.cfg["kv_dtypes"]
        for ki, kv in enumerate(kvs):
            base = dict(kv=kv, ctx=ctx, layers=L, heads=H, kv_heads=KVH, head_dim=D, block_size=bs)
            kv_end = time.time() + self.left() / (len(kvs) - ki)
            if self.left() < 2:
                self.row(**base, skipped="the section's time is spent")
                continue
            t = time.time()
            try:
                spec = KVCacheSpec(kv, bmax * nb_seq, bs, L, KVH, D)
                cache = b.allocate_kv_cache(spec, dt)
                perm = torch.randperm(bmax * nb_seq, generator=torch.Generator().manual_seed(2))
                tables = [perm[i * nb_seq:(i + 1) * nb_seq].tolist() for i in range(bmax)]
                slots = torch.cat([(torch.tensor(tb) * bs).unsqueeze(1).add(torch.arange(bs)).reshape(-1)[:ctx]
                                   for tb in tables]).to(self.dev)
                kk = torch.randn(slots.numel(), KVH, D, dtype=dt, device=self.dev, generator=gen)
                vv = torch.randn(slots.numel(), KVH, D, dtype=dt, device=self.dev, generator=gen)
                for layer in range(L):
                    cache.write(layer, kk, vv, slots)
                del kk, vv
                self.sync()
            except StickyCudaError:
                raise
            except Exception as e:  # noqa: BLE001
                self.row(**base, error=f"allocating / writing the cache: {err_text(e)}",
                         traceback=traceback.format_exc()[-3000:])
                if not self.healthy():
                    raise StickyCudaError(f"KV {kv} write: {err_text(e)}") from e
                continue
            self.row(**base, kind="setup", cache_gib=spec.total_bytes() / GIB, setup_s=time.time() - t,
                     bytes_per_token_head=spec.bytes_per_token_head())
            check = None
            for bi, bsz in enumerate(a["batches"]):
                if (bi and time.time() > kv_end) or self.left() < 1:  # the first batch size always, if time is left
                    self.row(**base, batch=bsz, skipped="this KV dtype's share of the section time is spent")
                    continue
                q = torch.randn(bsz, H, D, dtype=dt, device=self.dev, generator=gen)
                last = torch.tensor([tables[i][(ctx - 1) // bs] * bs + (ctx - 1) % bs for i in range(bsz)],
                                    dtype=torch.long, device=self.dev)
                meta = AttentionMetadata(slot_mapping=last, query_start=list(range(bsz + 1)), context_lens=[ctx] * bsz,
                                         block_tables=[tables[i] for i in range(bsz)], block_size=bs)
                fns = [lambda layer=layer: b.attention(q, cache, layer, meta, scale) for layer in range(L)]
                try:
                    r = self.measure(fns, max(self.cfg["graph_ops"], L), self.cfg["reps"])
                except StickyCudaError:
                    raise
                except Exception as e:  # noqa: BLE001
                    self.row(**base, batch=bsz, error=err_text(e), traceback=traceback.format_exc()[-3000:])
                    if not self.healthy():
                        raise StickyCudaError(f"attention KV {kv} batch {bsz}: {err_text(e)}") from e
                    break  # the other batch sizes would fail the same way
                nbytes = bsz * ctx * KVH * 2 * spec.bytes_per_token_head()
                out = r.pop("out")
                us = r.pop("us")
                gbps = nbytes / (us / 1e6) / 1e9
                self.row(**base, batch=bsz, us_per_layer=us, kv_bytes=nbytes, gbps=gbps,
                         token_heads_per_s=bsz * ctx * KVH / (us / 1e6),
                         frac_copy=gbps / copy_gbps if copy_gbps else None, **r)
                if check is None or bsz <= 2:
                    nchk = min(bsz, 2)
                    seqs = []
                    for i in range(nchk):
                        s_i = slots[i * ctx:(i + 1) * ctx]
                        k_i, v_i = cache.read(0, s_i)  # [ctx, KVH, D] float32: the stored values
                        seqs.append(dict(k=k_i, v=v_i))
                    check = dict(kv=kv, batch=bsz, q=q[:nchk], out=out[:nchk], seqs=seqs, scale=scale)
            if check is not None:
                self._save_check(f"att_{kv}", check)
            cache = None  # noqa: F841
            self.free()

    # =============================================================================================================
    # 4. float64 check
    # =============================================================================================================
    def sec_check(self) -> None:
        torch = self.torch
        from backends import QuantizedWeight

        tol = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}
        files = sorted(glob.glob(str(self.work / "check_w4_*.pt")))
        att_files = sorted(glob.glob(str(self.work / "check_att_*.pt")))
        if not files and not att_files:
            self.row(skipped="nothing was timed (the w4a16 and attention sections left no outputs)")
            return
        for f in files:
            if self.left() < 0.5:
                self.row(file=os.path.basename(f), skipped="the section's time is spent")
                continue
            blk = torch.load(f, weights_only=False)
            qd = torch.load(self.work / f"check_qw_{blk['shape']}.pt", weights_only=False)
            qw = QuantizedWeight(bits=4, group_size=qd["group_size"], sym=False, qweight=qd["qweight"].to(self.dev),
                                 qzeros=qd["qzeros"].to(self.dev), scales=qd["scales"].to(self.dev))
            w64 = qw.dequantize(torch.float64)
            for m, case in blk["cases"].items():
                ref = case["x"].to(self.dev).double() @ w64.t()
                den = ref.abs().max().item() or 1.0
                for impl, y in case["outs"].items():
                    y = y.to(self.dev).double()
                    e = (y - ref).abs().max().item() / den
                    finite = bool(torch.isfinite(y).all())
                    self.row(kind="w4a16", impl=impl, dtype=blk["dtype"], shape=blk["shape"], M=int(m),
                             max_rel_err=e if finite else None, finite=finite,
                             ok=finite and e < tol[blk["dtype"]], tol=tol[blk["dtype"]])
            del w64, qw
        for f in att_files:
            c = torch.load(f, weights_only=False)
            q = c["q"].to(self.dev).double()  # [B, H, D]
            out = c["out"].to(self.dev).double()
            nb, H, D = q.shape
            worst, finite = 0.0, bool(torch.isfinite(out).all())
            for i, s in enumerate(c["seqs"]):
                k, v = s["k"].to(self.dev).double(), s["v"].to(self.dev).double()  # [ctx, KVH, D]
                g = H // k.shape[1]
                kh = k.repeat_interleave(g, 1).transpose(0, 1)  # [H, ctx, D]
                vh = v.repeat_interleave(g, 1).transpose(0, 1)
                p = torch.softmax((kh @ q[i].unsqueeze(-1)).squeeze(-1) * c["scale"], -1)  # [H, ctx]
                ref = (p.unsqueeze(1) @ vh).squeeze(1)  # [H, D]
                worst = max(worst, (out[i] - ref).abs().max().item() / (ref.abs().max().item() or 1.0))
            self.row(kind="attention", impl="triton", kv=c["kv"], batch=c["batch"], seqs_checked=nb,
                     max_rel_err=worst if finite else None, finite=finite, ok=finite and worst < tol["bfloat16"],
                     tol=tol["bfloat16"])

    # =============================================================================================================
    # 5. checkpoint
    # =============================================================================================================
    def _build(self, path: Path, shape: dict, layers: int, vocab: int, seed: int = 0) -> dict:
        """Write a random AWQ GEMM checkpoint (random int32 qweight/qzeros, fp16 scales) with a word-level
        tokenizer; returns sizes. Random bytes are drawn on the GPU when there is one."""
        torch = self.torch
        from safetensors.torch import save_file

        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import save_word_tokenizer

        t = time.time()
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        h, inter, hd, gs = shape["hidden"], shape["inter"], shape["head_dim"], shape["group"]
        qo, kvo = shape["heads"] * hd, shape["kv_heads"] * hd
        lin = {"self_attn.q_proj": (qo, h), "self_attn.k_proj": (kvo, h), "self_attn.v_proj": (kvo, h),
               "self_attn.o_proj": (h, qo), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
               "mlp.down_proj": (h, inter)}
        gen = torch.Generator(device=self.dev).manual_seed(seed)

        def bits32(rows, cols):  # 8 random 4-bit codes per int32
            return torch.randint(0, 256, (rows, cols * 4), dtype=torch.uint8, device=self.dev,
                                 generator=gen).view(torch.int32).cpu()

        def normal(rows, cols):
            return (torch.randn(rows, cols, device=self.dev, generator=gen) * 0.02).to(torch.bfloat16).cpu()

        files, wmap, lin_bytes = [], {}, 0
        nfiles = layers + 2

        def put(i, tensors):
            name = f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors"
            save_file(tensors, str(path / name), metadata={"format": "pt"})
            for k in tensors:
                wmap[k] = name
            files.append(name)

        put(0, {"model.embed_tokens.weight": normal(vocab, h)})
        for i in range(layers):
            p = f"model.layers.{i}"
            ts = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
            for name, (n_out, k_in) in lin.items():
                ts[f"{p}.{name}.qweight"] = bits32(k_in, n_out // 8)
                ts[f"{p}.{name}.qzeros"] = bits32(k_in // gs, n_out // 8)
                ts[f"{p}.{name}.scales"] = (torch.rand(k_in // gs, n_out, device=self.dev, generator=gen) * 2e-3
                                            + 2e-3).half().cpu()
                lin_bytes += sum(ts[f"{p}.{name}.{x}"].nbytes for x in ("qweight", "qzeros", "scales"))
            put(1 + i, ts)
        put(layers + 1, {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": normal(vocab, h)})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
               "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"], "head_dim": hd,
               "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 0,
               "eos_token_id": 1, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": gs,
                                       "zero_point": True}}
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        save_word_tokenizer(path, vocab)
        tok = json.loads((path / "tokenizer.json").read_text())
        tok_vocab = len(tok["model"]["vocab"])
        return dict(path=str(path), layers=layers, vocab=vocab, tokenizer_vocab=tok_vocab, linear_bytes=lin_bytes,
                    lm_head_bytes=vocab * h * 2, build_s=time.time() - t,
                    disk_bytes=sum(f.stat().st_size for f in path.iterdir()))

    def _engine(self, path: str, kv: str = "auto", dtype: str | None = None, max_tokens: int | None = None,
                device: str | None = None, backend: str = "triton"):
        import turbo

        d = self.cfg["decode"]
        dtype = dtype or self.cfg["model_dtype"]
        tokens = max_tokens or d["requests"] * (d["prompt"] + d["new"]) + 4 * 64
        cfg = turbo.EngineConfig(backend=backend, device=device or self.dev, dtype=dtype, kv_cache_dtype=kv,
                                 max_kv_tokens=tokens, max_batch_size=max(d["requests"], 1),
                                 max_num_batched_tokens=max(d["requests"] * d["prompt"], 256))
        return turbo.Engine(path, cfg)

    def _model_root(self) -> Path:
        """Where the checkpoint goes: /dev/shm when it has room (no disk writes), else the work folder."""
        need = 8 * GIB if not self.dry else 64 * MIB
        try:
            if shutil.disk_usage("/dev/shm").free > 2 * need and os.access("/dev/shm", os.W_OK):
                d = Path(tempfile.mkdtemp(prefix="compass-model-", dir="/dev/shm"))
                with open(self.work / "shm_dirs.txt", "a") as f:  # the parent removes it at the end
                    f.write(str(d) + "\n")
                return d
        except OSError:
            pass
        return self.work

    def sec_checkpoint(self) -> None:
        shape, c = self.cfg["model"], self.cfg
        root = self._model_root()
        # probes: 1 and 2 layers with a small vocabulary, each built and loaded once (after a first 1-layer load that
        # pays the imports and first-use costs): the difference is one layer's cost, the rest the engine's fixed
        # start-up (tokenizer, KV pool, graph captures); they predict the full load
        t = time.time()
        probes = []
        for n_layers in (1, 1, 2):
            pr = self._build(root / "probe", shape, n_layers, c["probe_vocab"], seed=1)
            tl = time.time()
            eng = self._engine(pr["path"])
            probes.append(pr["build_s"] + time.time() - tl)
            eng = None
            gc.collect()
            self.free()
            shutil.rmtree(pr["path"], ignore_errors=True)
        per_layer = max(probes[2] - probes[1], 0.1 * probes[2] / 2, 0.01)
        fixed = max(probes[1] - per_layer, 0.0)
        full = shape["layers"]
        budget = self.left() - 2.0 - c["vocab_extra_s"] - 1.25 * fixed
        layers = max(1, min(full, int(budget / (per_layer * 1.25))))
        est = fixed + per_layer * full
        self.row(kind="probe", probe_s=probes, est_s_per_layer=per_layer, est_fixed_s=fixed, est_full_s=est,
                 layers_chosen=layers, probe_total_s=time.time() - t,
                 note=None if layers == full else f"{full} layers would take ~{est:.0f} s to build and load, "
                                                  f"{self.left():.0f} s are left: {layers} layers")
        ck = self._build(root / "model", shape, layers, shape["vocab"])
        self.row(kind="build", **{k: v for k, v in ck.items() if k != "path"}, full_layers=full,
                 gbytes=ck["disk_bytes"] / 1e9)
        tl = time.time()
        eng = self._engine(ck["path"])
        ck["load_s"] = time.time() - tl
        st = eng.stats()
        self.row(kind="load", layers=layers, load_s=ck["load_s"], kv_cache_dtype=st.get("kv_cache_dtype"),
                 kv_bytes_per_token=st.get("kv_bytes_per_token"), kv_pool_tokens=st.get("kv_pool_tokens"),
                 gpu_alloc_gib=self.torch.cuda.memory_allocated() / GIB if self.cuda else None)
        (self.work / "ckpt.json").write_text(json.dumps(ck))
        self.state["engine"] = ("auto", eng)

    # =============================================================================================================
    # 6. decode
    # =============================================================================================================
    def sec_decode(self) -> None:

        torch = self.torch
        ckf = self.work / "ckpt.json"
        if not ckf.exists():
            self.row(skipped="no checkpoint (the checkpoint section did not finish)")
            return
        ck = json.loads(ckf.read_text())
        g = torch.Generator().manual_seed(0)
        hi = max(11, min(ck["vocab"], ck["tokenizer_vocab"]))

        def prompts(n, length):
            return [torch.randint(10, hi, (length,), generator=g).tolist() for _ in range(n)]

        kvs = self.cfg["decode_kv"]
        for ki, kv in enumerate(kvs):
            base = dict(kv=kv, layers=ck["layers"])
            try:
                self._decode_kv(ck, kv, ki, len(kvs), base, prompts)
            except StickyCudaError:
                raise
            except Exception as e:  # noqa: BLE001  (one KV dtype failing leaves the others to run)
                self.row(**base, error=err_text(e), traceback=traceback.format_exc()[-4000:])
                if not self.healthy():
                    raise StickyCudaError(f"decode with KV {kv}: {err_text(e)}") from e
            finally:
                self.state.pop("engine", None)
                gc.collect()
                self.free()

    def _decode_kv(self, ck: dict, kv: str, ki: int, n_kv: int, base: dict, prompts) -> None:
        d = self.cfg["decode"]
        copy_gbps = self.ceil.get("copy_gbps")
        est = (ck.get("load_s") or 0) + 2.0
        have = self.state.pop("engine", None)
        eng = have[1] if have and have[0] == kv else None
        have = None
        if eng is None:

            gc.collect()
            self.free()
            if self.left() < est + 5:
                self.row(**base, skipped=f"{self.left():.0f} s left, a load takes ~{est:.0f} s")
                return
            t = time.time()
            eng = self._engine(ck["path"], kv=kv)
            self.row(**base, kind="load", load_s=time.time() - t)
        kv_end = time.time() + self.left() / (n_kv - ki)
        st = eng.stats()
        kv_tok = st.get("kv_bytes_per_token") or 0
        kv_name = st.get("kv_cache_dtype", kv)
        w_bytes = ck["linear_bytes"] + ck["lm_head_bytes"]
        # warm-up: compiles (and graph captures) for both batch shapes, on prompts never measured
        t = time.time()
        eng.generate(prompts(1, d["prompt"])[0], max_new_tokens=d["warm_new"], ignore_eos=True)
        eng.generate(prompts(d["requests"], d["prompt"]), max_new_tokens=d["warm_new"], ignore_eos=True)
        self.sync()
        self.row(**base, kind="warmup", kv_cache_dtype=kv_name, warmup_s=time.time() - t)
        graphs = getattr(getattr(eng, "runner", None), "graphs", None)  # CUDA-graph decode (turbo/core/cuda_graphs.py)
        runs = [("batch1", 1, True), (f"batch{d['requests']}", d["requests"], True)]
        if ki == 0:  # the same batch-1 decode with graphs off: what the graphs save at batch 1
            runs.insert(1, ("batch1-eager", 1, False))
        for label, n_req, use_graphs in runs:
            if (n_req > 1 and time.time() > kv_end) or self.left() < 1:
                self.row(**base, run=label, skipped="this KV dtype's share of the section time is spent")
                continue
            if not use_graphs and (graphs is None or not graphs.enabled):
                self.row(**base, run=label, skipped="no CUDA graphs here (CPU, enforce_eager, a backend that is not "
                                                    "graph-safe, or a failed capture): batch1 is already eager")
                continue
            was = graphs.enabled if graphs is not None else None
            if graphs is not None:
                graphs.enabled = use_graphs and was
            ps = prompts(n_req, d["prompt"])
            s0 = _steps(eng)
            self.sync()
            t = time.perf_counter()
            outs = eng.generate(ps, max_new_tokens=d["new"], ignore_eos=True)
            self.sync()
            wall = time.perf_counter() - t
            s1 = _steps(eng)
            steps = s1 - s0 if s0 is not None and s1 is not None else None
            gen_tokens = sum(len(o.token_ids) for o in outs)
            per_req = sorted(o.decode_seconds / max(1, len(o.token_ids) - 1) for o in outs)
            step_ms = 1e3 * per_req[len(per_req) // 2]
            mean_ctx = d["prompt"] + d["new"] / 2
            roof_bytes = w_bytes + n_req * mean_ctx * kv_tok
            roof_ms = roof_bytes / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
            row = dict(**base, run=label, kv_cache_dtype=kv_name, requests=n_req, prompt=d["prompt"], new=d["new"],
                       wall_s=wall, steps=steps, tokens_per_s=gen_tokens / wall,
                       decode_tokens_per_s=1e3 * n_req / step_ms if step_ms else None,
                       decode_ms_per_step=step_ms, wall_ms_per_step=1e3 * wall / steps if steps else None,
                       ttft_ms=1e3 * max(o.ttft for o in outs), roofline_bytes=roof_bytes, roofline_ms=roof_ms,
                       frac_roofline=roof_ms / step_ms if roof_ms and step_ms else None)
            if time.time() < kv_end:
                row.update(self._gpu_per_step(eng, n_req, prompts, d))
            row["cuda_graphs"] = bool(graphs is not None and graphs.enabled)
            row["graph_replays"] = getattr(graphs, "replays", None)
            if graphs is not None:
                graphs.enabled = was
            self.row(**row)

    def _gpu_per_step(self, eng, n_req: int, prompts, d: dict) -> dict:
        """GPU-busy and wall ms per decode step: two profiled runs of different lengths, differenced (the prefill
        and fixed costs cancel)."""
        try:
            from torch.profiler import ProfilerActivity, profile
        except Exception as e:  # noqa: BLE001
            return dict(gpu_ms_per_step=None, gpu_why=err_text(e))
        res = []
        for n_new in (d["prof_short"], d["prof_long"]):
            ps = prompts(n_req, d["prompt"])
            acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
            trace = self.work / "trace.json"
            try:
                with profile(activities=acts) as prof:
                    self.sync()
                    t = time.perf_counter()
                    eng.generate(ps, max_new_tokens=n_new, ignore_eos=True)
                    self.sync()
                    wall = time.perf_counter() - t
                prof.export_chrome_trace(str(trace))
                busy, kernels = _gpu_busy(trace)
            except Exception as e:  # noqa: BLE001
                return dict(gpu_ms_per_step=None, gpu_why=f"profiler: {err_text(e)}")
            finally:
                try:
                    trace.unlink()
                except OSError:
                    pass
            res.append((wall, busy, kernels))
        (w1, b1, k1), (w2, b2, k2) = res
        ds = d["prof_long"] - d["prof_short"]  # decode steps between the two runs (same prompts' shape)
        out = dict(prof_wall_ms_per_step=1e3 * (w2 - w1) / ds, prof_new_tokens=[d["prof_short"], d["prof_long"]])
        if self.cuda:
            out.update(gpu_ms_per_step=1e3 * (b2 - b1) / ds, kernels_per_step=(k2 - k1) / ds,
                       gpu_busy_frac=(b2 - b1) / (w2 - w1) if w2 > w1 else None)
        else:
            out.update(gpu_ms_per_step=None, gpu_why="no CUDA (dry run): wall clock only")
        return out

    # =============================================================================================================
    # 7. GPU vs CPU float32 logits
    # =============================================================================================================
    def sec_logits(self) -> None:

        torch = self.torch
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import build_key_outlier_model

        root = self.work / "tiny"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        models = {}
        try:
            models["dense_f32_keyoutlier"] = (str(build_key_outlier_model(root / "dense")), 128)
        except Exception as e:  # noqa: BLE001
            self.row(model="dense_f32_keyoutlier", error=f"building: {err_text(e)}", traceback=traceback.format_exc()[-3000:])
        ck = self._build(root / "w4a16", self.cfg["tiny"], self.cfg["tiny"]["layers"], self.cfg["tiny"]["vocab"], seed=3)
        models["w4a16_random_awq"] = (ck["path"], min(ck["vocab"], ck["tokenizer_vocab"]))
        g = torch.Generator().manual_seed(5)
        for name, (path, vocab) in models.items():
            if self.left() < 1:
                self.row(model=name, skipped="the section's time is spent")
                continue
            n_prompt, n_new = self.cfg["logits_tokens"]
            ids = torch.randint(10, vocab, (n_prompt,), generator=g).tolist()
            res = {}
            try:
                for side, dev, backend in (("gpu", self.dev, "triton"), ("cpu", "cpu", "torch")):
                    eng = self._engine(path, dtype="float32", max_tokens=256, device=dev, backend=backend)
                    res[side] = eng.generate(ids, max_new_tokens=n_new, ignore_eos=True, logprobs=5)
                    del eng
                    gc.collect()
            except Exception as e:  # noqa: BLE001  (one model failing leaves the other to run)
                self.row(model=name, error=err_text(e), traceback=traceback.format_exc()[-4000:])
                if not self.healthy():
                    raise StickyCudaError(f"logits of {name}: {err_text(e)}") from e
                continue
            a, c = res["gpu"], res["cpu"]
            same = a.token_ids == c.token_ids
            diffs = []
            for la, lc in zip(a.logprobs, c.logprobs):
                dc = dict(lc)
                diffs += [abs(v - dc[t]) for t, v in la if t in dc]
            self.row(model=name, gpu=f"triton on {self.dev}", cpu="torch on cpu", dtype="float32",
                     tokens_equal=same, compared=len(diffs), max_abs_diff_logprob=max(diffs) if diffs else None,
                     note=f"top-5 log-probabilities of {n_new} greedy tokens after a {n_prompt}-token prompt "
                          f"(public API: generate)")

    # =============================================================================================================
    # 8. tests
    # =============================================================================================================
    def sec_tests(self) -> None:
        files = [f for f in TEST_FILES if (REPO / f).exists()]
        missing = [f for f in TEST_FILES if f not in files]
        has_xdist, has_to = _importable("xdist"), _importable("pytest_timeout")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
        notes = []
        if self.dry:
            cmd += ["--collect-only"]
            notes.append("dry run: collection only (the GPU run executes them)")
        if has_xdist:
            cmd += ["-n", str(self.cfg["xdist_workers"])]
        else:
            notes.append("pytest-xdist is not installed here: one process")
        if has_to:
            cmd += ["--timeout", str(self.cfg["test_timeout"])]
        else:
            notes.append("pytest-timeout is not installed here: no per-test timeout")
        cmd += files
        limit = max(5.0, self.left())
        log_path = self.out / "tests.log"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        if self.dry:
            env["TRITON_INTERPRET"] = "1"
        t = time.time()
        with open(log_path, "w") as logf:
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            p = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
            write_status(self.work, dict(read_status(self.work), tests_pgid=p.pid))
            timed_out = False
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(p.pid)
                rc = p.wait()
                logf.write(f"\n[gpu_compass] stopped after {limit:.0f} s (the section's time)\n")
        text = log_path.read_text(errors="replace")
        summary = _pytest_summary(text)
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|tests? collected)",
                                                   summary)}
        self.row(cmd=" ".join(cmd[2:]), files=files, missing=missing, rc=rc, timed_out=timed_out, seconds=time.time() - t,
                 summary=summary, **{k.replace(" ", "_"): v for k, v in counts.items()},
                 note="; ".join(notes) or None, log="tests.log")


# =================================================================================================================
# helpers shared by both processes
# =================================================================================================================
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _importable(mod: str) -> bool:
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
    tmp = work / "status.json.tmp"
    tmp.write_text(json.dumps(st))
    os.replace(tmp, work / "status.json")


def read_status(work: Path) -> dict:
    try:
        return json.loads((work / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _kill_group(pgid: int) -> None:
    """End a process group this harness started (its own child and what that child started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(1.0)


def _steps(eng) -> int | None:
    """The engine's step counter (``stats()["steps"]``), or None if it has none."""
    try:
        v = eng.stats().get("steps")
        return int(v) if v is not None else None
    except Exception:  # noqa: BLE001
        return None


def _gpu_busy(trace: Path) -> tuple[float, int]:
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


def _pytest_summary(text: str) -> str:
    for line in reversed(text.splitlines()):
        s = line.strip().strip("=").strip()
        if re.search(r"\d+ (passed|failed|errors?|skipped|tests? collected|deselected)|no tests ran", s):
            return s[:300]
    return (text.strip().splitlines() or ["(no output)"])[-1][:300]


# =================================================================================================================
# the compass table
# =================================================================================================================
def _f(v, fmt="{:.0f}", none="-"):
    if v is None:
        return none
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _g(v) -> str:
    """A rate with about three significant digits."""
    if v is None:
        return "-"
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.01 else f"{v:.0e}"


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def compass(rows: list[dict], budget: float, dry: bool) -> str:
    out = []
    env = {}
    for r in rows:
        if r.get("section") == "env":
            env.update({k: v for k, v in r.items() if v is not None})
    copy = env.get("copy_gbps")
    title = "liteturbo GPU compass" + (" (DRY RUN: CPU, Triton interpreter, tiny shapes)" if dry else "")
    out.append(f"== {title} ==")
    out.append(f"device {env.get('device_name', '?')}  SMs {env.get('sms', '?')}  L2 "
               f"{_f((env.get('l2_bytes') or 0) / MIB, '{:.0f} MiB') if env.get('l2_bytes') else '-'}  torch "
               f"{env.get('torch', '?')}  CUDA {env.get('cuda', '-')}  triton {env.get('triton', '?')}  "
               f"transformers {env.get('transformers', '?')}")
    out.append(f"ceilings: copy {_g(copy)} GB/s (read+write of {_f((env.get('bytes') or 0) / GIB, '{:.2f}')} GiB), "
               f"{env.get('dtype', '')} matmul {_g(env.get('matmul_tflops'))} TFLOP/s   budget {budget:.0f} s")

    # W4A16
    w = [r for r in rows if r.get("section") == "w4a16" and r.get("us") is not None]
    if w:
        out.append("")
        out.append("W4A16 (us per call; GB/s of 4-bit weight bytes; %copy = of the copy bandwidth; xcuBLAS = cuBLAS "
                   "16-bit time / time)")
        out.append(f"{'dtype':5} {'shape':7} {'M':>3} | {'triton':>8} {'GB/s':>6} {'%copy':>5} {'xcuBLAS':>7} | "
                   f"{'cuBLAS':>8} {'GB/s':>6} | {'deq+mm':>8} {'xcuB':>5} | {'t-int4':>8} {'xcuB':>5} | timing")
        keys = []
        for r in w:
            k = (r["dtype"], r["shape"], r["M"])
            if k not in keys:
                keys.append(k)
        by = {(r["dtype"], r["shape"], r["M"], r["impl"]): r for r in w}
        for dt, sh, m in keys:
            t, cb = by.get((dt, sh, m, "triton")), by.get((dt, sh, m, "cublas"))
            dq, i4 = by.get((dt, sh, m, "dequant_mm")), by.get((dt, sh, m, "torch_int4"))

            def x(r):
                return cb["us"] / r["us"] if r and cb else None
            timing = (t or cb or {}).get("timing", "")
            out.append(f"{_SHORT.get(dt, dt):5} {sh:7} {m:>3} | {_f(t and t['us'], '{:8.1f}'):>8} {_g(t and t['gbps']):>6} "
                       f"{_f(t and t.get('frac_copy') and 100 * t['frac_copy']):>5} {_f(x(t), '{:.2f}'):>7} | "
                       f"{_f(cb and cb['us'], '{:8.1f}'):>8} {_g(cb and cb['gbps']):>6} | "
                       f"{_f(dq and dq['us'], '{:8.1f}'):>8} {_f(x(dq), '{:.2f}'):>5} | "
                       f"{_f(i4 and i4['us'], '{:8.1f}'):>8} {_f(x(i4), '{:.2f}'):>5} | {timing.split(' ')[0]}")
        # one decoder layer's linears (every shape) at each M: the sums of times, the targets' terms
        for dt in dict.fromkeys(k[0] for k in keys):
            for m in dict.fromkeys(k[2] for k in keys if k[0] == dt):
                shapes = [k[1] for k in keys if k[0] == dt and k[2] == m]
                t = [by.get((dt, sh, m, "triton")) for sh in shapes]
                cb = [by.get((dt, sh, m, "cublas")) for sh in shapes]
                if m not in (1, max(k[2] for k in keys)) or not all(t) or not all(cb):
                    continue
                tt, tc = sum(r["us"] for r in t), sum(r["us"] for r in cb)
                gb = sum(r["bytes"] for r in t) / (tt / 1e6) / 1e9
                out.append(f"  layer ({'+'.join(shapes)}) {_SHORT.get(dt, dt)} M={m}: triton {tt:.1f} us = {_g(gb)} GB/s"
                           f" = {_f(copy and 100 * gb / copy)}% of copy; cuBLAS {tc:.1f} us: x{tc / tt:.2f}"
                           + ("  (targets at M=1: >= 70% of copy, >= 2.5x cuBLAS)" if m == 1 else ""))
    # attention
    a = [r for r in rows if r.get("section") == "attention" and r.get("us_per_layer") is not None]
    if a:
        ctx = a[0].get("ctx")
        out.append("")
        out.append(f"paged decode attention, context {ctx}, {a[0].get('layers')} layers of cache (us per layer call; "
                   f"Mtok-heads/s = context tokens x KV heads read per s; xbf16 = bf16 time / time)")
        out.append(f"{'kv':8} {'batch':>5} | {'us':>8} {'GB/s':>6} {'%copy':>5} {'Mtok-h/s':>9} {'xbf16':>6} | timing")
        bf = {r["batch"]: r for r in a if r["kv"] == "bfloat16"}
        for r in a:
            ref = bf.get(r["batch"])
            out.append(f"{r['kv']:8} {r['batch']:>5} | {_f(r['us_per_layer'], '{:8.1f}'):>8} {_g(r['gbps']):>6} "
                       f"{_f(r.get('frac_copy') and 100 * r['frac_copy']):>5} {_g(r['token_heads_per_s'] / 1e6):>9} "
                       f"{_f(ref['us_per_layer'] / r['us_per_layer'] if ref else None, '{:.2f}'):>6} | "
                       f"{str(r.get('timing', '')).split(' ')[0]}")
    # check
    c = [r for r in rows if r.get("section") == "check" and "max_rel_err" in r]
    if c:
        out.append("")
        bad = [r for r in c if not r.get("ok")]
        worst = {}
        for r in c:
            k = (r.get("kind"), r.get("impl"), r.get("dtype") or r.get("kv"))
            e = r.get("max_rel_err")
            worst[k] = max(worst.get(k, 0.0), e if e is not None else float("inf"))
        items = [f"{k[0]}/{k[1]}/{_SHORT.get(k[2], k[2])} {v:.1e}" for k, v in worst.items()]
        out.append(f"float64 check ({len(c)} outputs, {len(bad)} over tolerance; max |y - ref| / max |ref|):")
        for i in range(0, len(items), 4):
            out.append("  " + ", ".join(items[i:i + 4]))
        for r in bad[:6]:
            out.append(f"  OVER TOLERANCE: {r.get('kind')} {r.get('impl')} "
                       + " ".join(f"{k}={r[k]}" for k in ("dtype", "shape", "M", "kv", "batch") if r.get(k) is not None)
                       + f" err {_f(r.get('max_rel_err'), '{:.2e}')} (tol {r.get('tol')})")
    # checkpoint + decode
    ck = [r for r in rows if r.get("section") == "checkpoint" and not r.get("skipped") and not r.get("error")]
    dec = [r for r in rows if r.get("section") == "decode" and r.get("run")]
    loads = [r for r in rows if r.get("kind") == "load" and r.get("load_s") is not None]
    if ck or dec:
        out.append("")
        b = next((r for r in ck if r.get("kind") == "build"), {})
        p = next((r for r in ck if r.get("kind") == "probe"), {})
        out.append(f"checkpoint: {b.get('layers', '?')}/{b.get('full_layers', '?')} layers, "
                   f"{_f(b.get('gbytes'), '{:.2f}')} GB built in {_f(b.get('build_s'), '{:.1f}')} s; loads "
                   + ", ".join(f"{r.get('kv_cache_dtype') or r.get('kv')}: {r['load_s']:.1f} s" for r in loads)
                   + (f"; probes predicted {_g(p['est_full_s'])} s for the full model" if p.get("est_full_s") else ""))
    if dec:
        lay = next((r.get("layers") for r in dec if r.get("layers")), "?")
        out.append(f"decode ({lay}-layer model; ms per step; GPU ms = GPU busy per decode step (profiler); roofline = "
                   f"(weight + KV bytes per step) / copy bandwidth)")
        out.append(f"{'kv':8} {'run':8} | {'tok/s':>8} {'ms/step':>8} {'wall ms':>8} {'GPU ms':>7} {'kern/st':>7} "
                   f"{'roof ms':>8} {'%roof':>6} | {'ttft ms':>8}")
        for r in dec:
            if r.get("skipped"):
                continue
            out.append(f"{str(r.get('kv_cache_dtype') or r.get('kv')):8} {r['run']:8} | "
                       f"{_f(r.get('tokens_per_s'), '{:8.1f}'):>8} {_f(r.get('decode_ms_per_step'), '{:8.2f}'):>8} "
                       f"{_f(r.get('prof_wall_ms_per_step'), '{:8.2f}'):>8} {_f(r.get('gpu_ms_per_step'), '{:7.2f}'):>7} "
                       f"{_f(r.get('kernels_per_step')):>7} {_f(r.get('roofline_ms'), '{:8.2f}'):>8} "
                       f"{_f(r.get('frac_roofline') and 100 * r['frac_roofline'], '{:.0f}'):>6} | "
                       f"{_f(r.get('ttft_ms'), '{:8.1f}'):>8}")
    lg = [r for r in rows if r.get("section") == "logits" and "max_abs_diff_logprob" in r]
    if lg:
        out.append("")
        out.append("GPU vs CPU float32: " + "; ".join(
            f"{r['model']}: max |dlogprob| {_f(r['max_abs_diff_logprob'], '{:.1e}')}, tokens "
            f"{'equal' if r.get('tokens_equal') else 'DIFFER'}" for r in lg))
    ts = [r for r in rows if r.get("section") == "tests" and "summary" in r]
    if ts:
        out.append("")
        out.append(f"tests (rc {ts[-1].get('rc')}, {_f(ts[-1].get('seconds'))} s): {ts[-1]['summary']}")
    # skips and errors
    probs = [r for r in rows if r.get("error") or (r.get("skipped") and r.get("section") != "w4a16")]
    w4skips = [r for r in rows if r.get("skipped") and r.get("section") == "w4a16"]
    if probs or w4skips:
        out.append("")
        out.append("skipped / errors:")
        for r in probs[:14]:
            what = " ".join(f"{k}={r[k]}" for k in ("kind", "impl", "dtype", "shape", "M", "kv", "batch", "run", "model")
                            if r.get(k) is not None)
            msg = ("ERROR " + str(r["error"])) if r.get("error") else ("skipped: " + str(r["skipped"]))
            out.append(f"  {r['section']}{' ' + what if what else ''}: {msg}"[:200])
        if len(probs) > 14:
            out.append(f"  ... {len(probs) - 14} more in results.jsonl")
        if w4skips:
            reasons = sorted({str(r["skipped"])[:90] for r in w4skips})
            out.append(f"  w4a16: {len(w4skips)} skipped ({'; '.join(reasons[:3])})"[:300])
    n_err = sum(1 for r in rows if r.get("error"))
    done = sorted({r.get("section") for r in rows if not r.get("skipped") and not r.get("error")} & set(NAMES),
                  key=NAMES.index)
    out.append(f"sections with results: {', '.join(done)}; {n_err} error rows; {len(rows)} rows in results.jsonl")
    return "\n".join(out)


# =================================================================================================================
# the parent
# =================================================================================================================
def parent(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "results.jsonl"
    t0 = time.time()
    deadline = t0 + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="gpu-compass-"))
    only = [s.strip() for s in args.sections.split(",")] if args.sections else list(NAMES)
    bad = [s for s in only if s not in NAMES]
    if bad:
        raise SystemExit(f"unknown sections {bad}; choose from {', '.join(NAMES)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU, whatever the caller's shell had
    run_log = open(out / "run.log", "a")
    write_row(rows_path, t0, "run", kind="start", budget_s=args.budget_s, dry_run=args.dry_run, sections=only,
              argv=sys.argv[1:], cmd="python bench/gpu_compass.py " + " ".join(sys.argv[1:]))
    print(f"[gpu_compass] {'dry run, ' if args.dry_run else ''}budget {args.budget_s:.0f} s, results in {out}",
          flush=True)
    start = 0
    grace_final = max(10.0, 0.05 * args.budget_s)
    try:
        while start < len(SECTIONS) and time.time() < deadline:
            if not any(n in only for n in NAMES[start:]):
                break
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(out), "--work", str(work),
                   "--start", str(start), "--t0", repr(t0), "--deadline", repr(deadline), "--budget-s",
                   str(args.budget_s), "--sections", ",".join(only)]
            cmd += ["--dry-run"] if args.dry_run else []
            cmd += ["--no-graphs"] if args.no_graphs else []
            (work / "status.json").unlink(missing_ok=True)
            p = subprocess.Popen(cmd, cwd=REPO, stdout=run_log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
            shown, killed = None, None
            while True:
                try:
                    rc = p.wait(timeout=0.3)
                    break
                except subprocess.TimeoutExpired:
                    pass
                st = read_status(work)
                if st.get("name") != shown and st.get("name"):
                    shown = st["name"]
                    print(f"[gpu_compass] {time.time() - t0:6.1f} s  {shown}", flush=True)
                now = time.time()
                if st and now > min(st.get("hard_deadline", now + 1), deadline + grace_final):
                    killed = st
                    _kill_group(p.pid)
                    rc = p.wait()
                    break
                if not st and now > deadline + grace_final:
                    killed = {"index": start, "name": NAMES[start]}
                    _kill_group(p.pid)
                    rc = p.wait()
                    break
            st = killed or read_status(work)
            tg = st.get("tests_pgid")
            if tg:
                _kill_group(tg)  # pytest and its workers, if the child left them
            if rc == 0 and not killed:
                break
            idx = st.get("index", next((i for i in range(start, len(NAMES)) if NAMES[i] in only), start))
            name = st.get("name", NAMES[idx])
            last = [r for r in read_rows(rows_path) if r.get("section") == name]
            if killed:
                write_row(rows_path, t0, name, error=f"over its time: ended after "
                          f"{time.time() - st.get('start', t0):.0f} s (hung or too slow); a fresh process takes the "
                          f"next section", fatal=True)
            elif not (last and last[-1].get("fatal")):
                tail = _tail(out / "run.log", 30)
                write_row(rows_path, t0, name, error=f"the process died (exit {rc}) during this section; a fresh "
                          f"process takes the next section", traceback=tail, fatal=True)
            print(f"[gpu_compass] section {name} failed (exit {rc}{', killed' if killed else ''}); going on",
                  flush=True)
            start = idx + 1
    finally:
        run_log.close()
        rows = read_rows(rows_path)
        seen = {r.get("section") for r in rows}
        for n in NAMES:
            if n not in seen:
                why = "not asked for (--sections)" if n not in only else "the global deadline was reached first"
                write_row(rows_path, t0, n, skipped=why)
        write_row(rows_path, t0, "run", kind="end", seconds=time.time() - t0)
        for line in (work / "shm_dirs.txt").read_text().split() if (work / "shm_dirs.txt").exists() else []:
            shutil.rmtree(line, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        table = compass(read_rows(rows_path), args.budget_s, args.dry_run)
        (out / "compass.txt").write_text(table + "\n")
        print(f"[gpu_compass] done in {time.time() - t0:.0f} s; files: "
              f"{', '.join(sorted(p.name for p in out.iterdir()))}", flush=True)
        print(table, flush=True)
    return 0


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])[-4000:]
    except OSError:
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "./gpu_results",
                    help="results folder (default: $OUT, else ./gpu_results)")
    ap.add_argument("--budget-s", type=float, default=None, help="global deadline in seconds (default 450; 120 dry)")
    ap.add_argument("--dry-run", action="store_true", help="rehearse on the CPU: TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--sections", default="", help=f"comma-separated subset of: {', '.join(NAMES)}")
    ap.add_argument("--no-graphs", action="store_true", help="time eagerly with CUDA events (no CUDA graphs)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 120.0 if args.dry_run else 450.0
    if not args.child:
        return parent(args)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(REPO))
    child = Child(args)
    if args.dry_run:
        child.torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return child.run(args.start, args.sections.split(","))


if __name__ == "__main__":
    sys.exit(main())
