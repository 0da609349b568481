"""Speculative decoding from history: decode tokens/s with and without it, in one run, on six workloads; tokens
compared one for one.

    python bench/speculative.py [--checkpoint DIR] [--speculative 8] [--max-new-tokens 160] [--repeats 2] [--json]
    python bench/speculative.py --break-even [--checkpoint DIR] [--json]

Without ``--checkpoint`` the embedded SmolLM2-135M-Instruct is quantized (RTN W4A16 g64) into a temporary folder.
2 threads, the engine's default dtype (bf16 here), ``speculative=K`` (default 8) against ``speculative=0``, best
of ``--repeats``; tokens/s = generated tokens after each request's first / the time after the first. Workloads:

- ``input_grounded`` (greedy): rewriting, correcting or continuing a given text, a code edit;
- ``free_chat`` (greedy): open questions;
- ``sampled_grounded``: the input-grounded prompts at temperature 0.7, top_p 0.9, a seed per prompt;
- ``json_schema`` (greedy): extraction of fields from a given text under a strict JSON schema;
- ``multiturn_agent`` (greedy): one scripted session (``Engine.session``) whose turns bring tool results and whose
  later turns restate them; its acceptance is also measured with the prompt-lookup drafter
  (``EngineConfig.speculative_drafter="ngram"``) on the same trace: ``acceptance_suffix_vs_ngram`` = mean accepted
  drafts per verify step, suffix / prompt lookup;
- ``batch8``: 8 requests at once (the input-grounded and free-chat prompts, greedy): total tokens/s with / without;
  ``batch32``: the same 8 prompts 4 times (32 at once), where the step's draft budget matters.

The last JSON line has ``speedup_<workload>`` for the first five, ``batch8_throughput_ratio``,
``batch32_throughput_ratio``,
``acceptance_suffix_vs_ngram``, ``identical_batch_invariant`` (every greedy workload's tokens equal with and without
speculation on a second engine with ``batch_invariant=True``, where the verify step's logits rows equal single
steps'; checked in the same run), ``greedy_agree`` (the share of greedy tokens equal with and without speculation
on the default engine, position by position: in 16-bit a ``K + 1``-row forward can round differently from single
steps and flip a near tie), ``sampled_agree`` (the same for the seeded sampled workload) and the old
``speedup_input_grounded``, ``speedup_free_chat``, ``identical`` (the default engine's greedy tokens all equal).

``--break-even``: the time of one forward of M new tokens (M = 1, 2, 3, 5, 9, 17) after a 256-token cached prefix
(best of 6): what a verify step of M - 1 drafts costs against a 1-token decode step.
"""
from __future__ import annotations

import argparse
import json

from common import w4a16_checkpoint

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


EXTRACT = [
    ("Extract the keeper's evening tasks and the weather from this text as JSON:\n\n" + PASSAGE,
     {"type": "object", "properties": {"tasks": {"type": "array", "items": {"type": "string"}},
                                       "wind": {"type": "string"}, "clouds": {"type": "string"}},
      "required": ["tasks", "wind", "clouds"], "additionalProperties": False}),
    ("Extract the order as JSON:\n\nOrder 48213 for Maria Lopez, 12 Harbour Road, Bristol: two blue ceramic mugs at "
     "8.50 each and one teapot at 24.00, shipped by express courier on 3 March.",
     {"type": "object", "properties": {"order_id": {"type": "string"}, "customer": {"type": "string"},
                                       "address": {"type": "string"},
                                       "items": {"type": "array", "items": {"type": "object", "properties": {
                                           "name": {"type": "string"}, "quantity": {"type": "integer"},
                                           "price": {"type": "number"}}, "required": ["name", "quantity", "price"]}},
                                       "shipping": {"type": "string"}},
      "required": ["order_id", "customer", "address", "items", "shipping"], "additionalProperties": False}),
    ("Extract the function's name, its parameters and what it returns as JSON:\n\n" + CODE,
     {"type": "object", "properties": {"name": {"type": "string"},
                                       "parameters": {"type": "array", "items": {"type": "string"}},
                                       "returns": {"type": "string"}},
      "required": ["name", "parameters", "returns"], "additionalProperties": False}),
]
def _weather(city: str, date: str, temp: int, wind: int, sky: str, rain: float) -> str:
    return (f'{{"tool": "get_weather", "city": "{city}", "date": "{date}", "temperature_c": {temp}, '
            f'"wind_kmh": {wind}, "sky": "{sky}", "rain_chance": {rain}}}')


