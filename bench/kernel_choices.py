"""Kernels timed side by side: the torch backend's CPU choices, and the W4A16 GEMM / paged decode attention of the
backend in use on Llama-3-8B shapes (microseconds per call, achieved GB/s).

    python bench/kernel_choices.py [--suite all|choices|llama3] [--device auto] [--backend auto] [--threads 2] [--json]

``choices`` (CPU, SmolLM2's shapes, the torch backend's switches):

1. W4A16 linear: ``aten._weight_int4pack_mm_for_cpu`` vs dequantize + bf16 GEMM vs liteturbo's C++ tiled W4A16
   GEMM and its GEMV (up to 8 rows; both when the extension builds with AVX-512 BF16), by rows (where
   ``TorchBackend.tiles_min_rows`` and ``dequant_min_rows`` should sit).
2. int8 ``lm_head`` (49152 x 576): ``aten._weight_int8pack_mm`` vs the tiled dequantize + GEMM vs the dense bf16
   table (what a head tied to the embeddings uses from ``TorchBackend.dense_lm_head_min_rows``), by rows.
3. Decode attention (one query per sequence, SmolLM2 heads, bf16): CPU ``scaled_dot_product_attention`` (with a
   padding mask for several rows) vs the backend's two batched matmuls, by batch size and context.

``llama3`` (any device; the backend's own ``w4a16_linear`` and ``attention``, so Triton's kernels on a GPU and the
torch paths on a CPU):

4. W4A16 GEMM g128, K x N = 4096x4096, 4096x14336, 14336x4096, M = 1, 4, 16, 64, 256: time, achieved GB/s (packed
   weight + scales + zero points + activations + output, read once), fraction of the measured device copy bandwidth
   (``dst.copy_(src)`` of 1 GiB, counted as read + write), speedup over the 16-bit ``F.linear`` and over dequantize
   (the backend's own dequantizer) then ``F.linear``.
5. Paged decode attention, 32 query / 8 KV heads of 128 (Llama-3-8B), batch x context (4096 on GPUs): time,
   GB/s of KV read (values and scales), decode rows per second, for 16-bit, int8 and int4 KV.
6. RMSNorm fused with the residual add (hidden 4096) and SiLU-and-mul (14336): the backend's vs the torch
   reference's ops on the same device, M = 1, 16, 256 (whether the Triton kernels are worth keeping on).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts the repository on sys.path)
from backends import KVCacheSpec, get_backend
from backends.torch_backend import (W4TilesHandle, _int8_tiled_mm, dequantize_nibbles, dequantize_tiles,
                                    pack_int4_for_cpu)
from backends.types import AttentionMetadata, QuantizedWeight


def timed(fn, n: int, device: torch.device | None = None) -> float:
    """Mean microseconds over ``n`` calls after 3 warm-up calls (synchronizing a GPU around them)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), 5 if device.type == "cuda" else 2, device)
    return 2 * nbytes / us / 1e3


def dense_dequant(backend, handle, dtype):
    """A function returning the dense ``[N, K]`` weight from ``handle`` with the backend's own dequantizer."""
    from backends.triton.backend import TritonW4Handle

    if isinstance(handle, TritonW4Handle):
        k = backend.kernels
        return lambda: k.dequantize_w4(handle.qweight, handle.scales, handle.zeros, handle.group_size, handle.n,
                                       handle.k, dtype, handle.g_idx).t()
    if isinstance(handle, W4TilesHandle):
        return lambda: dequantize_tiles(handle, dtype)
    if hasattr(handle, "nibbles"):
        return lambda: dequantize_nibbles(handle)
    return lambda: handle.qw.dequantize(dtype)


