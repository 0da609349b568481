"""Prefix caching: N requests sharing a long system prompt, with vs without the prefix cache.

    python bench/prefix.py [--requests 16] [--system-tokens 1000] [--question-tokens 32] [--new-tokens 16] [--json]

Reports prefill tokens actually computed and wall time for both, same weights, same threads, same run.
The requests are submitted one after another (each after the previous finished), as chat traffic arrives.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import add_batch_invariant_flag, text_prompts, w4a16_checkpoint


def run(engine, prompts, gen) -> tuple[int, float, list]:
    """Run the requests one after another; (prefill tokens computed, seconds, outputs)."""
    before = engine.stats()["prefill_tokens"]
    t = time.perf_counter()
    outs = [engine.generate(p, gen) for p in prompts]
    return engine.stats()["prefill_tokens"] - before, time.perf_counter() - t, [o.token_ids for o in outs]


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    add_batch_invariant_flag(ap)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lite.formats import resolve_model
    from turbo import Engine, EngineConfig, GenerationConfig

    src = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(src), 64, args.w4a16)
    on = Engine(w4, EngineConfig(max_kv_tokens=8192, batch_invariant=args.batch_invariant))
    off = Engine(w4, EngineConfig(max_kv_tokens=8192, enable_prefix_caching=False,
                                  batch_invariant=args.batch_invariant))
    system = text_prompts(on.tokenizer, 1, args.system_tokens)[0]
    questions = text_prompts(on.tokenizer, args.requests, args.question_tokens, offset=args.system_tokens)
    prompts = [system + q for q in questions]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    for e in (on, off):
        e.generate("warm up", max_new_tokens=2)
    p_off, t_off, o_off = run(off, prompts, gen)
    p_on, t_on, o_on = run(on, prompts, gen)
    r = {"requests": args.requests, "system_tokens": args.system_tokens, "prefill_tokens_without": p_off,
         "prefill_tokens_with": p_on, "seconds_without": t_off, "seconds_with": t_on,
         "speedup": t_off / t_on, "same_outputs": o_on == o_off,
         "batch_invariant": args.batch_invariant}
    if args.json:
        print(json.dumps(r))
        return
    print(f"{args.requests} requests sharing a {args.system_tokens}-token prefix, {args.threads} threads"
          + (", batch_invariant" if args.batch_invariant else ""))
    print(f"without prefix cache: {p_off:6d} prefill tokens, {t_off:6.2f} s")
    print(f"with prefix cache:    {p_on:6d} prefill tokens, {t_on:6.2f} s  ({r['speedup']:.1f}x faster; "
          f"same outputs: {r['same_outputs']})")


if __name__ == "__main__":
    main()
