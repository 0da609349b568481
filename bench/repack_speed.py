"""Load-time W4A16 repack for the Triton backend: today's byte-level repack vs the int64 one it replaced.

    python bench/repack_speed.py [--n 14336] [--k 4096] [--threads 2] [--repeat 3] [--json]

Times, on the CPU, for one ``N x K`` weight of uint8 codes (the canonical layout every checkpoint format unpacks
to): the old ``pack_w4`` (codes widened to int64, eight shifted ORs; copied here verbatim as the baseline), the
byte-level ``kernels.pack_w4`` (nibble pairs OR-ed into bytes, viewed as int32, one transpose) and
``w4a16.pack_tiled`` (the layout the Triton backend now loads into). Checks that the old and new ``pack_w4`` give
the same bits, and prints the best of ``--repeat`` runs and the speed-up. The target of issue 22: under 0.5 s for a
14336 x 4096 weight on 2 threads.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def pack_w4_int64(codes: torch.Tensor) -> torch.Tensor:
    """The pre-issue-22 ``kernels.pack_w4`` (int64 widening), kept as the baseline."""
    n, k = codes.shape
    k8 = (k + 7) // 8
    c = torch.zeros(k8 * 8, n, dtype=torch.int64, device=codes.device)
    c[:k] = codes.t().to(torch.int64)
    c = c.view(k8, 8, n)
    words = torch.zeros(k8, n, dtype=torch.int64, device=codes.device)
    for j in range(8):
        words |= c[:, j] << (4 * j)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def _best(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old-repeat", type=int, default=1, help="runs of the (slow) int64 baseline")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from backends.triton import kernels, w4a16

    codes = torch.randint(0, 16, (args.n, args.k), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t_old, ref = _best(lambda: pack_w4_int64(codes), args.old_repeat)
    t_new, new = _best(lambda: kernels.pack_w4(codes), args.repeat)
    t_tiled, tiled = _best(lambda: w4a16.pack_tiled(codes), args.repeat)
    same = torch.equal(ref, new)
    round_trip = torch.equal(w4a16.unpack_tiled(tiled, args.n, args.k), codes)
    res = {"n": args.n, "k": args.k, "threads": args.threads, "old_int64_s": round(t_old, 4),
           "pack_w4_bytes_s": round(t_new, 4), "pack_tiled_s": round(t_tiled, 4),
           "speedup_pack_w4": round(t_old / t_new, 1), "speedup_tiled": round(t_old / t_tiled, 1),
           "same_bits": same, "tiled_round_trip": round_trip, "under_0_5_s": t_tiled < 0.5 and t_new < 0.5}
    print(f"{args.n} x {args.k} codes, {args.threads} threads (best of {args.repeat}; baseline {args.old_repeat} run)")
    print(f"  old pack_w4 (int64 widening)   {t_old:8.3f} s")
    print(f"  pack_w4 (byte level)           {t_new:8.3f} s   {t_old / t_new:6.1f}x   same bits: {same}")
    print(f"  w4a16.pack_tiled (Triton load) {t_tiled:8.3f} s   {t_old / t_tiled:6.1f}x   round trip: {round_trip}")
    if args.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