def llama3_suite(device: torch.device, backend_name: str, quick: bool) -> dict:
    """Sections 4 and 5 of the module docstring."""
    gpu = device.type == "cuda"
    be = get_backend(backend_name, device)
    dtype = torch.float16 if gpu else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    res = {"device": str(device), "backend": be.name, "dtype": str(dtype).replace("torch.", ""),
           "copy_gb_s": copy_bandwidth(device), "w4a16": [], "decode_attention": []}
    g = 128
    reps = 50 if gpu else 3
    shapes = [(4096, 4096), (4096, 14336), (14336, 4096)]
    for k, n in shapes[:1] if quick else shapes:
        qw = QuantizedWeight(4, g, False, torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                             torch.randint(0, 16, (k // g, n), dtype=torch.uint8, generator=gen),
                             (torch.rand(k // g, n, generator=gen) * 0.01).to(dtype))
        h = be.prepare_w4a16(qw, dtype)
        dense = qw.dequantize(dtype).to(device)
        deq = dense_dequant(be, h, dtype)
        del qw
        wbytes = n * k // 2 + (k // g) * n * (2 + 1)  # int4 codes + 16-bit scales + uint8 zero points
        for m in (1, 4, 16, 64, 256):
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            us = timed(lambda: be.w4a16_linear(x, h), reps, device)
            us16 = timed(lambda: F.linear(x, dense), reps, device)
            usdq = timed(lambda: F.linear(x, deq()), max(1, reps // 5), device)
            gbs = (wbytes + 2 * m * (k + n)) / us / 1e3
            res["w4a16"].append({"k": k, "n": n, "m": m, "us": us, "gb_s": gbs, "copy_fraction": gbs / res["copy_gb_s"],
                                 "vs_16bit": us16 / us, "vs_dequant_matmul": usdq / us, "us_16bit": us16,
                                 "us_dequant_matmul": usdq})
        dense = h = deq = None  # free the weights before the next shape
    h_q, kvh, d, bs = 32, 8, 128, 64
    batch, ctx = (16, 4096) if gpu else (4, 1024)
    for kv in ("16bit", "int8", "int4"):
        kvd = {"16bit": str(dtype).replace("torch.", "")}.get(kv, kv)
        nb = batch * ctx // bs
        spec = KVCacheSpec(kvd, nb, bs, 1, kvh, d)
        cache = be.allocate_kv_cache(spec, dtype)
        slots = torch.arange(nb * bs, device=device)
        cache.write(0, torch.randn(nb * bs, kvh, d, device=device, dtype=dtype),
                    torch.randn(nb * bs, kvh, d, device=device, dtype=dtype), slots)
        tables = [list(range(b * ctx // bs, (b + 1) * ctx // bs)) for b in range(batch)]
        q = torch.randn(batch, h_q, d, device=device, dtype=dtype)

        def meta():
            return AttentionMetadata(slots[:batch], list(range(batch + 1)), [ctx] * batch, tables, bs)

        m0 = meta()  # per-step plans are cached in meta.scratch, as the engine does for all layers of a step
        us = timed(lambda: be.attention(q, cache, 0, m0, d ** -0.5), 20 if gpu else 3, device)
        kv_bytes = batch * ctx * 2 * kvh * spec.bytes_per_token_head()
        res["decode_attention"].append({"kv": kvd, "batch": batch, "context": ctx, "us": us,
                                        "gb_s": kv_bytes / us / 1e3, "rows_per_s": batch / us * 1e6})
        cache = None
    # 6. elementwise: the backend's fused ops vs the torch reference's on the same device
    ref = get_backend("torch", device)
    res["elementwise"] = []
    hidden, inter = 4096, 14336
    w = torch.ones(hidden, device=device, dtype=dtype)
    for m in (1, 16, 256):
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        r = torch.randn(m, hidden, device=device, dtype=dtype)
        gu = torch.randn(m, 2 * inter, device=device, dtype=dtype)
        n = 100 if gpu else 5
        for op, f_be, f_ref in (("add_rms_norm", lambda: be.add_rms_norm(x, r, w, 1e-5),
                                 lambda: ref.add_rms_norm(x, r, w, 1e-5)),
                                ("silu_and_mul", lambda: be.silu_and_mul(gu), lambda: ref.silu_and_mul(gu))):
            a, b = timed(f_be, n, device), timed(f_ref, n, device)
            res["elementwise"].append({"op": op, "m": m, "us": a, "us_torch": b, "vs_torch": b / a})
    return res


def choices_suite(threads: int) -> dict:
    """Sections 1-3 of the module docstring (CPU)."""
    from backends import cpu_ext

    gen = torch.Generator().manual_seed(0)
    ext = cpu_ext.load()
    has_tiles = ext is not None and ext.has_w4_tiles()
    res: dict = {"threads": threads, "w4a16": [], "int8_lm_head": [], "decode_attention": []}
    g = 64
    for n_out, k in [(960, 576), (3072, 576), (576, 1536)]:  # fused qkv, fused gate/up, down
        qw = QuantizedWeight(bits=4, group_size=g, sym=False,
                             qweight=torch.randint(0, 16, (n_out, k), dtype=torch.uint8, generator=gen),
                             qzeros=torch.randint(0, 16, (k // g, n_out), dtype=torch.uint8, generator=gen),
                             scales=torch.rand(k // g, n_out, generator=gen) * 0.01)
        h = pack_int4_for_cpu(qw, torch.bfloat16)
        tiles = pack_int4_for_cpu(qw, torch.bfloat16, tiles=True).tiles if has_tiles else None
        for rows in (1, 4, 8, 32, 64, 96, 128, 1024):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            reps = 5 if rows >= 1024 else 30
            a = timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, h.packed, g, h.scale_zeros), reps)
            b = timed(lambda: F.linear(x, dequantize_nibbles(h)), reps)
            c = timed(lambda: ext.w4a16_tiles_mm(x, *tiles, g), reps) if tiles else float("nan")
            d = timed(lambda: ext.w4a16_tiles_gemv(x, *tiles, g), reps) if tiles and rows <= 8 else float("nan")
            res["w4a16"].append({"out": n_out, "in": k, "rows": rows, "int4pack_us": a, "dequant_gemm_us": b,
                                 "tiles_us": c, "gemv_us": d})

    n_vocab, k = 49152, 576
    q = torch.randint(-127, 128, (n_vocab, k), dtype=torch.int8, generator=gen)
    s = (torch.rand(n_vocab, generator=gen) * 0.01).bfloat16()
    dense = (q.float() * s.float().unsqueeze(1)).bfloat16()
    q8_tiles = (q.view(n_vocab // 4, 4, k // 32, 32).transpose(1, 2).contiguous()
                if ext is not None and ext.has_w8_tiles() else None)
    for rows in (1, 8, 12, 16, 32, 48):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        a = timed(lambda: torch.ops.aten._weight_int8pack_mm(x, q, s), 5)
        b = timed(lambda: _int8_tiled_mm(x, lambda i, j: q[i:j], s, q.shape), 5)
        c = timed(lambda: F.linear(x, dense), 5)
        d = timed(lambda: ext.w8a16_tiles_gemv(x, q8_tiles, s), 5) if q8_tiles is not None else float("nan")
        res["int8_lm_head"].append({"rows": rows, "int8pack_us": a, "tiled_dequant_gemm_us": b, "dense_bf16_us": c,
                                    "w8_tiles_gemv_us": d})

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

    return res


def print_choices(res: dict) -> None:
    print(f"torch backend kernel choices, bf16, {res['threads']} threads (microseconds per call)")
    print(f"{'W4A16 out x in':>16} {'rows':>5} {'int4pack':>10} {'dequant+GEMM':>13} {'C++ tiles':>10} "
          f"{'C++ GEMV':>9}")
    for r in res["w4a16"]:
        print(f"{r['out']:>9} x {r['in']:<4} {r['rows']:>5} {r['int4pack_us']:>10.0f} {r['dequant_gemm_us']:>13.0f} "
              f"{r['tiles_us']:>10.0f} {r['gemv_us']:>9.0f}")
    print(f"{'int8 lm_head rows':>22} {'int8pack':>10} {'tiled':>10} {'dense bf16':>11}")
    for r in res["int8_lm_head"]:
        print(f"{r['rows']:>22} {r['int8pack_us']:>10.0f} {r['tiled_dequant_gemm_us']:>10.0f} "
              f"{r['dense_bf16_us']:>11.0f}")
    print(f"{'decode attention batch':>22} {'context':>8} {'SDPA':>10} {'matmuls':>10}")
    for r in res["decode_attention"]:
        print(f"{r['batch']:>22} {r['context']:>8} {r['sdpa_us']:>10.0f} {r['matmuls_us']:>10.0f}")


def print_llama3(res: dict) -> None:
    print(f"\n{res['backend']} backend on {res['device']}, {res['dtype']}; device copy bandwidth "
          f"{res['copy_gb_s']:.1f} GB/s")
    print(f"{'W4A16 g128  K x N':>20} {'M':>4} {'us':>9} {'GB/s':>8} {'of copy':>8} {'x 16-bit':>9} {'x deq+mm':>9}")
    for r in res["w4a16"]:
        print(f"{r['k']:>11} x {r['n']:<6} {r['m']:>4} {r['us']:>9.1f} {r['gb_s']:>8.1f} {r['copy_fraction']:>8.0%} "
              f"{r['vs_16bit']:>8.2f}x {r['vs_dequant_matmul']:>8.2f}x")
    print(f"{'decode attention KV':>20} {'batch':>6} {'context':>8} {'us':>9} {'GB/s':>8} {'rows/s':>9}")
    for r in res["decode_attention"]:
        print(f"{r['kv']:>20} {r['batch']:>6} {r['context']:>8} {r['us']:>9.1f} {r['gb_s']:>8.1f} "
              f"{r['rows_per_s']:>9.0f}")


def print_elementwise(res: dict) -> None:
    print(f"{'elementwise op':>20} {'M':>4} {'us':>9} {'torch us':>9} {'speedup':>8}")
    for r in res.get("elementwise", []):
        print(f"{r['op']:>20} {r['m']:>4} {r['us']:>9.1f} {r['us_torch']:>9.1f} {r['vs_torch']:>7.2f}x")


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("all", "choices", "llama3"), default="all")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="llama3 suite: the 4096x4096 shape only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from backends import current_platform

    plat = current_platform(args.device)
    out = {"platform": plat.name}
    if args.suite in ("all", "choices") and plat.kind == "cpu":
        out["choices"] = choices_suite(args.threads)
    if args.suite in ("all", "llama3"):
        out["llama3"] = llama3_suite(plat.device, args.backend, args.quick)
    if args.json:
        print(json.dumps(out))
        return
    if "choices" in out:
        print_choices(out["choices"])
    if "llama3" in out:
        print_llama3(out["llama3"])
        print_elementwise(out["llama3"])


if __name__ == "__main__":
    main()
