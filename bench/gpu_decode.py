"""Decode speed of a W4A16 checkpoint through the engine, per backend, side by side in one run.

    python bench/gpu_decode.py MODEL_DIR [--device cuda] [--backends triton,torch] [--kv bfloat16,int8,int4]
                               [--new-tokens 128] [--requests 32] [--prompt-len 128] [--json]

For each backend and KV dtype: batch-1 decode tokens/s (one request, ``--new-tokens`` greedy tokens after a
``--prompt-len`` prompt) and output tokens/s of ``--requests`` requests of ``--prompt-len`` + ``--new-tokens``
run together. Prompts are random token ids (the checkpoint may be random weights; EOS is ignored), the same ids
for every configuration. Made for ``bench/gpu.sh`` on a Llama-3-8B-shaped random W4A16 model; runs on CPU too.
MODEL_DIR needs tokenizer files (``bench/gpu.sh`` writes a word-level one beside random weights).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import common  # noqa: F401  (puts the repository on sys.path)
from turbo import Engine, EngineConfig


def run(model: str, device: str, backend: str, kv: str, prompt_len: int, new_tokens: int, requests: int,
        max_kv_tokens: int) -> dict:
    engine = Engine(model, EngineConfig(device=device, backend=backend, kv_cache_dtype=kv, max_kv_tokens=max_kv_tokens,
                                        max_batch_size=max(requests, 1), max_num_batched_tokens=4096))
    vocab = min(engine.model.cfg.vocab_size, len(engine.tokenizer))  # ids the tokenizer can decode
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    sync = torch.cuda.synchronize if engine.backend.device.type == "cuda" else (lambda: None)
    engine.generate(prompts[0][:16], max_new_tokens=4, ignore_eos=True)  # warm-up (kernel compilation)
    out = engine.generate(prompts[0], max_new_tokens=new_tokens, ignore_eos=True)
    batch1 = out.decode_tokens_per_s
    sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    sync()
    wall = time.perf_counter() - t
    total = sum(len(o.token_ids) for o in outs)
    return {"backend": engine.backend.name, "kv": engine.kv_cache_dtype, "dtype": str(engine.dtype).replace("torch.", ""),
            "batch1_decode_tok_s": batch1, "requests": requests, "throughput_tok_s": total / wall,
            "ttft_batch1_ms": out.ttft * 1e3}


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument("--kv", default="auto,int8,int4")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    kv_tokens = (args.prompt_len + args.new_tokens + 64) * args.requests
    for backend in args.backends.split(","):
        for kv in args.kv.split(","):
            r = run(args.model, args.device, backend, kv, args.prompt_len, args.new_tokens, args.requests, kv_tokens)
            rows.append(r)
            if not args.json:
                print(f"{r['backend']:>7} KV {r['kv']:>8} {r['dtype']}: batch-1 decode {r['batch1_decode_tok_s']:8.1f} "
                      f"tok/s; {r['requests']} x ({args.prompt_len}+{args.new_tokens}) {r['throughput_tok_s']:8.1f} "
                      f"output tok/s", flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
