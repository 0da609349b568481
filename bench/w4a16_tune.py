"""Tune the Triton W4A16 launch table on a lent GPU: per weight shape and M bucket, a coordinate search over the
kernel kind and its block sizes, warps, stages and split-K, timed in CUDA graphs over weights larger than the L2.

    python bench/w4a16_tune.py --out $OUT --budget-s 400       (on the GPU; stops itself at the budget)
    python bench/w4a16_tune.py --dry-run --out DIR              (CPU rehearsal: Triton's interpreter, tiny shapes)

For each shape (Llama-3-8B's fused linears: qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and
each M in 1, 2, 4, 8, 16, 32 (bf16 activations, group size 128), the search starts at what
``backends/triton/w4a16_plan.get_config`` gives today (timed first: the baseline), then tries every value of one
setting at a time with the others at the best so far (kind gemv/dot where M <= 4, then split_k, num_stages,
block_n, block_k, num_warps), twice over. Each configuration's output is checked against the baseline's (max |y - y0| /
max |y0| <= 1e-2, else it is disqualified); one that fails to compile is recorded and skipped. The time of each
(shape, M) is its share of the budget left.

Output (``--out``): ``tune.jsonl`` (one row per timed configuration: shape, N, K, M, config, us, GB/s of the 4-bit
weight bytes, fraction of the copy bandwidth, speed-up over the baseline), ``best.json`` (in the ``shapes`` format of
``backends/triton/w4a16_configs.json``: ``{"N,K": {"M": config}}``, only entries at least 3 % faster than the
baseline) and ``tune.txt`` (the table: baseline vs best per shape and M).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

REAL_SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
DRY_SHAPES = [("qkv", 256, 384)]
REAL_MS = (1, 2, 4, 8, 16, 32)
DRY_MS = (1, 4)
SPACE = {"split_k": (0, 1, 2, 4, 8, 16, 32), "num_stages": (1, 2, 3, 4), "block_n": (32, 64, 128, 256),
         "block_k": (32, 64, 128), "num_warps": (2, 4, 8)}
DRY_SPACE = {"block_n": (64, 128), "num_warps": (4,), "split_k": (0, 2)}
KEYS = ("kind", "block_n", "block_k", "num_warps", "num_stages", "split_k")
MIB = 1 << 20


class Tuner:
    """One tuning session: the device (CUDA, or the CPU under the interpreter for ``--dry-run``), its copy bandwidth
    (GB/s read + written), the deadline of ``--budget-s`` and ``tune.jsonl`` in ``--out``, appended row by row."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.dry = args.dry_run
        self.cuda = torch.cuda.is_available() and not self.dry
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.deadline = time.time() + args.budget_s
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows = open(self.out / "tune.jsonl", "a")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count if self.cuda else 1
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) if self.cuda else 0
        self.l2 = int(l2) or 60 * MIB
        self.copy_gbps = self._copy_bandwidth()
        self.row(kind="env", device=torch.cuda.get_device_name(0) if self.cuda else "cpu", sms=self.sms, l2=self.l2,
                 copy_gbps=self.copy_gbps, torch=torch.__version__, triton=__import__("triton").__version__)

    def row(self, **kw) -> None:
        """Append one JSON row to ``tune.jsonl`` and flush (a killed run keeps what it measured)."""
        self.rows.write(json.dumps(kw, default=str) + "\n")
        self.rows.flush()

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.time()

    def sync(self) -> None:
        """Wait for the GPU (no-op on the CPU)."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def _copy_bandwidth(self) -> float:
        torch = self.torch
        n = (2 << 30) if self.cuda else (16 * MIB)
        src = torch.ones(n, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        best = min(self._wall(lambda: dst.copy_(src)) for _ in range(5))
        return 2 * n / best / 1e9

    def _wall(self, fn) -> float:
        """Seconds of one call of ``fn`` (CUDA events on a GPU)."""
        if self.cuda:
            fn()
            e0, e1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    # --- one shape ------------------------------------------------------------------------------------------
    def weights(self, n: int, k: int, gs: int):
        """Enough random tiled weights (same layout as ``TritonBackend.prepare_w4a16``) to exceed 4x the L2."""
        torch = self.torch
        from backends.triton import w4a16

        g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
        nbytes = n * k // 2
        copies = 1 if not self.cuda else max(2, min(64, math.ceil(4 * self.l2 / nbytes)))
        out = []
        for _ in range(copies):
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            zeros = torch.randint(0, 16, (k // gs, n), dtype=torch.uint8, generator=g)
            scales = torch.rand(k // gs, n, generator=g) * 2e-3 + 2e-3
            out.append((w4a16.pack_tiled(codes).to(self.dev), scales.to(self.dev, torch.bfloat16).contiguous(),
                        zeros.to(self.dev).contiguous()))
        return out

    def time_config(self, x, ws, n, k, gs, cfg):
        """(microseconds per call, output of the first weight) of ``cfg`` over all weights; CUDA graph on a GPU."""
        torch = self.torch
        from backends.triton import w4a16

        def call(w):
            """``x @ W.T`` for one weight copy ``w = (tiled codes, scales, zeros)`` with ``cfg``."""
            return w4a16.w4a16_matmul(x, w[0], w[1], w[2], gs, n, k, config=dict(cfg), sms=self.sms)

        y0 = call(ws[0]).clone()  # compiles
        self.sync()
        if not self.cuda:
            t = time.perf_counter()
            for w in ws:
                call(w)
            return (time.perf_counter() - t) * 1e6 / len(ws), y0
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for w in ws:
                call(w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in ws:
                call(w)
        graph.replay()
        self.sync()
        best = min(self._wall(graph.replay) for _ in range(5))
        del graph
        return best * 1e6 / len(ws), y0

    def tune(self, sname: str, n: int, k: int, m: int, ws, gs: int, space: dict, until: float) -> dict:
        """Coordinate search for ``M = m`` rows of the ``N x K`` weights ``ws`` (see the module docstring) until
        ``until`` (epoch seconds); returns the ``best`` row (baseline and best config, microseconds per call,
        speed-up), or ``{}`` when the baseline itself fails."""
        torch = self.torch
        from backends.triton import w4a16_plan

        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(self.dev, torch.bfloat16)
        base_cfg = w4a16_plan.get_config(n, k, m)
        base_cfg = {key: base_cfg[key] for key in KEYS if key in base_cfg}
        base_cfg.setdefault("split_k", 0)
        seen: dict = {}
        wbytes = n * k // 2

        def key_of(c):
            """The configuration as a hashable tuple of :data:`KEYS`."""
            return tuple(c.get(kk) for kk in KEYS)

        def try_cfg(c):
            """Time ``c`` once (cached by :func:`key_of`): its row, or ``None`` when it fails to compile or run or
            its output differs from the baseline's by more than 1e-2 of the output's max."""
            kc = key_of(c)
            if kc in seen:
                return seen[kc]
            try:
                us, y = self.time_config(x, ws, n, k, gs, c)
                ref = seen.get("ref")
                err = 0.0 if ref is None else float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                ok = err <= 1e-2
            except Exception as e:  # noqa: BLE001
                self.row(kind="error", shape=sname, N=n, K=k, M=m, config=c, error=f"{type(e).__name__}: {e}"[:400])
                if self.cuda:
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001  (a sticky error: nothing more can run in this process)
                        raise
                seen[kc] = None
                return None
            if "ref" not in seen:
                seen["ref"] = y.float()
            gbps = wbytes / (us / 1e6) / 1e9
            r = dict(us=us, gbps=gbps, frac_copy=gbps / self.copy_gbps, rel_err=err, ok=ok)
            self.row(kind="timing", shape=sname, N=n, K=k, M=m, config=c, **r)
            seen[kc] = r if ok else None
            return seen[kc]

        base = try_cfg(base_cfg)
        if base is None:
            return {}
        best_cfg, best = dict(base_cfg), base
        dims = ([("kind", ("gemv", "dot"))] if m <= 4 else []) + list(space.items())
        for _pass in range(2):
            changed = False
            for dim, values in dims:
                for v in values:
                    if time.time() > until or self.left() < 5:
                        break
                    c = dict(best_cfg, **{dim: v})
                    r = try_cfg(c)
                    if r is not None and r["us"] < best["us"] * 0.99:
                        best_cfg, best, changed = c, r, True
            if not changed:
                break
        result = dict(shape=sname, N=n, K=k, M=m, base=base_cfg, base_us=base["us"], best=best_cfg,
                      best_us=best["us"], speedup=base["us"] / best["us"], best_frac_copy=best["frac_copy"],
                      tried=len(seen) - 1)
        self.row(kind="best", **result)
        return result

    def run(self, shapes, ms, space, gs: int) -> list:
        """Tune every (shape, M) with an equal share of the time left; returns the ``best`` rows."""
        results = []
        items = [(s, m) for s in shapes for m in ms]
        done = 0
        for sname, k, n in shapes:
            if self.left() < 10:
                self.row(kind="skipped", shape=sname, reason="budget spent")
                continue
            try:
                ws = self.weights(n, k, gs)
            except Exception as e:  # noqa: BLE001
                self.row(kind="error", shape=sname, error=f"weights: {e}", traceback=traceback.format_exc()[-2000:])
                continue
            for m in ms:
                share = self.left() / max(1, len(items) - done)
                done += 1
                if self.left() < 5:
                    self.row(kind="skipped", shape=sname, M=m, reason="budget spent")
                    continue
                results.append(self.tune(sname, n, k, m, ws, gs, space, time.time() + share))
            ws = None
            if self.cuda:
                self.torch.cuda.empty_cache()
        return [r for r in results if r]


def table(results: list, copy_gbps: float) -> str:
    """The text table of ``tune.txt``: baseline vs best per shape and M, %copy of ``copy_gbps`` (GB/s)."""
    lines = [f"W4A16 launch tuning (bf16, g128; GB/s of 4-bit weight bytes; copy {copy_gbps:.0f} GB/s)",
             "shape      M |  base us  %copy |  best us  %copy  speed-up | best config"]
    for r in results:
        wb = r["N"] * r["K"] / 2
        fb = wb / (r["base_us"] / 1e6) / 1e9 / copy_gbps * 100
        lines.append(f"{r['shape']:<8} {r['M']:>3} | {r['base_us']:8.1f} {fb:5.0f}% | {r['best_us']:8.1f} "
                     f"{r['best_frac_copy'] * 100:5.0f}%  {r['speedup']:7.2f}x | "
                     + " ".join(f"{kk}={r['best'].get(kk)}" for kk in KEYS))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command-line entry point: tune, write ``best.json`` and ``tune.txt``, print the table (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "./tune_results"))
    ap.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds (400; dry run 60)")
    ap.add_argument("--dry-run", action="store_true", help="CPU rehearsal under Triton's interpreter, tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.budget_s is None:
        args.budget_s = 60.0 if args.dry_run else 400.0
    t = Tuner(args)
    shapes, ms, space = (DRY_SHAPES, DRY_MS, DRY_SPACE) if t.dry else (REAL_SHAPES, REAL_MS, SPACE)
    results = t.run(shapes, ms, space, gs=128)
    best: dict = {}
    for r in results:
        if r["speedup"] >= 1.03:
            cfg = {kk: r["best"][kk] for kk in KEYS if kk in r["best"]}
            best.setdefault(f"{r['N']},{r['K']}", {})[str(r["M"])] = cfg
    (t.out / "best.json").write_text(json.dumps(best, indent=1, sort_keys=True))
    txt = table(results, t.copy_gbps)
    (t.out / "tune.txt").write_text(txt + "\n")
    print(txt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
