"""Fidelity users feel: how far each quantized checkpoint and KV cache dtype is from the 16-bit model, by the next-token
distribution and by what the served replies do.

    python bench/fidelity.py [--model smollm2-135m-instruct] [--checkpoints 16-bit,rtn,gptq,auto-awq,gptq-e2e]
                             [--kv auto,int8,int4,int4-rotated] [--max-windows 40] [--prompts 20] [--work DIR [--reuse]]
                             [--json]
    python bench/fidelity.py --table RUN.jsonl      # the markdown table of a run's JSON lines (docs/quantization.md)

Rows: every checkpoint with the ``auto`` KV cache (the compute dtype), and the ``16-bit`` and ``rtn`` checkpoints with
every ``--kv`` dtype too (``int8`` and ``int4`` plain per-token, ``int4-rotated`` the Hadamard-rotated int4 cache,
:meth:`backends.kv_cache.KVQuantParams.rotation_only`). Checkpoints are made by ``liteturbo lite ...`` processes
(:data:`RECIPES`, group size 64; ``quantize_seconds`` from the ``liteturbo_quantize.json`` the run writes). All
engines are loaded at once (2048-token KV pools) and scored window by window, so the 16-bit reference's logits are
computed once per window.

Per row:

- ``kl_mean``, ``kl_p99``: the KL divergence ``KL(P_16bit || P_row)`` of each next-token distribution (nats), mean and
  99th percentile over every scored token, as llama.cpp's ``llama-perplexity --kl-divergence`` reports them;
  ``top1_agree``: the share of tokens whose most likely next token is the 16-bit model's. Over the first
  ``--max-windows`` windows of 2048 tokens of WikiText-2 test, scored in chunks of 512 through the paged KV cache
  (as ``liteturbo lite eval-ppl``, so an int8/int4 cache is what is measured);
- ``ppl_wikitext2`` (the same windows) and ``ppl_zh`` (Chinese, ``--dataset zh``), as bench/quality.py;
- through ``liteturbo serve``'s app (the official ``openai`` client, in process): ``schema_valid``: of ``--prompts``
  strict ``json_schema`` requests (:data:`PET_SCHEMA`, no length limits in the schema, temperature 0.7, seed i,
  ``max_tokens`` 300), the replies that end (``stop``) and validate; ``tools_valid``: of ``--prompts`` tool requests
  (half ``tool_choice="required"``, half ``"auto"``; temperature 0.7, seed i, ``max_tokens`` 120), the replies that
  are valid calls (a known tool, arguments that validate, ``finish_reason`` ``tool_calls``) or, under ``auto``,
  plain text that ends; ``toolchain_ok``: of :data:`CHAINS` (LMDeploy #4743's shape: call, result, next call;
  greedy, ``tool_choice="required"``), the conversations whose both calls name the right tool with the right argument;
  ``greedy_agree_32``: of ``--prompts`` chat prompts, the greedy 32-token replies identical to the 16-bit model's.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

RECIPES = {  # checkpoint name -> `liteturbo lite` arguments after the command's name
    "rtn": ["rtn"],
    "gptq": ["gptq"],
    "auto-awq": ["auto-awq"],
    "gptq-e2e": ["gptq", "--e2e-steps", "40"],
}
KV_ROWS = {"auto": dict(kv_cache_dtype="auto"), "int8": dict(kv_cache_dtype="int8", kv_rotation=False),
           "int4": dict(kv_cache_dtype="int4", kv_rotation=False),
           "int4-rotated": dict(kv_cache_dtype="int4", kv_rotation=True)}
ALL_KV = ("16-bit", "rtn")  # the checkpoints measured with every KV dtype
PET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "species", "age", "traits"],
              "properties": {"name": {"type": "string"}, "species": {"enum": ["cat", "dog", "rabbit", "parrot"]},
                             "age": {"type": "integer"}, "traits": {"type": "array", "items": {"type": "string"}}}}
PETS = ["a lazy cat", "a playful dog", "a shy rabbit", "a talkative parrot", "an old cat", "a puppy",
        "a grumpy rabbit", "a clever parrot", "a fat cat", "a loyal dog"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_capital", "description": "The capital city of a country.",
                                      "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                                                     "required": ["country"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Paris", "Tokyo", "Madrid", "Cairo", "Lima", "Oslo", "Seoul", "Rome", "Berlin", "Ottawa"]
# (country, its capital): "What is the weather in the capital of X? First call get_capital ..., then get_weather ..." ->
# get_capital(X); its result names the capital and asks for get_weather(capital) (SmolLM2-135M follows a result that
# says the next step, 6 of 6 at 16-bit; given only "Paris" it calls get_capital again)
CHAINS = [("France", "Paris"), ("Japan", "Tokyo"), ("Spain", "Madrid"), ("Egypt", "Cairo"), ("Peru", "Lima"),
          ("Norway", "Oslo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Canada", "Ottawa"), ("Kenya", "Nairobi")]
CHAT = ["What is the capital of France?", "Write a haiku about rain.", "How do I boil an egg?",
        "Name three primary colors.", "What is 12 times 7?", "Give me a tip for learning Python.",
        "Why is the sky blue?", "Translate 'good morning' into Spanish.", "What is photosynthesis?",
        "Suggest a name for a cat.", "How many days are in a leap year?", "What does a CPU do?",
        "Tell me a fun fact about octopuses.", "What is the boiling point of water?", "Describe the moon.",
        "How do plants drink water?", "What is a prime number?", "Recommend a book for a long flight.",
        "What is the largest ocean?", "How do I make tea?"]
SEQLEN, CHUNK = 2048, 512


def make_checkpoints(model: str, names: list[str], work: Path, reuse: bool) -> dict[str, tuple[str, float | None]]:
    """``{name: (path, quantize_seconds)}``; ``16-bit`` is ``model`` itself."""
    out = {}
    for name in names:
        if name == "16-bit":
            out[name] = (model, None)
            continue
        if name not in RECIPES:
            sys.exit(f"unknown checkpoint {name!r}; known: 16-bit, {', '.join(RECIPES)}")
        folder = work / name
        if not (reuse and (folder / "liteturbo_quantize.json").is_file()):
            cmd = ["liteturbo", "lite", RECIPES[name][0], model, *RECIPES[name][1:], "--w-group-size", "64",
                   "--work-dir", str(folder), "--overwrite", "--no-serving-layout"]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
        info = json.loads((folder / "liteturbo_quantize.json").read_text())
        out[name] = (str(folder), info["wall_seconds"])
    return out


def chunk_logits(engine, ids: list[int]):
    """Yield ``(logits [n, V] float32, targets [n])`` of one window, chunk by chunk through the paged KV cache
    (:func:`turbo.perplexity.window_logits`)."""
    from turbo.perplexity import window_logits

    for logits, targets in window_logits(engine, ids, CHUNK):
        yield logits.float(), targets


def distribution_scores(engines: dict, ref: str, windows: list[list[int]]) -> dict[str, dict]:
    """Per row: ``kl_mean``, ``kl_p99``, ``top1_agree`` against ``engines[ref]`` and the perplexity, over ``windows``."""
    kls = {n: [] for n in engines}
    agree = {n: 0 for n in engines}
    nll = {n: 0.0 for n in engines}
    count = 0
    for w in windows:
        gens = {n: chunk_logits(e, w) for n, e in engines.items()}
        for ref_logits, targets in gens[ref]:
            lp_ref = torch.log_softmax(ref_logits, -1)
            p_ref, top_ref = lp_ref.exp(), lp_ref.argmax(-1)
            count += len(targets)
            for n, g in gens.items():
                lp = lp_ref if n == ref else torch.log_softmax(next(g)[0], -1)
                kls[n].append((p_ref * (lp_ref - lp)).sum(-1).clamp(min=0))
                agree[n] += int((lp.argmax(-1) == top_ref).sum())
                nll[n] -= float(lp.gather(1, targets.unsqueeze(1)).sum())
        for n, g in gens.items():  # finish every generator so each frees its blocks
            for _ in g:
                pass
    out = {}
    for n in engines:
        k = torch.cat(kls[n]).double()
        out[n] = {"kl_mean": float(k.mean()), "kl_p99": float(torch.quantile(k, 0.99)),
                  "top1_agree": agree[n] / count, "ppl_wikitext2": math.exp(nll[n] / count)}
    return out


def _valid(args_text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(args_text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def task_scores(engine, prompts: int, ref_greedy: list[str] | None) -> tuple[dict, list[str]]:
    """Served replies of one engine: schema, tools, tool chain, greedy agreement (see the module docstring); also
    returns the greedy replies (the 16-bit row's are the reference)."""
    import openai
    from fastapi.testclient import TestClient

    from turbo.serve.app import create_app

    app = create_app(engine, model_name="m", api_keys="")
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0,
                               timeout=600)

        def chat(**kw):
            """One chat completion's first choice."""
            return client.chat.completions.create(model="m", **kw).choices[0]

        def schema(i):
            """Whether the i-th strict json_schema reply ends and validates."""
            c = chat(messages=[{"role": "user", "content": f"Describe {PETS[i % len(PETS)]} as JSON."}],
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}},
                     temperature=0.7, seed=i, max_tokens=300)
            return c.finish_reason == "stop" and _valid(c.message.content or "", PET_SCHEMA)

        def tool(i):
            """Whether the i-th tool reply is a valid call (or, under auto, plain text that ends)."""
            choice = "required" if i % 2 == 0 else "auto"
            c = chat(messages=[{"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]}?"}],
                     tools=TOOLS, tool_choice=choice, temperature=0.7, seed=i, max_tokens=120)
            calls = c.message.tool_calls or []
            if not calls:
                return choice == "auto" and c.finish_reason == "stop"
            return c.finish_reason == "tool_calls" and all(
                k.function.name in PARAMS and _valid(k.function.arguments, PARAMS[k.function.name]) for k in calls)

        def chain(case):
            """Whether get_capital(country) then, after its result, get_weather(capital) are called."""
            country, capital = case
            msgs = [{"role": "user", "content": f"What is the weather in the capital of {country}? First call "
                                                f"get_capital with country \"{country}\", then call get_weather with "
                                                f"the capital it returns."}]
            want = [("get_capital", {"country": country}), ("get_weather", {"city": capital})]
            results = [f"The capital of {country} is {capital}. Now call get_weather with city \"{capital}\"."]
            for step, (name, args) in enumerate(want):
                c = chat(messages=msgs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
                         max_tokens=120)
                calls = c.message.tool_calls or []
                if len(calls) != 1 or calls[0].function.name != name:
                    return False
                try:
                    got = json.loads(calls[0].function.arguments)
                except ValueError:
                    return False
                if {k: str(v).strip().lower() for k, v in got.items()} != {k: v.lower() for k, v in args.items()}:
                    return False
                if step < len(results):  # the call and its result join the conversation
                    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_{step}", "type": "function",
                         "function": {"name": name, "arguments": calls[0].function.arguments}}]},
                        {"role": "tool", "tool_call_id": f"call_{step}", "content": results[step]}]
            return True

        def greedy(i):
            """The greedy 32-token reply to the i-th chat prompt."""
            return chat(messages=[{"role": "user", "content": CHAT[i % len(CHAT)]}], temperature=0,
                        max_tokens=32).message.content or ""

        with ThreadPoolExecutor(8) as pool:
            row = {"schema_valid": sum(pool.map(schema, range(prompts))),
                   "tools_valid": sum(pool.map(tool, range(prompts))),
                   "toolchain_ok": sum(pool.map(chain, CHAINS))}
            replies = list(pool.map(greedy, range(prompts)))
    if ref_greedy is not None:
        row["greedy_agree_32"] = sum(a == b for a, b in zip(replies, ref_greedy))
    return row, replies


