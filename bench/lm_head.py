"""The int8 lm_head of a decode step: liteturbo's C++ GEMVs (backends/csrc/w8a16_gemv_cpu.cpp: the tiled VNNI one the
torch backend runs on AVX-512 VNNI CPUs, and the row-major float one it runs elsewhere) against torch's
``aten._weight_int8pack_mm``, side by side in one run, with the copy bandwidth of the same run.

    python bench/lm_head.py [--threads 2] [--rows 1] [--repeats 20] [--json]

Shapes (out x in, int8 codes, bf16 activations and scales): SmolLM2's 49,152-token vocabulary at hidden 2048 (1B/3B
shapes) and 4096 (8B), and Llama-3's 128,256 at 4096. Best of ``--repeats`` calls each, alternating; GB/s are of the
int8 codes (out x in bytes); the copy bandwidth is read + write of a 1 GiB tensor (STREAM's convention). The ratios
are int8pack time / each GEMV's time (above 1: the GEMV is faster); ``max |diff|`` is against int8pack's output.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import cpu_ext  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_gb_s  # noqa: E402

SHAPES = [(49152, 2048), (49152, 4096), (128256, 4096)]


def best_of(fns, repeats: int) -> list[float]:
    """Seconds per call of each function, best of ``repeats`` rounds that call them in turn."""
    for f in fns:
        f()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def main() -> None:
    """Time both kernels on each shape and print the table (or one JSON object; see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="activation rows (1-4: the GEMV's range)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    if ext is None or not ext.has_w8_gemv():
        raise SystemExit("the C++ int8 GEMV is not available here (it needs the extension and AVX-512 F/BW)")
    g = torch.Generator().manual_seed(0)
    rows = []
    tiled = bool(ext.has_w8_tiles())
    copy = copy_gb_s()
    for n, k in SHAPES:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        s = (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16)
        x = torch.randn(args.rows, k, generator=g).to(torch.bfloat16)
        qt = q.view(n // 4, 4, k // 32, 32).transpose(1, 2).contiguous() if tiled else None
        fns = {"int8pack": lambda: torch._weight_int8pack_mm(x, q, s)}
        if args.rows <= 4:
            fns["gemv"] = lambda: ext.w8a16_gemv(x, q, s)
        if tiled:
            fns["tiles"] = lambda: ext.w8a16_tiles_gemv(x, qt, s)
        secs = dict(zip(fns, best_of(list(fns.values()), args.repeats)))
        ref = fns["int8pack"]().float()
        row = dict(out=n, inp=k, rows=args.rows)
        for name, t in secs.items():
            row[f"{name}_ms"], row[f"{name}_gb_s"] = t * 1e3, n * k / t / 1e9
            if name != "int8pack":
                row[f"int8pack_vs_{name}"] = secs["int8pack"] / t
                row[f"{name}_max_abs_diff"] = float((fns[name]().float() - ref).abs().max())
        rows.append(row)
        del qt
    copy_after = copy_gb_s()
    if args.json:
        print(json.dumps(dict(threads=args.threads, copy_gb_s=[copy, copy_after], rows=rows)))
        return
    print(f"{args.threads} threads, {args.rows} row(s); copy bandwidth {copy:.1f} GB/s before, {copy_after:.1f} after")
    names = [n for n in ("tiles", "gemv") if f"{n}_ms" in rows[0]]
    print(f"{'out x in':>14} | {'int8pack ms':>11} {'GB/s':>6} | "
          + " | ".join(f"{n + ' ms':>9} {'GB/s':>6} {'vs int8pack':>11} {'max |diff|':>10}" for n in names))
    for r in rows:
        print(f"{r['out']:>7}x{r['inp']:<6} | {r['int8pack_ms']:11.2f} {r['int8pack_gb_s']:6.1f} | "
              + " | ".join(f"{r[n + '_ms']:9.2f} {r[n + '_gb_s']:6.1f} {r['int8pack_vs_' + n]:10.2f}x "
                           f"{r[n + '_max_abs_diff']:10.2e}" for n in names))

if __name__ == "__main__":
    main()
