"""KV cache dtypes side by side, measured by the engine in one run: capacity, batch-1 decode, batched throughput.

    python bench/kv.py [--w4a16 DIR] [--kv-cache-gib 0.25] [--requests 32] [--prompt-len 128] [--new-tokens 128]
                       [--decode-tokens 128] [--repeats 3] [--threads 2] [--json]

For each KV dtype (bfloat16, int8, int4) on the same W4A16 checkpoint (default: RTN g64 of SmolLM2 made on the
fly; give an AWQ one with ``--w4a16``): the tokens a pool of ``--kv-cache-gib`` holds (and the ratio to bf16);
batch-1 decode tokens/s after a ``--prompt-len`` prompt; ``--requests`` concurrent requests x ``--new-tokens``
output tokens/s. Fresh engine per measurement, best of ``--repeats``; EOS ignored. Ratios are to bf16.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import text_prompts, w4a16_checkpoint

DTYPES = ("bfloat16", "int8", "int4")


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None, help="W4A16 checkpoint (default: RTN g64 of --model)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25, help="pool size for the capacity comparison")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from lite.formats import resolve_model
    from turbo import Engine, EngineConfig, GenerationConfig

    src = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(src), 64, args.w4a16)
    tok = AutoTokenizer.from_pretrained(str(src))
    prompts = text_prompts(tok, args.requests + 1, args.prompt_len)
    n_out = args.requests * args.new_tokens
    pool = args.requests * (args.prompt_len + args.new_tokens) + 1024
    rows = {}
    for kv in DTYPES:
        cap = Engine(w4, EngineConfig(kv_cache_dtype=kv, kv_cache_gib=args.kv_cache_gib)).stats()
        decode, thr = 0.0, 0.0
        for _ in range(args.repeats):
            e = Engine(w4, EngineConfig(kv_cache_dtype=kv, max_kv_tokens=pool, max_batch_size=max(args.requests, 1)))
            e.generate([list(range(1000, 1100))], GenerationConfig(max_new_tokens=4, ignore_eos=True))  # warm-up
            out = e.generate(prompts[-1], GenerationConfig(max_new_tokens=args.decode_tokens, ignore_eos=True))
            decode = max(decode, out.decode_tokens_per_s)
            t = time.perf_counter()
            outs = e.generate(prompts[:args.requests], GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True))
            thr = max(thr, n_out / (time.perf_counter() - t))
            assert sum(len(o.token_ids) for o in outs) == n_out
            del e
        rows[kv] = {"kv_bytes_per_token": cap["kv_bytes_per_token"], "pool_tokens": cap["kv_pool_tokens"],
                    "decode_tok_s": decode, "throughput_tok_s": thr}
    for kv in DTYPES:
        r = rows[kv]
        r["capacity_ratio"] = r["pool_tokens"] / rows["bfloat16"]["pool_tokens"]
        r["decode_ratio"] = r["decode_tok_s"] / rows["bfloat16"]["decode_tok_s"]
        r["throughput_ratio"] = r["throughput_tok_s"] / rows["bfloat16"]["throughput_tok_s"]
    result = {"checkpoint": w4 if args.w4a16 else "RTN g64 (temporary)", "kv_cache_gib": args.kv_cache_gib,
              "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "decode_tokens": args.decode_tokens, "threads": args.threads, "repeats": args.repeats, "kv": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"W4A16 {result['checkpoint']}, {args.threads} threads, best of {args.repeats}; pool {args.kv_cache_gib} GiB; "
          f"throughput {args.requests} x ({args.prompt_len} + {args.new_tokens})")
    print(f"{'KV dtype':9s} {'B/token':>8s} {'pool tokens':>12s} {'x bf16':>7s} {'decode tok/s':>13s} {'x bf16':>7s} "
          f"{'batch tok/s':>12s} {'x bf16':>7s}")
    for kv in DTYPES:
        r = rows[kv]
        print(f"{kv:9s} {r['kv_bytes_per_token']:8d} {r['pool_tokens']:12d} {r['capacity_ratio']:7.2f} "
              f"{r['decode_tok_s']:13.1f} {r['decode_ratio']:7.2f} {r['throughput_tok_s']:12.1f} {r['throughput_ratio']:7.2f}")


if __name__ == "__main__":
    main()