LISBON = _weather("Lisbon", "2026-12-06", 17, 22, "scattered clouds", 0.1)
PORTO = _weather("Porto", "2026-12-07", 14, 31, "light rain", 0.7)
MADRID = _weather("Madrid", "2026-12-08", 9, 12, "clear sky", 0.0)
FLIGHTS = ('{"tool": "search_flights", "results": ['
           '{"flight": "TP1940", "from": "LIS", "to": "OPO", "depart": "07:15", "arrive": "08:10", "price_eur": 89}, '
           '{"flight": "FR8412", "from": "LIS", "to": "OPO", "depart": "09:40", "arrive": "10:35", "price_eur": 42}, '
           '{"flight": "TP1946", "from": "LIS", "to": "OPO", "depart": "12:05", "arrive": "13:00", "price_eur": 118}, '
           '{"flight": "U27761", "from": "LIS", "to": "OPO", "depart": "16:50", "arrive": "17:45", "price_eur": 57}, '
           '{"flight": "TP1952", "from": "LIS", "to": "OPO", "depart": "20:30", "arrive": "21:25", "price_eur": 96}]}')
# an agent's session: the same tool called for three cities (results alike in shape, different in values), a tool
# that returns a list of records with the same keys, and later turns that ask for earlier results again


def _tool_turn(tool: str, result: str) -> str:
    return f"Here is the JSON returned by the {tool} tool:\n\n{result}\n\nWrite the JSON again, exactly."


AGENT = [_tool_turn("get_weather", LISBON), _tool_turn("get_weather", PORTO), _tool_turn("search_flights", FLIGHTS),
         _tool_turn("get_weather", MADRID), "Write the JSON returned for Lisbon again, exactly.",
         "Write the JSON of the flights again, exactly.", "Write the JSON returned for Porto again, exactly."]


def _gen(**kw):
    from turbo import GenerationConfig
    return GenerationConfig(**kw)


def _timed(engine, prompts, k: int, max_new: int, repeats: int, opts=None):
    """(tokens/s after the first token, every prompt's token ids, the speculation counters) of the best repeat;
    ``opts(i)``: the extra generation options of prompt i."""
    best = None
    for _ in range(repeats):
        c0 = _fresh(engine)
        outs = [engine.generate(p, _gen(max_new_tokens=max_new, speculative=k, **(opts(i) if opts else {})))
                for i, p in enumerate(prompts)]
        r = _result(engine, c0, [o.token_ids for o in outs], sum(len(o.token_ids) - 1 for o in outs),
                    sum(o.decode_seconds for o in outs))
        best = r if best is None or r[0] > best[0] else best
    return best


def _fresh(engine) -> dict:
    """Forget the server's recent outputs (a run must not draft from the outputs of the run before it, which decoded
    the same prompts) and return the counters now."""
    from turbo.core.speculative import RecentOutputs
    if engine.recent_outputs is not None:
        engine.recent_outputs = RecentOutputs(engine.recent_outputs.capacity)
    return engine.counters.as_dict()


def _result(engine, c0, ids, tokens, secs):
    c = {n: getattr(engine.counters, n) - c0[n] for n in ("spec_drafted", "spec_accepted", "spec_steps")}
    return tokens / secs, ids, c


def _session(engine, k: int, max_new: int, repeats: int):
    """The agent script as one session, turn after turn: as :func:`_timed`."""
    best = None
    for _ in range(repeats):
        c0 = _fresh(engine)
        s = engine.session()
        ids, tokens, secs = [], 0, 0.0
        for msg in AGENT:
            s.chat(msg, max_new_tokens=max_new, speculative=k)
            ids.append(s.last.token_ids)
            tokens += len(s.last.token_ids) - 1
            secs += s.last.decode_seconds
        s.close()
        r = _result(engine, c0, ids, tokens, secs)
        best = r if best is None or r[0] > best[0] else best
    return best


def _together(engine, prompts, k: int, max_new: int, repeats: int):
    """Total generated tokens / wall seconds of the prompts decoded together (best of ``repeats``)."""
    import time
    best = None
    for _ in range(repeats):
        c0 = _fresh(engine)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, _gen(max_new_tokens=max_new, speculative=k))
        r = _result(engine, c0, [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs),
                    time.perf_counter() - t0)
        best = r if best is None or r[0] > best[0] else best
    return best