def markdown_table(rows: list[dict]) -> str:
    """The docs' table of a run's rows (``--table``): the gaps are shares of the ``rtn`` row's perplexity gap to the
    ``16-bit`` row's (auto KV), as docs/quantization.md states them."""
    ref = next(r for r in rows if r["checkpoint"] == "16-bit" and r["kv"] == "auto")
    rtn = next((r for r in rows if r["checkpoint"] == "rtn" and r["kv"] == "auto"), None)

    def gap(r, key):
        if rtn is None or rtn[key] == ref[key]:
            return ""
        return f" ({100 * (r[key] - ref[key]) / (rtn[key] - ref[key]):.0f} %)"
    head = ("| checkpoint | KV | KL mean | KL p99 | top-1 | PPL WikiText-2 (gap) | PPL zh (gap) | schema | tools | "
            "chain | greedy 32 | quantize |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        q = "" if r.get("quantize_seconds") is None else f"{r['quantize_seconds']:.1f} s"
        n = r.get("prompts", "")
        lines.append(f"| {r['checkpoint']} | {r['kv']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | "
                     f"{r['top1_agree']:.3f} | {r['ppl_wikitext2']:.2f}{gap(r, 'ppl_wikitext2')} | "
                     f"{r['ppl_zh']:.2f}{gap(r, 'ppl_zh')} | {r.get('schema_valid', '')}/{n} | "
                     f"{r.get('tools_valid', '')}/{n} | {r.get('toolchain_ok', '')}/{len(CHAINS)} | "
                     f"{r.get('greedy_agree_32', '')}/{n} | {q} |")
    return "\n".join(lines)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--checkpoints", default="16-bit,rtn,gptq,auto-awq,gptq-e2e")
    ap.add_argument("--kv", default="auto,int8,int4,int4-rotated", help="KV rows of the 16-bit and rtn checkpoints")
    ap.add_argument("--max-windows", type=int, default=40, help="windows of 2048 tokens (KL and perplexity)")
    ap.add_argument("--prompts", type=int, default=20, help="schema, tool and greedy prompts per row")
    ap.add_argument("--no-tasks", action="store_true", help="only the distribution and perplexity columns")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="reuse checkpoints already in --work")
    ap.add_argument("--json", action="store_true", help="JSON lines only")
    ap.add_argument("--table", metavar="JSONL", help="print the markdown table of a finished run's JSON lines, and exit")
    args = ap.parse_args()
    if args.table:
        print(markdown_table([json.loads(x) for x in Path(args.table).read_text().splitlines() if x.strip()]))
        return
    import calib_data
    from turbo import Engine

    t0 = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="lt-fidelity-"))
    names = args.checkpoints.split(",")
    kvs = args.kv.split(",")
    bad = [k for k in kvs if k not in KV_ROWS]
    if bad or "16-bit" not in names:
        sys.exit(f"--kv takes {', '.join(KV_ROWS)}; --checkpoints must include 16-bit (the reference)")
    ckpts = make_checkpoints(args.model, names, work, args.reuse)
    rows = [(c, kv) for c in names for kv in ["auto"] + ([k for k in kvs if k != "auto"] if c in ALL_KV else [])]
    engines = {r: Engine(ckpts[r[0]][0], max_kv_tokens=SEQLEN, lm_head="16bit", **KV_ROWS[r[1]]) for r in rows}
    ref = ("16-bit", "auto")
    ids = engines[ref].encode(calib_data.eval_text("wikitext2"))
    windows = [ids[i * SEQLEN:(i + 1) * SEQLEN] for i in range(min(args.max_windows, len(ids) // SEQLEN))]
    dist = distribution_scores(engines, ref, windows)
    from turbo.perplexity import perplexity

    zh_text = calib_data.eval_text("zh")
    out = []
    ref_greedy = None
    for r in [ref] + [r for r in rows if r != ref]:
        row = {"checkpoint": r[0], "kv": r[1], **dist[r]}
        row["ppl_zh"] = perplexity(engines[r], zh_text, SEQLEN, args.max_windows, progress=False)["ppl"]
        if not args.no_tasks:
            tasks, replies = task_scores(engines[r], args.prompts, ref_greedy)
            if r == ref:
                ref_greedy, tasks["greedy_agree_32"] = replies, args.prompts
            row.update(tasks)
        row["quantize_seconds"] = ckpts[r[0]][1]
        row.update(windows=len(windows), prompts=args.prompts, seconds_so_far=round(time.perf_counter() - t0, 1))
        out.append(row)
        print(json.dumps(row) if args.json else
              f"{r[0]:>10} {r[1]:>13}: KL {row['kl_mean']:.4f} (p99 {row['kl_p99']:.3f}), top-1 "
              f"{row['top1_agree']:.3f}, PPL {row['ppl_wikitext2']:.2f} / zh {row['ppl_zh']:.2f}"
              + ("" if args.no_tasks else f", schema {row['schema_valid']}/{args.prompts}, tools "
                 f"{row['tools_valid']}/{args.prompts}, chain {row['toolchain_ok']}/{len(CHAINS)}, greedy "
                 f"{row['greedy_agree_32']}/{args.prompts}"), flush=True)


if __name__ == "__main__":
    main()
