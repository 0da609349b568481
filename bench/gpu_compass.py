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

Code: this file (the child's core and the parent), ``compass_common.py`` (sections, shapes, rows, helpers),
``compass_kernels.py`` (sections 1-4), ``compass_model.py`` (5-8), ``compass_table.py`` (the table).

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
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from compass_common import (DRY, NAMES, REAL, REPO, SECTIONS, StickyCudaError, kill_group, err_text, inject_fault, log,
                            read_rows, read_status, write_row, write_status)
from compass_kernels import KernelSections
from compass_model import ModelSections
from compass_table import compass


class Child(KernelSections, ModelSections):
    """The child process: runs the sections (:mod:`compass_kernels`, :mod:`compass_model`) in order from a start
    section, each within its share of the time left, recording rows; the parent replaces it when it hangs or dies."""

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

# =================================================================================================================
# the parent
# =================================================================================================================
def parent(args) -> int:
    """The parent process (never touches the GPU): starts a child at the first section not done, watches its time,
    replaces it after a hang, a crash or a sticky CUDA error, then prints and writes the compass table. Returns 0."""
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
                    kill_group(p.pid)
                    rc = p.wait()
                    break
                if not st and now > deadline + grace_final:
                    killed = {"index": start, "name": NAMES[start]}
                    kill_group(p.pid)
                    rc = p.wait()
                    break
            st = killed or read_status(work)
            tg = st.get("tests_pgid")
            if tg:
                kill_group(tg)  # pytest and its workers, if the child left them
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
    """Command line: the parent by default, the child with ``--child``; the exit status."""
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
