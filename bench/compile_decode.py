"""torch.compile of the model's forward, on/off: batch-1 decode tokens/s of turbo W4A16 (SmolLM2, RTN g64 made here).

    python bench/compile_decode.py [--threads 2] [--json]

Runs the same engine eager, then with ``model.forward = torch.compile(model.forward, dynamic=True)`` (errors
suppressed, so graph breaks fall back to eager), 128 new tokens after a 40-token prompt, best of 3 after one warm-up
generation (which pays the compile). The C++ CPU kernels are pybind functions that dynamo cannot trace, so each is a
graph break; the script measures what that leaves.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from common import w4a16_checkpoint


def decode_tok_s(engine, repeats: int = 3) -> float:
    """Best batch-1 decode tokens/s of ``engine`` over ``repeats`` generations of 128 tokens (fresh prompts)."""
    from turbo import GenerationConfig

    best = 0.0
    for i in range(repeats):
        out = engine.generate([list(range(2000 + i, 2040 + i))], GenerationConfig(max_new_tokens=128,
                                                                                   ignore_eos=True))[0]
        best = max(best, out.decode_tokens_per_s)
    return best


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lite.formats import resolve_model
    from turbo import Engine, EngineConfig, GenerationConfig

    w4, _tmp = w4a16_checkpoint(str(resolve_model("smollm2-135m-instruct")), 64, None)
    engine = Engine(w4, EngineConfig(max_kv_tokens=4096))
    warm = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    engine.generate([list(range(1000, 1040))], warm)
    r = {"eager_tok_s": decode_tok_s(engine)}
    import torch._dynamo as dynamo

    dynamo.config.suppress_errors = True
    engine.model.forward = torch.compile(engine.model.forward, dynamic=True)
    t = time.perf_counter()
    engine.generate([list(range(1000, 1040))], warm)
    r["compile_warmup_s"] = time.perf_counter() - t
    r["compiled_tok_s"] = decode_tok_s(engine)
    r["ratio_compiled_vs_eager"] = r["compiled_tok_s"] / r["eager_tok_s"]
    if args.json:
        print(json.dumps(r))
        return
    for k, v in r.items():
        print(f"{k:28s} {v:8.2f}")


if __name__ == "__main__":
    main()
