"""Quantization quality table: WikiText-2 PPL, wall time and peak memory of each method, in one run.

    python bench/quality.py [--model smollm2-135m-instruct] [--group-size 64] [--max-windows 40] [--json]

Each quantization runs as its own ``liteturbo lite ...`` process (so its peak memory is its own); each
checkpoint is then scored with ``liteturbo lite eval-ppl --seqlen 2048`` (WikiText-2 test rows joined with
"\\n\\n", first ``--max-windows`` windows). Prints a markdown table with the exact commands.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(cmd: list[str]) -> tuple[str, float]:
    """Run a command; (combined output, seconds). Exits with its stderr on failure."""
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return p.stdout + p.stderr, time.perf_counter() - t


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--max-windows", type=int, default=40)
    ap.add_argument("--methods", default="fp16,rtn,awq,gptq,gptq-act-order")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true",
                    help="score checkpoints already in --work (made by the commands shown) instead of re-making "
                         "them; time and memory come from their liteturbo_quantize.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="lt-quality-"))
    g = str(args.group_size)
    recipes = {
        "rtn": ["lite", "rtn", args.model, "--w-group-size", g],
        "awq": ["lite", "auto-awq", args.model, "--w-group-size", g],
        "gptq": ["lite", "gptq", args.model, "--w-group-size", g],
        "gptq-act-order": ["lite", "gptq", args.model, "--w-group-size", g, "--act-order"],
        "awq-gptq-rounding": ["lite", "auto-awq", args.model, "--w-group-size", g, "--rounding", "gptq"],
    }
    rows = []
    for name in args.methods.split(","):
        row = {"method": name}
        target = args.model
        if name != "fp16":
            out = work / name
            cmd = ["liteturbo", *recipes[name], "--work-dir", str(out), "--overwrite"]
            if not (args.reuse and (out / "liteturbo_quantize.json").is_file()):
                run(cmd)
            info = json.loads((out / "liteturbo_quantize.json").read_text())
            row.update(command=" ".join(cmd[:-3] + ["--work-dir", name]), seconds=info["wall_seconds"],
                       peak_gib=info["peak_memory_gib"])
            target = str(out)
        ecmd = ["liteturbo", "lite", "eval-ppl", target, "--seqlen", "2048", "--max-windows", str(args.max_windows),
                "--json"]
        log, _ = run(ecmd)
        row["ppl"] = json.loads(log.strip().splitlines()[-1])["ppl"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    base = next((r["ppl"] for r in rows if r["method"] == "fp16"), None)
    rtn = next((r["ppl"] for r in rows if r["method"] == "rtn"), None)
    for r in rows:
        if base and rtn and r["method"] not in ("fp16", "rtn"):
            r["gap_vs_rtn_gap"] = (r["ppl"] - base) / (rtn - base)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"| method | WikiText-2 PPL | gap to 16-bit / RTN's gap | quantize time (s) | peak memory (GiB) | command |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        gap = f"{r['gap_vs_rtn_gap']:.0%}" if "gap_vs_rtn_gap" in r else ""
        print(f"| {r['method']} | {r['ppl']:.2f} | {gap} | {r.get('seconds', '')} | {r.get('peak_gib', '') or ''} | "
              f"`{r.get('command', 'liteturbo lite eval-ppl ' + args.model)}` |")


if __name__ == "__main__":
    main()
