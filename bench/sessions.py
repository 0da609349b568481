"""Multi-turn chat: time to first token of the last turn, stateful session vs re-prefilling the history; and, with
``--tiers``, the next turn of a session whose KV the pool evicted: restored from the host tier vs recomputed.

    python bench/sessions.py [--turns 8] [--user-tokens 300] [--reply-tokens 32] [--json]
    python bench/sessions.py --tiers [--sessions 6] [--history-tokens 2000] [--json]

``--tiers``: ``--sessions`` sessions, each with a ``--history-tokens`` first turn (WikiText-2), on a pool that holds
half of them, in up to four engines of one run (``--engines``, default all): with a host tier
(``session_host_gib=2``), with the disk tier only (each session saved with its KV after its turn, as
``--session-dir`` does), with neither (the evicted history is recomputed), and with a pool that holds them all (the
reference: never evicted). Then a short next turn on each of the first half (evicted) sessions; TTFT (best of them)
and replies compared (a key is null when an engine it needs was not run). At 8B shapes:
``--model ~/.cache/liteturbo/synthetic/8b-smollm2-s0 --w4a16 W4A16 --history-tokens 4096 --sessions 2 --engines
host_tier,recompute`` (bench/synthetic.py, docs/scale.md). Its last JSON line has
``host_restore_vs_recompute_ttft``, ``disk_restore_vs_recompute_ttft`` and ``identical`` (the replies after a host-
or disk-tier restore equal the never-evicted ones; ``recomputed_identical`` says the
same of the recomputed ones, which in 16-bit can differ: a prefill of the whole history rounds differently from the
decode steps that wrote the original KV).

Each user turn is a ~``--user-tokens`` passage of WikiText-2; replies are greedy, ``--reply-tokens`` long. The
stateful run keeps the session's KV cache between turns; the baseline sends the whole conversation to an
engine without prefix caching, as a stateless server would (same weights, same threads, same run). The
conversation is run ``--repeats`` times on fresh engines; each side's best TTFT counts.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from common import text_prompts, w4a16_checkpoint


TIER_ENGINES = ("host_tier", "disk_tier", "recompute", "never_evicted")


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
    ap.add_argument("--tiers", action="store_true", help="measure the host tier of session KV (see above)")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--history-tokens", type=int, default=2000)
    ap.add_argument("--engines", default=",".join(TIER_ENGINES),
                    help="--tiers: which of the engines to run (comma-separated; fewer for large models)")
    args = ap.parse_args()
    bad = sorted(set(args.engines.split(",")) - set(TIER_ENGINES))
    if bad or not args.engines:
        ap.error(f"--engines: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(TIER_ENGINES)}")
    if args.sessions < 2:
        ap.error("--sessions must be >= 2 (the pool holds half of them; the later half evicts the earlier)")
    torch.set_num_threads(args.threads)
    if args.tiers:
        return tiers(args)
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


def tiers(args) -> None:
    """The ``--tiers`` run (see the module docstring)."""
    from lite.formats import resolve_model
    from turbo import Engine, EngineConfig, GenerationConfig

    w4, _tmp = w4a16_checkpoint(str(resolve_model(args.model)), 64, args.w4a16)
    per = args.history_tokens + 200
    held = args.sessions // 2  # sessions the pool holds: the later ones evict the first `held`
    engines = {"host_tier": EngineConfig(max_kv_tokens=held * per, session_host_gib=2.0),
               "disk_tier": EngineConfig(max_kv_tokens=held * per),  # sessions saved with their KV after each turn
               "recompute": EngineConfig(max_kv_tokens=held * per),
               "never_evicted": EngineConfig(max_kv_tokens=(args.sessions + 1) * per)}
    engines = {k: v for k, v in engines.items() if k in args.engines.split(",")}
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    out = {}
    for name, cfg in engines.items():
        e = Engine(w4, cfg)
        e.generate("warm up", max_new_tokens=2)
        tok = e.tokenizer
        passages = [tok.decode(p) for p in text_prompts(tok, args.sessions, args.history_tokens)]
        ss = [e.session(system=f"You are reader number {i}.") for i in range(args.sessions)]
        saves = tempfile.TemporaryDirectory()
        for i, (s, p) in enumerate(zip(ss, passages)):
            s.chat("Remember this text: " + p, gen=gen)
            if name == "disk_tier":  # what --session-dir does after every turn
                s.save(Path(saves.name) / f"s{i}", include_kv=True)
        nxt = []
        for s in ss[:held]:  # evicted by the later ones (except in the reference)
            s.chat("In one line, what was it about?", gen=gen)
            nxt.append((s.last.ttft, s.last.cached_tokens, s.last.prompt_tokens, s.last.token_ids))
        out[name] = {"ttft_s": min(t for t, *_ in nxt), "cached_tokens": [c for _, c, *_ in nxt],
                     "prompt_tokens": [p for _, _, p, _ in nxt], "replies": [r for *_, r in nxt],
                     **{k: v for k, v in e.stats().items() if k.startswith("host_tier")}}
        del e
    def same(*names):
        """Whether the engines ``names`` gave the same replies; None when one of them was not run."""
        return None if any(n not in out for n in names) else all(out[n]["replies"] == out[names[-1]]["replies"]
                                                                  for n in names)

    identical = same(*[n for n in ("host_tier", "disk_tier") if n in out], "never_evicted")
    recomputed_same = same("recompute", "never_evicted")  # 16-bit: may differ

    def ratio(a, b):
        """TTFT of engine ``a`` over engine ``b`` (above 1: ``b`` is faster); None when one was not run."""
        return round(out[a]["ttft_s"] / out[b]["ttft_s"], 2) if a in out and b in out else None

    for name, r in out.items():
        r.pop("replies")
        if args.json:
            print(json.dumps({"engine": name, **r}))
        else:
            print(f"{name:14s} next-turn TTFT {r['ttft_s'] * 1000:8.1f} ms; cached {r['cached_tokens']} of "
                  f"{r['prompt_tokens']} prompt tokens")
    print(json.dumps({"host_restore_vs_recompute_ttft": ratio("recompute", "host_tier"),
                      "disk_restore_vs_recompute_ttft": ratio("recompute", "disk_tier"),
                      "identical": identical,
                      "recomputed_identical": recomputed_same,
                      "history_tokens": args.history_tokens, "sessions": args.sessions,
                      "engines": list(out)}))


if __name__ == "__main__":
    main()
