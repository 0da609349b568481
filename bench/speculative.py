"""Speculative decoding from the request's own history (prompt lookup): greedy decode tokens/s with and without it,
in one run, on an input-grounded workload (rewriting, correcting or continuing a given text, a code edit) and on
free chat; tokens compared one for one.

    python bench/speculative.py [--checkpoint DIR] [--speculative 2] [--max-new-tokens 160] [--repeats 2] [--json]
    python bench/speculative.py --break-even [--checkpoint DIR] [--json]

Without ``--checkpoint`` the embedded SmolLM2-135M-Instruct is quantized (RTN W4A16 g64) into a temporary folder.
Batch 1, the engine's default dtype, 2 threads. For each workload: every prompt decoded with ``speculative=0`` and
with ``speculative=K``, best of ``--repeats``; tokens/s = the workload's generated tokens after the first / the
time after the first. The last JSON line has ``speedup_input_grounded``, ``speedup_free_chat``, ``identical`` (every
prompt's tokens equal with and without) and the acceptance rates (accepted / drafted tokens).

``--break-even``: the time of one forward of M new tokens (M = 1, 2, 3, 5, 9, 17) after a 256-token cached prefix
(best of 6): what a verify step of M - 1 drafts costs against a 1-token decode step.
"""
from __future__ import annotations

import argparse
import json

from common import add_batch_invariant_flag, w4a16_checkpoint

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
           "great lens, and wrote the weather in his log: wind from the west, clouds low, a fishing boat returning "
           "late. In winter the storms shook the tower and the glass rattled in its frame, but the light never failed.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) ** 2
    return total / len(values)
'''
GROUNDED = [
    "Repeat this text exactly, word for word:\n\n" + PASSAGE,
    "Correct the spelling mistakes in this text and write it out again in full:\n\n"
    + PASSAGE.replace("climbed", "climed").replace("polished", "polised").replace("weather", "wether"),
    "Rewrite this text in the past perfect tense, keeping every detail:\n\n" + PASSAGE,
    "Rename the variable `total` to `acc` in this code and write the whole code again:\n\n" + CODE,
]
FREE = ["Write a short poem about the sea.", "What are three tips for learning a new language?",
        "Tell me a story about a dragon who loves books.", "Explain why the sky is blue."]


def _run(engine, prompts, k: int, max_new: int, repeats: int):
    """(tokens/s after the first token, every prompt's token ids, the speculation counters) of the best repeat."""
    from turbo import GenerationConfig
    best = None
    for _ in range(repeats):
        c0 = engine.counters.as_dict()
        outs = [engine.generate(p, GenerationConfig(max_new_tokens=max_new, speculative=k)) for p in prompts]
        tokens = sum(len(o.token_ids) - 1 for o in outs)
        secs = sum(o.decode_seconds for o in outs)
        c = {n: getattr(engine.counters, n) - c0[n] for n in ("spec_drafted", "spec_accepted", "spec_steps")}
        r = (tokens / secs, [o.token_ids for o in outs], c)
        best = r if best is None or r[0] > best[0] else best
    return best


def break_even(engine) -> dict:
    """Milliseconds of one step computing M new tokens after a cached 256-token prefix, for a few M."""
    from turbo import GenerationConfig
    base = engine.encode(" ".join(["word"] * 400))[:256]
    engine.generate(base + [5], max_new_tokens=1)
    out = {}
    for m in (1, 2, 3, 5, 9, 17):
        best = float("inf")
        for r in range(6):
            o = engine.generate(base + [100 + r + i for i in range(m)], GenerationConfig(max_new_tokens=1))
            assert o.cached_tokens == 256, o.cached_tokens  # only the M new tokens were computed
            best = min(best, o.ttft)
        out[m] = round(best * 1000, 2)
    return out


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--speculative", type=int, default=2, help="draft tokens per step (2: the best here, see docs)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    add_batch_invariant_flag(ap)
    ap.add_argument("--break-even", action="store_true", help="time one forward of M new tokens instead")
    args = ap.parse_args()
    from turbo import Engine
    path, _tmp = w4a16_checkpoint("smollm2-135m-instruct", 64, args.checkpoint)
    engine = Engine(path, threads=2, batch_invariant=args.batch_invariant)
    engine.generate("warm up", max_new_tokens=4)
    if args.break_even:
        ms = break_even(engine)
        print(json.dumps({"step_ms_by_new_tokens": ms}) if args.json else
              "\n".join(f"M = {m:2d}: {t:7.2f} ms" for m, t in ms.items()))
        return
    out = {}
    identical = True
    for name, msgs in (("input_grounded", GROUNDED), ("free_chat", FREE)):
        prompts = [engine.chat_template_ids([{"role": "user", "content": m}]) for m in msgs]
        base = _run(engine, prompts, 0, args.max_new_tokens, args.repeats)
        spec = _run(engine, prompts, args.speculative, args.max_new_tokens, args.repeats)
        same = base[1] == spec[1]
        identical &= same
        c = spec[2]
        out[name] = {"baseline_tok_s": round(base[0], 1), "speculative_tok_s": round(spec[0], 1),
                     "speedup": round(spec[0] / base[0], 3), "identical": same,
                     "acceptance": round(c["spec_accepted"] / max(c["spec_drafted"], 1), 3),
                     "tokens_per_step": round((c["spec_accepted"] + c["spec_steps"]) / max(c["spec_steps"], 1), 2)}
        print(json.dumps({"workload": name, **out[name]}) if args.json else
              f"{name:15s} {base[0]:7.1f} -> {spec[0]:7.1f} tok/s ({spec[0] / base[0]:.2f}x), identical {same}, "
              f"acceptance {out[name]['acceptance']:.2f}, {out[name]['tokens_per_step']} tokens per verify step")
    print(json.dumps({"speedup_input_grounded": out["input_grounded"]["speedup"],
                      "speedup_free_chat": out["free_chat"]["speedup"], "identical": identical,
                      "acceptance_input_grounded": out["input_grounded"]["acceptance"],
                      "acceptance_free_chat": out["free_chat"]["acceptance"], "speculative": args.speculative}))


if __name__ == "__main__":
    main()
