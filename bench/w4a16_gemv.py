"""Batch-1 W4A16 on the CPU at Llama-3.1-8B's decoder shapes: liteturbo's C++ GEMV (``w4a16_tiles_gemv``, codes read
in place from the one packed copy) against torch's ``aten._weight_int4pack_mm_for_cpu`` on the same random codes,
group size 128, bf16, side by side in one run (best of 20 calls each; GB/s = packed code bytes / time), with the
copy bandwidth of a 1 GiB tensor measured in the same run (this VM's memory bandwidth swings between runs).

    python bench/w4a16_gemv.py [--threads 2] [--rows 1]

Shapes (out x in): 6144x4096 (fused q/k/v), 28672x4096 (fused gate/up), 4096x14336 (down). The first (12.6 MB of
codes) may sit in a large L3; the other two stream from memory. Needs the extension on an AVX-512 BF16 CPU.
"""
from __future__ import annotations

import argparse
import time

import torch

import common  # noqa: F401  (puts the repository on sys.path)
from common import copy_gb_s
from backends import cpu_ext


def best_ms(fn, n: int = 20) -> float:
    """Fastest of ``n`` calls of ``fn`` after one warm-up, in milliseconds."""
    fn()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    """Time both kernels on the three shapes and print one line per shape (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.load()
    if ext is None or not ext.has_w4_tiles():
        raise SystemExit("w4a16_gemv.py needs liteturbo's C++ extension built with AVX-512 BF16 (this CPU lacks it)")
    gen = torch.Generator().manual_seed(0)
    gs = 128
    copy = copy_gb_s(1024)  # GB/s read + written, 1 GiB
    print(f"W4A16 g{gs}, {args.rows} row(s), bf16, {args.threads} threads (ms per call, GB/s of codes); "
          f"copy bandwidth of this run {copy:.1f} GB/s (read + write)")
    for n, k in [(6144, 4096), (28672, 4096), (4096, 14336)]:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        z = torch.randint(0, 16, (n, k // gs), generator=gen)
        s = (torch.rand(n, k // gs, generator=gen) * 0.02 + 1e-3).bfloat16()
        tiles = cpu_ext.pack_w4_tiles(codes, z, s)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        sz = torch.stack([s.float().T, ((8.0 - z.float()) * s.float()).T], -1).bfloat16().contiguous()
        x = torch.randn(args.rows, k, generator=gen).bfloat16()
        a = best_ms(lambda: ext.w4a16_tiles_gemv(x, *tiles, gs))
        b = best_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, gs, sz))
        gb = n * k / 2 / 1e6
        print(f"{n:>6} x {k:<6} gemv {a:7.3f} ms {gb / a:6.1f} GB/s   int4pack {b:7.3f} ms {gb / b:6.1f} GB/s   "
              f"gemv / int4pack speed {b / a:4.2f}x")


if __name__ == "__main__":
    main()
