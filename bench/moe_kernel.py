"""One MoE layer's experts on the CPU in W4A16: liteturbo's fused ``w4a16_experts_mm`` (all routed rows of all
experts in one call, gate+up with SiLU-and-mul fused, then down) against a Python loop over the experts calling the
dense kernels per expert, side by side in one run on the same random weights and routings.

    python bench/moe_kernel.py [--model qwen3-30b-a3b|olmoe|all] [--case decode|batch8|prefill|all] [--reps 200]
                               [--threads 2] [--json]

Shapes: Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts, top-8) and OLMoE-1B-7B (hidden 2048,
intermediate 1024, 64 experts, top-8), group size 128, bf16 activations; random codes, zero points and scales
(random bytes of the tiled layout are valid codes). Three cases per model:

- ``decode``: batch 1, the token's 8 routed experts (distinct, random): 8 rows.
- ``batch8``: 8 tokens x top-8 = 64 rows sorted by expert (most experts get one row).
- ``prefill``: 512 tokens x top-8 = 4,096 rows.

Fused: ``w4a16_experts_mm(x_rows, ids, gate_up..., act=True)`` then ``w4a16_experts_mm(h, ids, down..., act=False)``.
Loop: per routed expert, the kernel the torch backend picks for its rows (``w4a16_tiles_gemv`` below 6 rows,
``w4a16_tiles_mm`` from 6), ``silu_and_mul``, the down projection the same way, then ``torch.cat`` of the outputs.
The routing (sorting rows by expert, the loop's list of runs) and the weighted sum over the top-k are the same for
both and not timed.

Every call draws a fresh routing, so that the experts' weights (2.5 MB each for Qwen3, 3.3 MB for OLMoE; 320 MB and
215 MB per layer) mostly come from memory rather than from the L3 (32 MB here) a fixed routing would sit in. Times are medians
over ``--reps`` calls after warm-up (prefill: ``--reps // 40``, at least 3), the two paths interleaved call by
call. GB/s = the packed bytes (codes + zero points + scales) of the distinct experts a call reads / its time;
``copy`` = this machine's copy bandwidth measured in the same run (read + write of a 1 GiB tensor, STREAM's
convention, bench/common.py) at the start (and again at the end); ``frac_copy`` = GB/s / copy (the kernels only read,
so above 1 is possible). The 1-minute load average is printed beside: other processes on the cores skew every figure.
Needs the extension on an AVX-512 BF16 CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import common  # noqa: F401  (puts the repository on sys.path)
from common import copy_gb_s
from backends import cpu_ext

MODELS = {
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
    "olmoe": dict(hidden=2048, inter=1024, experts=64, top_k=8),
}
GROUP = 128
CASES = {"decode": 1, "batch8": 8, "prefill": 512}  # tokens


def random_tiles(e: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked tiled W4A16 weights of ``e`` experts ``[n, k]``: any byte is two valid codes."""
    g = k // GROUP
    packed = torch.randint(0, 256, (e, n // 32, k // 4, 64), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (e, n // 32, g, 2, 16), dtype=torch.int16, generator=gen)
    scales = (torch.rand(e, n // 32, g, 2, 16, generator=gen) * 0.02 + 1e-3).bfloat16()
    return packed, zeros, scales


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens * top_k`` rows sorted by expert (each token's ``top_k`` experts distinct): (the token of each row,
    the expert ids int32)."""
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.flatten()
    ids, order = ids.sort(stable=True)
    return order // top_k, ids.to(torch.int32)


def expert_bytes(tiles) -> int:
    """Bytes of one expert's packed codes, zero points and scales."""
    return sum(t[0].nbytes for t in tiles)


def quantile(times: list[float], q: float) -> float:
    """The ``q`` quantile of ``times`` (nearest rank)."""
    s = sorted(times)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    """Time the fused kernel and the per-expert loop for each model and case; print a table or one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=[*MODELS, "all"], default="all")
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--reps", type=int, default=200,
                    help="timed calls of decode (batch8: reps / 4, prefill: reps / 40)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    if ext is None or not hasattr(ext, "w4a16_experts_mm") or not ext.has_w4_experts():
        raise SystemExit("moe_kernel.py needs liteturbo's C++ extension built with AVX-512 BF16 (this CPU lacks it)")
    gen = torch.Generator().manual_seed(0)
    copy = copy_gb_s(1024)
    load = os.getloadavg()[0]
    result = {"threads": args.threads, "group_size": GROUP, "copy_gb_s": round(copy, 2), "load_avg_1min": load,
              "models": {}}
    if not args.json:
        print(f"MoE experts W4A16 g{GROUP}, bf16, {args.threads} threads; copy bandwidth of this run {copy:.1f} GB/s "
              f"(read + write); load average {load:.2f}. ms per layer call (median), GB/s of the distinct experts' "
              f"packed bytes")
    for name in (MODELS if args.model == "all" else [args.model]):
        cfg = MODELS[name]
        h, inter, ne, k = cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"]
        gu = random_tiles(ne, 2 * inter, h, gen)
        dn = random_tiles(ne, h, inter, gen)
        per_expert = expert_bytes(gu) + expert_bytes(dn)
        result["models"][name] = {**cfg, "expert_bytes": per_expert, "cases": {}}
        if not args.json:
            print(f"{name}: hidden {h}, intermediate {inter}, {ne} experts, top-{k}, {per_expert / 1e6:.2f} MB per "
                  f"expert")

        def fused(x, ids, runs):
            y = ext.w4a16_experts_mm(x, ids, *gu, GROUP, True)
            return ext.w4a16_experts_mm(y, ids, *dn, GROUP, False)

        def loop(x, ids, runs):
            outs = []
            r0 = 0
            for e, n in runs:
                xe = x[r0:r0 + n]
                kern = ext.w4a16_tiles_gemv if n < 6 else ext.w4a16_tiles_mm
                g = ext.silu_and_mul(kern(xe, gu[0][e], gu[1][e], gu[2][e], GROUP))
                outs.append(kern(g, dn[0][e], dn[1][e], dn[2][e], GROUP))
                r0 += n
            return torch.cat(outs)

        for case, tokens in CASES.items():
            if args.case not in ("all", case):
                continue
            reps = max(3, args.reps if case == "decode" else args.reps // 4 if case == "batch8" else args.reps // 40)
            warm = max(2, reps // 10)
            draws = [routing(tokens, ne, k, gen) for _ in range(2 * (reps + warm))]
            xs = [torch.randn(tokens, h, generator=gen).bfloat16() for _ in range(4)]

            # draw i: each row holds its token's activations (a token repeated for its k experts), the ids, and the
            # loop's (expert, rows) list, made before the clock starts
            inputs = [(xs[i % len(xs)][tok].contiguous(), ids,
                       list(zip(*(t.tolist() for t in torch.unique_consecutive(ids, return_counts=True)))))
                      for i, (tok, ids) in enumerate(draws)]
            tf, tl = [], []
            for i in range(reps + warm):  # interleaved, each call its own fresh routing
                for fn, times, j in ((fused, tf, 2 * i), (loop, tl, 2 * i + 1)):
                    t = time.perf_counter()
                    fn(*inputs[j])
                    if i >= warm:
                        times.append(time.perf_counter() - t)
            mf, ml = statistics.median(tf), statistics.median(tl)
            distinct = statistics.mean(len(inp[2]) for inp in inputs)
            gbytes = distinct * per_expert / 1e9
            flop = 2 * tokens * k * (h * 2 * inter + inter * h)
            row = {"rows": tokens * k, "distinct_experts": round(distinct, 1), "reps": reps,
                   "fused_ms": round(mf * 1e3, 3), "loop_ms": round(ml * 1e3, 3),
                   "fused_gb_s": round(gbytes / mf, 2), "loop_gb_s": round(gbytes / ml, 2),
                   "fused_frac_copy": round(gbytes / mf / copy, 3), "loop_frac_copy": round(gbytes / ml / copy, 3),
                   "fused_gflop_s": round(flop / mf / 1e9, 1), "speedup": round(ml / mf, 2),
                   "fused_ms_p10": round(quantile(tf, 0.1) * 1e3, 3), "loop_ms_p10": round(quantile(tl, 0.1) * 1e3, 3)}
            result["models"][name]["cases"][case] = row
            if not args.json:
                print(f"  {case:<8} {tokens * k:>5} rows, {distinct:5.1f} experts: fused {mf * 1e3:8.3f} ms "
                      f"{gbytes / mf:6.1f} GB/s ({gbytes / mf / copy:.2f} x copy, {flop / mf / 1e9:6.1f} GFLOP/s)   "
                      f"loop {ml * 1e3:8.3f} ms {gbytes / ml:6.1f} GB/s ({gbytes / ml / copy:.2f} x copy)   "
                      f"loop / fused {ml / mf:.2f}x")
    result["copy_gb_s_end"] = round(copy_gb_s(1024), 2)
    result["load_avg_1min_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"copy bandwidth at the end {result['copy_gb_s_end']:.1f} GB/s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
