"""Multi-turn chat: time to first token of the last turn, stateful session vs re-prefilling the history.

    python bench/sessions.py [--turns 8] [--user-tokens 300] [--reply-tokens 32] [--json]

Each user turn is a ~``--user-tokens`` passage of WikiText-2; replies are greedy, ``--reply-tokens`` long. The
stateful run keeps the session's KV cache between turns; the baseline sends the whole conversation to an
engine without prefix caching, as a stateless server would (same weights, same threads, same run). The
conversation is run ``--repeats`` times on fresh engines; each side's best TTFT counts.
"""
from __future__ import annotations

import argparse
import json

import torch

from common import text_prompts, w4a16_checkpoint


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=300)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="whole conversations run; the best TTFT of each side counts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lite.formats import resolve_model
    from turbo import Engine, EngineConfig, GenerationConfig

    src = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(src), 64, args.w4a16)
    kv = args.turns * (args.user_tokens + args.reply_tokens + 64) + 1024
    stateless = Engine(w4, EngineConfig(max_kv_tokens=kv, enable_prefix_caching=False))
    tok = stateless.tokenizer
    passages = [tok.decode(p) for p in text_prompts(tok, args.turns, args.user_tokens)]
    gen = GenerationConfig(max_new_tokens=args.reply_tokens, ignore_eos=True)
    stateless.generate("warm up", max_new_tokens=2)
    best_last, best_base = None, None
    for _ in range(args.repeats):  # a fresh stateful engine each time: no prefix-cache hits across repeats
        stateful = Engine(w4, EngineConfig(max_kv_tokens=kv))
        stateful.generate("warm up", max_new_tokens=2)
        s = stateful.session()
        for p in passages:
            s.chat("Summarise: " + p, gen=gen)
        last = s.last
        history = stateful.chat_template_ids(s.messages[:-1])
        base = stateless.generate(history, gen)
        assert base.cached_tokens == 0
        best_last = last if best_last is None or last.ttft < best_last.ttft else best_last
        best_base = base if best_base is None or base.ttft < best_base.ttft else best_base
        del stateful
    last, base = best_last, best_base
    r = {"turns": args.turns, "history_tokens": len(history), "repeats": args.repeats, "stateful_ttft_s": last.ttft,
         "stateful_prefill_tokens": last.prompt_tokens - last.cached_tokens, "reprefill_ttft_s": base.ttft,
         "reprefill_prefill_tokens": base.prompt_tokens, "ttft_ratio": base.ttft / last.ttft,
         "same_reply": base.token_ids == last.token_ids}
    if args.json:
        print(json.dumps(r))
        return
    print(f"last of {args.turns} turns, history {len(history)} tokens, {args.threads} threads, best of {args.repeats}")
    print(f"stateful session   TTFT {last.ttft * 1000:8.1f} ms  ({r['stateful_prefill_tokens']} tokens prefilled)")
    print(f"re-prefill history TTFT {base.ttft * 1000:8.1f} ms  ({r['reprefill_prefill_tokens']} tokens prefilled)")
    print(f"ratio {r['ttft_ratio']:.1f}x; same reply: {r['same_reply']}")


if __name__ == "__main__":
    main()
