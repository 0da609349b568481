"""Print the planner's 24 GB deployment table (docs/deploy-24gb.md) as Markdown.

    python bench/plan_table.py [--gpu-mem 24GiB] [--json]

For each public config kept in tests/fixtures/configs (Llama-3-8B, Qwen2.5-7B/14B/32B, Llama-3-70B) at W4A16 g128
with bf16, int8 and int4 KV: weights, workspace, KV bytes per token, pool tokens, sessions of the model's full
context at once, whether it fits, the `liteturbo serve` command for each configuration that fits, and the peak
memory of `liteturbo lite auto-awq` with the default calibration (128 x 512 tokens). Nothing is loaded: it is the
same accounting as `liteturbo plan` (turbo/core/planner.py, turbo/plan.py) and the engine's start-up.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lite.memory import quantize_peak  # noqa: E402
from turbo import plan as planner  # noqa: E402

MODELS = [("Llama-3-8B", "llama-3-8b"), ("Qwen2.5-7B", "qwen2.5-7b"), ("Qwen2.5-14B", "qwen2.5-14b"),
          ("Qwen2.5-32B", "qwen2.5-32b"), ("Llama-3-70B", "llama-3-70b")]
KV = ["bfloat16", "int8", "int4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-mem", default="24GiB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows, commands, lite_rows = [], [], []
    for title, short in MODELS:
        cfg_path = ROOT / "tests" / "fixtures" / "configs" / f"{short}.json"
        for kv in KV:
            p, _ = planner.plan_checkpoint(str(cfg_path), gpu_mem=args.gpu_mem, kv_cache_dtype=kv)
            rows.append({**p.to_dict(), "model": title, "kv": kv})
            if p.fits:
                commands.append((title, kv, p.serve_command(f"./{short}-awq")))
        q = quantize_peak(p.raw_config, "awq", 128, 512)
        lite_rows.append((title, q.peak, q.peak <= p.budget - p.reserve))
    if args.json:
        print(json.dumps({"plans": rows, "lite_awq_peak": lite_rows}, indent=2))
        return
    g = planner.gib
    print(f"| model | KV | weights | workspace | KV / token | KV pool | tokens | sessions (context) | fits |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['kv']} | {g(r['weights_total'])} | {g(r['workspace_total'])} | "
              f"{r['kv_bytes_per_token'] / 1024:.1f} KiB | {g(r['pool_bytes'])} | {r['pool_tokens']:,} | "
              f"{r['sessions_at_once']} ({r['session_len']:,}) | {'yes' if r['fits'] else 'no: ' + r['reason']} |")
    print()
    print("| model | `lite auto-awq` peak (128 x 512 calibration tokens) | fits in the budget |")
    print("|---|---:|---|")
    for title, peak, ok in lite_rows:
        print(f"| {title} | {g(peak)} | {'yes' if ok else 'no'} |")
    print()
    for title, kv, cmd in commands:
        print(f"# {title}, {kv} KV\n{cmd}")


if __name__ == "__main__":
    main()
