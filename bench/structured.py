"""Constrained decoding's cost: decode tokens/s of replies held to a JSON schema vs free replies of the same length, in
one run, on one engine; and the mask time per step (llguidance, on a worker thread beside the forward).

    python bench/structured.py [--checkpoint DIR] [--batch 1 8] [--repeats 3] [--json]

Without ``--checkpoint`` the embedded SmolLM2-135M-Instruct is quantized (RTN W4A16 g64) into a temporary folder.
For each batch size, ``batch`` chat requests with the schema run together (greedy), then ``batch`` free requests
with ``ignore_eos`` and each constrained reply's token count as its ``max_new_tokens`` (same prompts, same lengths);
decode tokens/s = the batch's generated tokens after the first / the wall time after the first token; best of
``--repeats``. The last JSON line holds ``schema_vs_free_decode`` (batch 1), ``mask_ms_per_step`` (CPU time of the
masks per step), ``mask_wait_ms_per_step`` (what the step waited for them) and every batch's numbers.
"""
from __future__ import annotations

import argparse
import json
import time

from common import w4a16_checkpoint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 24},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                         "pet": {"type": "object", "additionalProperties": False, "required": ["kind", "name"],
                                 "properties": {"kind": {"enum": ["cat", "dog", "fish", "none"]},
                                                "name": {"type": "string", "maxLength": 16}}}}}
PEOPLE = ["a baker in Lyon", "a retired pilot", "a young violinist", "a marine biologist", "a chess coach",
          "a taxi driver in Seoul", "a beekeeper", "a software tester", "a potter", "a mountain guide",
          "a librarian", "a nurse in Oslo", "a street artist", "a farmer", "a math teacher", "a sailor"]


def _run(engine, prompts, gens):
    reqs = [engine.add_request(p, g) for p, g in zip(prompts, gens)]
    t_first = None
    while engine.has_unfinished():
        engine.step()
        if t_first is None and all(r.output_ids for r in reqs):
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    outs = [engine.output(r) for r in reqs]
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return outs, decoded / max(t_end - t_first, 1e-9)


def bench(engine, batch: int, repeats: int) -> dict:
    """One batch size's row: schema vs free decode tokens/s (best of ``repeats``), mask ms per step, valid replies."""
    from turbo import GenerationConfig
    prompts = [engine.chat_template_ids([{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} as a JSON "
                                                                     f"object with name, age, city, hobbies, pet."}])
               for i in range(batch)]
    best_c = best_f = 0.0
    mask = wait = steps = 0.0
    for _ in range(repeats):
        c0 = dict(engine.counters)
        outs, tps_c = _run(engine, prompts, [GenerationConfig(json_schema=SCHEMA, max_new_tokens=160)] * batch)
        c1 = engine.counters
        mask += c1["mask_seconds"] - c0["mask_seconds"]
        wait += c1["mask_wait_seconds"] - c0["mask_wait_seconds"]
        steps += c1["steps"] - c0["steps"]
        lengths = [len(o.token_ids) for o in outs]
        valid = sum(o.finish_reason == "stop" and _valid(o.text) for o in outs)
        _, tps_f = _run(engine, prompts, [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in lengths])
        best_c, best_f = max(best_c, tps_c), max(best_f, tps_f)
    return {"batch": batch, "schema_tok_s": round(best_c, 1), "free_tok_s": round(best_f, 1),
            "schema_vs_free_decode": round(best_c / best_f, 3), "mean_reply_tokens": sum(lengths) / len(lengths),
            "valid_replies": f"{valid}/{batch}", "mask_ms_per_step": round(1000 * mask / max(steps, 1), 3),
            "mask_wait_ms_per_step": round(1000 * wait / max(steps, 1), 3)}


def _valid(text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a W4A16 checkpoint (default: RTN g64 of the embedded SmolLM2)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print JSON lines only")
    args = ap.parse_args()
    from turbo import Engine
    path, _tmp = w4a16_checkpoint("smollm2-135m-instruct", 64, args.checkpoint)
    engine = Engine(path)
    engine.generate("warm up", max_new_tokens=4)
    rows = [bench(engine, b, args.repeats) for b in args.batch]
    for r in rows:
        print(json.dumps(r) if args.json else
              f"batch {r['batch']:3d}: schema {r['schema_tok_s']:7.1f} tok/s, free {r['free_tok_s']:7.1f} tok/s "
              f"-> {r['schema_vs_free_decode']:.3f}x; mask {r['mask_ms_per_step']:.3f} ms/step (waited "
              f"{r['mask_wait_ms_per_step']:.3f}); valid {r['valid_replies']}")
    first = rows[0]
    print(json.dumps({"schema_vs_free_decode": first["schema_vs_free_decode"],
                      "mask_ms_per_step": first["mask_ms_per_step"],
                      "mask_wait_ms_per_step": first["mask_wait_ms_per_step"], "rows": rows}))


if __name__ == "__main__":
    main()
