"""Kernel choices of the torch backend, timed side by side (microseconds per call).

    python bench/kernels.py [--threads 2] [--json]

1. W4A16 linear on SmolLM2's shapes: ``aten._weight_int4pack_mm_for_cpu`` vs dequantize + bf16 GEMM, by rows
   (where ``TorchBackend.dequant_min_rows`` should sit).
2. int8 ``lm_head`` (49152 x 576): ``aten._weight_int8pack_mm`` vs the tiled dequantize + GEMM, by rows.
3. Decode attention (one query per sequence, SmolLM2 heads, bf16): CPU ``scaled_dot_product_attention`` (with a
   padding mask for several rows) vs the backend's two batched matmuls, by batch size and context.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts the repository on sys.path)
from backends.torch_backend import _int8_tiled_mm, dequantize_nibbles, pack_int4_for_cpu
from backends.types import QuantizedWeight


def timed(fn, n: int) -> float:
    """Mean microseconds over ``n`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    res: dict = {"threads": args.threads, "w4a16": [], "int8_lm_head": [], "decode_attention": []}

    g = 64
    for n_out, k in [(960, 576), (3072, 576), (576, 1536)]:  # fused qkv, fused gate/up, down
        qw = QuantizedWeight(bits=4, group_size=g, sym=False,
                             qweight=torch.randint(0, 16, (n_out, k), dtype=torch.uint8, generator=gen),
                             qzeros=torch.randint(0, 16, (k // g, n_out), dtype=torch.uint8, generator=gen),
                             scales=torch.rand(k // g, n_out, generator=gen) * 0.01)
        h = pack_int4_for_cpu(qw, torch.bfloat16)
        for rows in (1, 32, 64, 96, 128, 1024):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            reps = 5 if rows >= 1024 else 30
            a = timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, h.packed, g, h.scale_zeros), reps)
            b = timed(lambda: F.linear(x, dequantize_nibbles(h)), reps)
            res["w4a16"].append({"out": n_out, "in": k, "rows": rows, "int4pack_us": a, "dequant_gemm_us": b})

    n_vocab, k = 49152, 576
    q = torch.randint(-127, 128, (n_vocab, k), dtype=torch.int8, generator=gen)
    s = (torch.rand(n_vocab, generator=gen) * 0.01).bfloat16()
    for rows in (1, 8, 12, 32):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        a = timed(lambda: torch.ops.aten._weight_int8pack_mm(x, q, s), 5)
        b = timed(lambda: _int8_tiled_mm(x, q, s), 5)
        res["int8_lm_head"].append({"rows": rows, "int8pack_us": a, "tiled_dequant_gemm_us": b})

    kvh, grp, d = 3, 3, 64
    for batch, length in ((1, 64), (1, 192), (8, 192), (32, 192)):
        qq = torch.randn(batch, kvh * grp, d, generator=gen).bfloat16()
        kk = torch.randn(kvh, batch, length, d, generator=gen).bfloat16()
        vv = torch.randn(kvh, batch, length, d, generator=gen).bfloat16()
        pad = torch.zeros(1, batch, 1, length, dtype=torch.bool)
        if batch > 1:
            pad[0, ::2, 0, length - 40:] = True  # every other row is 40 tokens shorter
        # a lone row needs no mask (the backend then runs SDPA on its exact context)
        mask = None if batch == 1 else ~pad.view(batch, 1, 1, length)

        def sdpa():
            return F.scaled_dot_product_attention(qq.unsqueeze(2), kk.transpose(0, 1), vv.transpose(0, 1),
                                                  attn_mask=mask, enable_gqa=True)

        def matmuls():
            qb = qq.view(batch, kvh, grp, d).transpose(0, 1)
            sc = torch.matmul(qb, kk.transpose(-1, -2)).float().mul_(d ** -0.5).masked_fill_(pad, float("-inf"))
            return torch.matmul(torch.softmax(sc, -1).bfloat16(), vv)

        res["decode_attention"].append({"batch": batch, "context": length, "sdpa_us": timed(sdpa, 100),
                                        "matmuls_us": timed(matmuls, 100)})

    if args.json:
        print(json.dumps(res))
        return
    print(f"torch backend kernel choices, bf16, {args.threads} threads (microseconds per call)")
    print(f"{'W4A16 out x in':>16} {'rows':>5} {'int4pack':>10} {'dequant+GEMM':>13}")
    for r in res["w4a16"]:
        print(f"{r['out']:>9} x {r['in']:<4} {r['rows']:>5} {r['int4pack_us']:>10.0f} {r['dequant_gemm_us']:>13.0f}")
    print(f"{'int8 lm_head rows':>22} {'int8pack':>10} {'tiled':>10}")
    for r in res["int8_lm_head"]:
        print(f"{r['rows']:>22} {r['int8pack_us']:>10.0f} {r['tiled_dequant_gemm_us']:>10.0f}")
    print(f"{'decode attention batch':>22} {'context':>8} {'SDPA':>10} {'matmuls':>10}")
    for r in res["decode_attention"]:
        print(f"{r['batch']:>22} {r['context']:>8} {r['sdpa_us']:>10.0f} {r['matmuls_us']:>10.0f}")


if __name__ == "__main__":
    main()
