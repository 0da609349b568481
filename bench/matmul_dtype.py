"""Matmul throughput by dtype on this machine: why lite's calibration forwards default to bfloat16 on the CPU.

    python bench/matmul_dtype.py [--m 8192] [--k 576] [--n 1536] [--repeats 5]

Times ``x @ w`` for an ``[m, k]`` activation and a ``[k, n]`` weight (the defaults: 8,192 calibration tokens into
SmolLM2-135M's gate/up projection) in float32 and bfloat16 with torch's own threads, best of ``--repeats``, and prints
GMAC/s (multiply-accumulates per second / 1e9) for each and their ratio.
"""
from __future__ import annotations

import argparse
import time

import torch


def gmacs(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best-of-``repeats`` GMAC/s of an ``[m, k] @ [k, n]`` product in ``dtype``."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    x @ w  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x @ w
        best = min(best, time.perf_counter() - t)
    return m * k * n / best / 1e9


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    f32 = gmacs(a.m, a.k, a.n, torch.float32, a.repeats)
    bf16 = gmacs(a.m, a.k, a.n, torch.bfloat16, a.repeats)
    print(f"{a.m}x{a.k} @ {a.k}x{a.n}, {torch.get_num_threads()} threads: float32 {f32:.0f} GMAC/s, "
          f"bfloat16 {bf16:.0f} GMAC/s, ratio {bf16 / f32:.2f}")


if __name__ == "__main__":
    main()
