"""turbo alone, 32 concurrent requests x (128 prompt + 128 new tokens), output tok/s: for A/B runs of two checkouts
of liteturbo on the same W4A16 checkpoint (bench/throughput.py also runs the baselines, which take minutes).

    PYTHONPATH=CHECKOUT python bench/throughput_turbo.py W4A16_CHECKPOINT [--repeats 2] [--threads 2]

The liteturbo imported is the one on ``PYTHONPATH`` (run the script from outside the checkouts); the prompts are
bench/common.py's WikiText-2 prompts of this file's checkout. Each repeat builds a fresh engine (no prefix-cache hits
from the previous one), warms it up on other tokens and times one ``generate`` of all requests; the best counts.
Prints the output tokens/s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.append(str(Path(__file__).resolve().parent))  # appended: the imported liteturbo stays PYTHONPATH's


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from common import text_prompts
    from turbo import Engine, EngineConfig, GenerationConfig

    torch.set_num_threads(args.threads)
    prompts = text_prompts(AutoTokenizer.from_pretrained(args.checkpoint), 32, 128)
    gen = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    best = float("inf")
    for _ in range(args.repeats):
        e = Engine(args.checkpoint, EngineConfig(max_kv_tokens=32 * 256 + 1024, max_batch_size=32))
        e.generate([list(range(1000, 1100)), list(range(2000, 2010))], GenerationConfig(max_new_tokens=4,
                                                                                         ignore_eos=True))
        t = time.perf_counter()
        outs = e.generate(prompts, gen)
        best = min(best, time.perf_counter() - t)
        if sum(len(o.token_ids) for o in outs) != 32 * 128:
            raise SystemExit("a request ended early although EOS is ignored")
        del e
    print(f"{32 * 128 / best:.1f}")


if __name__ == "__main__":
    main()
