"""The C++ CPU kernels (backends/csrc/ops_cpu.cpp) against the torch ops they replace, side by side in one run.

    python bench/cpu_ops.py [--threads 2] [--json]

SmolLM2 shapes (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536), bfloat16: RMSNorm, residual add +
RMSNorm, rotary of q and k read from a fused QKV output, SiLU-and-mul, for 1, 32 and 512 rows; decode attention over
a 16-bit paged cache for 1 row x 60 / 1,000 tokens and 32 rows x 256 tokens (vs the torch backend's gather +
batched matmuls), causal prefill attention of 128 and 512 tokens (vs SDPA). Best of 50 (20 / 10 for attention)
calls, in microseconds; the ratio is torch / C++ (above 1: the C++ kernel is faster). The torch backend uses the
fused norms, rotary and paged attention for every step, and not the C++ SiLU-and-mul (slower than torch's
vectorized one here).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import TorchBackend  # noqa: E402


def best_us(fn, n: int = 50) -> float:
    fn()
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - a)
    return min(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fast, ref = TorchBackend("cpu"), TorchBackend("cpu", cpu_kernels=False)
    if fast.ext is None:
        sys.exit("the C++ CPU extension could not be built here (see the warning above)")
    ext, bf = fast.ext, torch.bfloat16
    rows = []
    for t in (1, 32, 512):
        x, res, w = torch.randn(t, 576).to(bf), torch.randn(t, 576).to(bf), torch.randn(576).to(bf)
        gu = torch.randn(t, 3072).to(bf)
        qkv = torch.randn(t, 960).to(bf)
        q, k = qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64)
        cos, sin = torch.randn(t, 1, 64).to(bf), torch.randn(t, 1, 64).to(bf)
        cases = {"rms_norm": (lambda: ext.rms_norm(x, w, 1e-5), lambda: ref.rms_norm(x, w, 1e-5)),
                 "add_rms_norm": (lambda: ext.add_rms_norm(x, res, w, 1e-5), lambda: ref.add_rms_norm(x, res, w, 1e-5)),
                 "rotary_q_k": (lambda: (ext.rotary(q, cos, sin), ext.rotary(k, cos, sin)),
                                lambda: ref.rotary(q, k, cos, sin)),
                 "silu_and_mul": (lambda: ext.silu_and_mul(gu), lambda: ref.silu_and_mul(gu))}
        for name, (a, b) in cases.items():
            ca, cb = best_us(a), best_us(b)
            rows.append({"op": name, "shape": f"{t} rows", "cpp_us": ca, "torch_us": cb, "ratio": cb / ca})
    bs = 16
    kc = torch.randn(3, 32 * 1024, 64).to(bf)
    vc = torch.randn_like(kc)
    for b, length in ((1, 60), (1, 1000), (32, 256)):
        q = torch.randn(b, 9, 64).to(bf)
        slots = torch.stack([torch.arange(length) + i * 1024 for i in range(b)])
        tables = (slots[:, ::bs] // bs).int()
        row_seq, row_len = torch.arange(b, dtype=torch.int32), torch.full((b,), length, dtype=torch.int32)

        def torch_path():  # the torch backend's batched decode: gather, matmul, float32 softmax, matmul
            kb = kc.index_select(1, slots.view(-1)).view(3, b, length, 64)
            vb = vc.index_select(1, slots.view(-1)).view(3, b, length, 64)
            s = torch.matmul(q.view(b, 3, 3, 64).transpose(0, 1), kb.transpose(-1, -2)).float().mul_(0.125)
            return torch.matmul(torch.softmax(s, -1).to(bf), vb)
        ca = best_us(lambda: ext.paged_attention(q, kc, vc, tables, bs, row_seq, row_len, 0.125), 20)
        cb = best_us(torch_path, 20)
        rows.append({"op": "decode_attention", "shape": f"{b} x {length} tokens", "cpp_us": ca, "torch_us": cb,
                     "ratio": cb / ca})
    for length in (128, 512):  # a causal prefill of one sequence vs SDPA on its K/V (no gather counted)
        q = torch.randn(length, 9, 64).to(bf)
        tables = torch.arange((length + bs - 1) // bs, dtype=torch.int32).unsqueeze(0)
        row_seq, row_len = torch.zeros(length, dtype=torch.int32), torch.arange(1, length + 1, dtype=torch.int32)
        kb, vb = kc[:, :length].unsqueeze(0), vc[:, :length].unsqueeze(0)
        ca = best_us(lambda: ext.paged_attention(q, kc, vc, tables, bs, row_seq, row_len, 0.125), 10)
        cb = best_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), kb, vb, is_causal=True, scale=0.125, enable_gqa=True), 10)
        rows.append({"op": "prefill_attention", "shape": f"{length} tokens", "cpp_us": ca, "torch_us": cb,
                     "ratio": cb / ca})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'op':<18}{'shape':<16}{'C++ us':>10}{'torch us':>10}{'torch/C++':>11}")
    for r in rows:
        print(f"{r['op']:<18}{r['shape']:<16}{r['cpp_us']:>10.1f}{r['torch_us']:>10.1f}{r['ratio']:>10.2f}x")


if __name__ == "__main__":
    main()
