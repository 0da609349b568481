"""Batch-1 decode speed: turbo (16-bit and W4A16) vs transformers ``generate``, side by side in one run.

    python bench/decode.py [--model smollm2-135m-instruct] [--threads 2] [--new-tokens 128] [--json]

Decode tokens/s = (new tokens - 1) / (time after the first token). For transformers that is
``(N - 1) / (t(generate N tokens) - t(generate 1 token))`` with ``min_new_tokens = N``; turbo reports it
directly. Each engine is warmed up once; the best of ``--repeats`` runs is kept.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Write a short story about a robot who learns to paint."


def bench_turbo(path, n_new: int, repeats: int, **engine_kw) -> float:
    """Best decode tokens/s of turbo over ``repeats`` runs."""
    from turbo import Engine, GenerationConfig

    engine = Engine(path, **engine_kw)
    ids = engine.chat_template_ids([{"role": "user", "content": PROMPT}])
    gen = GenerationConfig(max_new_tokens=n_new, ignore_eos=True)
    engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    best = 0.0
    for _ in range(repeats):
        out = engine.generate(ids, gen)
        assert len(out.token_ids) == n_new
        best = max(best, out.decode_tokens_per_s)
    return best


def bench_transformers(path, n_new: int, repeats: int, dtype: torch.dtype) -> float:
    """Best decode tokens/s of transformers generate over ``repeats`` runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    inputs = tok(text, return_tensors="pt", add_special_tokens=False)

    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=tok.eos_token_id)
        return time.perf_counter() - t

    run(8)
    best = 0.0
    for _ in range(repeats):
        t1, tn = run(1), run(n_new)
        best = max(best, (n_new - 1) / max(tn - t1, 1e-9))
    return best


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None, help="W4A16 checkpoint (default: RTN g64 of --model, made here)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from lite.formats import resolve_model
    from lite.quantize import QuantConfig, quantize_checkpoint

    path = resolve_model(args.model)
    tmp = None
    w4 = args.w4a16
    if w4 is None:
        tmp = tempfile.TemporaryDirectory()
        w4 = quantize_checkpoint(str(path), QuantConfig(w_group_size=args.group_size,
                                                        work_dir=str(Path(tmp.name) / "w4a16")))
    r = {"model": str(args.model), "threads": args.threads, "new_tokens": args.new_tokens}
    r["turbo_w4a16_tok_s"] = bench_turbo(w4, args.new_tokens, args.repeats)
    r["turbo_w4a16_lm_head_16bit_tok_s"] = bench_turbo(w4, args.new_tokens, args.repeats, lm_head="16bit")
    r["turbo_bf16_tok_s"] = bench_turbo(path, args.new_tokens, args.repeats, dtype="bfloat16")
    r["transformers_bf16_tok_s"] = bench_transformers(path, args.new_tokens, args.repeats, torch.bfloat16)
    r["transformers_fp32_tok_s"] = bench_transformers(path, args.new_tokens, args.repeats, torch.float32)
    r["ratio_turbo_w4a16_vs_transformers_bf16"] = r["turbo_w4a16_tok_s"] / r["transformers_bf16_tok_s"]
    r["ratio_turbo_bf16_vs_transformers_bf16"] = r["turbo_bf16_tok_s"] / r["transformers_bf16_tok_s"]
    r["ratio_turbo_w4a16_vs_transformers_fp32"] = r["turbo_w4a16_tok_s"] / r["transformers_fp32_tok_s"]
    if args.json:
        print(json.dumps(r))
        return
    print(f"batch-1 decode, {args.model}, {args.threads} threads, {args.new_tokens} new tokens (best of {args.repeats})")
    print(f"{'engine':44s} {'tok/s':>8s}")
    for k in ("turbo_w4a16_tok_s", "turbo_w4a16_lm_head_16bit_tok_s", "turbo_bf16_tok_s", "transformers_bf16_tok_s",
              "transformers_fp32_tok_s"):
        print(f"{k[:-6]:44s} {r[k]:8.1f}")
    for k in ("ratio_turbo_w4a16_vs_transformers_bf16", "ratio_turbo_bf16_vs_transformers_bf16",
              "ratio_turbo_w4a16_vs_transformers_fp32"):
        print(f"{k:44s} {r[k]:8.2f}x")


if __name__ == "__main__":
    main()