def _agree(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions whose tokens are equal, over every pair of outputs (up to the shorter one's length,
    the longer one's extra tokens counted as different)."""
    same = total = 0
    for x, y in zip(a, b):
        same += sum(p == q for p, q in zip(x, y))
        total += max(len(x), len(y))
    return same / max(total, 1)


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


def _warm(engine, k: int) -> None:
    """Warm the kernels and caches up: a prompt of each size class, decoded with and without drafts."""
    p = engine.chat_template_ids([{"role": "user", "content": "Repeat exactly:\n\n" + PASSAGE}])
    for kk in (0, k, 0):
        engine.generate(p, _gen(max_new_tokens=48, speculative=kk))
    engine.generate([p, p[:40]], _gen(max_new_tokens=16, speculative=k))


def workloads(engine):
    """{name: (runner, prompts or None, greedy)} for the engine's chat template."""
    chat = lambda m: engine.chat_template_ids([{"role": "user", "content": m}])  # noqa: E731
    grounded, free = [chat(m) for m in GROUNDED], [chat(m) for m in FREE]
    return {
        "input_grounded": (lambda k, a: _timed(engine, grounded, k, a.max_new_tokens, a.repeats), True),
        "free_chat": (lambda k, a: _timed(engine, free, k, a.max_new_tokens, a.repeats), True),
        "sampled_grounded": (lambda k, a: _timed(engine, grounded, k, a.max_new_tokens, a.repeats,
                                                 lambda i: dict(temperature=0.7, top_p=0.9, seed=i)), False),
        "json_schema": (lambda k, a: _timed(engine, [chat(m) for m, _ in EXTRACT], k, a.max_new_tokens, a.repeats,
                                            lambda i: dict(json_schema=EXTRACT[i][1])), True),
        "multiturn_agent": (lambda k, a: _session(engine, k, a.max_new_tokens, a.repeats), True),
        "batch8": (lambda k, a: _together(engine, grounded + free, k, a.max_new_tokens, a.repeats), True),
        "batch32": (lambda k, a: _together(engine, (grounded + free) * 4, k, a.max_new_tokens, a.repeats), True),
    }


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--speculative", type=int, default=8, help="draft tokens per step at most")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="input_grounded,free_chat,sampled_grounded,json_schema,multiturn_agent,"
                                           "batch8,batch32")
    ap.add_argument("--no-invariant-check", action="store_true", help="skip the batch-invariant engine")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--break-even", action="store_true", help="time one forward of M new tokens instead")
    args = ap.parse_args()
    from turbo import Engine
    path, _tmp = w4a16_checkpoint("smollm2-135m-instruct", 64, args.checkpoint)
    engine = Engine(path, threads=2)
    _warm(engine, args.speculative)
    if args.break_even:
        ms = break_even(engine)
        print(json.dumps({"step_ms_by_new_tokens": ms}) if args.json else
              "\n".join(f"M = {m:2d}: {t:7.2f} ms" for m, t in ms.items()))
        return
    names = args.workloads.split(",")
    runs, out, k = workloads(engine), {}, args.speculative
    greedy_ids = ([], [])
    sampled_ids = ([], [])
    for name in names:
        run, greedy = runs[name]
        base, spec = run(0, args), run(k, args)
        same = base[1] == spec[1]
        (greedy_ids if greedy else sampled_ids)[0].extend(base[1])
        (greedy_ids if greedy else sampled_ids)[1].extend(spec[1])
        c = spec[2]
        out[name] = {"baseline_tok_s": round(base[0], 1), "speculative_tok_s": round(spec[0], 1),
                     "speedup": round(spec[0] / base[0], 3), "identical": same,
                     "acceptance": round(c["spec_accepted"] / max(c["spec_drafted"], 1), 3),
                     "accepted_per_step": round(c["spec_accepted"] / max(c["spec_steps"], 1), 3),
                     "tokens_per_step": round((c["spec_accepted"] + c["spec_steps"]) / max(c["spec_steps"], 1), 2)}
        print(json.dumps({"workload": name, **out[name]}) if args.json else
              f"{name:17s} {base[0]:7.1f} -> {spec[0]:7.1f} tok/s ({spec[0] / base[0]:.2f}x), identical {same}, "
              f"acceptance {out[name]['acceptance']:.2f}, {out[name]['tokens_per_step']} tokens per verify step",
              flush=True)
    summary = {f"speedup_{n}": out[n]["speedup"] for n in names if not n.startswith("batch")}
    for n in ("batch8", "batch32"):
        if n in out:
            summary[f"{n}_throughput_ratio"] = out[n]["speedup"]
    if "multiturn_agent" in out:
        engine.config.speculative_drafter = "ngram"
        ngram = _session(engine, k, args.max_new_tokens, 1)[2]
        engine.config.speculative_drafter = "suffix"
        per_step = ngram["spec_accepted"] / max(ngram["spec_steps"], 1)
        summary["accepted_per_step_ngram"] = round(per_step, 3)
        summary["accepted_per_step_suffix"] = out["multiturn_agent"]["accepted_per_step"]
        summary["acceptance_suffix_vs_ngram"] = round(out["multiturn_agent"]["accepted_per_step"] / per_step, 3)
    summary["identical"] = greedy_ids[0] == greedy_ids[1]
    summary["greedy_agree"] = round(_agree(*greedy_ids), 4)
    if sampled_ids[0]:
        summary["sampled_agree"] = round(_agree(*sampled_ids), 4)
    if not args.no_invariant_check:
        del engine
        inv = Engine(path, threads=2, batch_invariant=True)
        _warm(inv, args.speculative)
        same, checked = True, []
        quick = argparse.Namespace(max_new_tokens=args.max_new_tokens, repeats=1)
        for name, (run, greedy) in workloads(inv).items():
            if name in names:
                a, b = run(0, quick), run(k, quick)
                same &= a[1] == b[1]
                checked.append(name)
        summary["identical_batch_invariant"] = same
        summary["batch_invariant_checked"] = checked
    summary["speculative"] = k
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
