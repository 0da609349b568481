"""Quantization quality table: perplexity on two evaluation texts, wall time and peak memory of each method.

    python bench/quality.py [--model smollm2-135m-instruct] [--group-size 64] [--max-windows 40]
                            [--methods fp16,rtn,awq,...] [--eval wikitext2,zh] [--work DIR [--reuse]] [--json]

Each quantization runs as its own ``liteturbo lite ...`` process (so its peak memory is its own; time and peak
memory are read from the ``liteturbo_quantize.json`` the run writes); each checkpoint is then scored with
``liteturbo lite eval-ppl --seqlen 2048 --dataset D --max-windows N`` for every evaluation text D (WikiText-2 test
rows joined with "\\n\\n" is the standard one; the second, ``zh`` by default, is never used for calibration: every
recipe calibrates on the default mixture, whose Chinese part is the other half of that file, except the ``-c4``
recipes, which calibrate on English alone to show what a text never seen in calibration gets). Prints a markdown
table with the exact commands, or JSON rows; a calibrated row whose perplexity is not below RTN's on a text is marked
(``worse_than_rtn`` lists those texts).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> lite arguments after the model (all but -c4 calibrate on the default mixture c4:3,zh:1, 128 x 512 tokens, seed
# 42: the defaults; the GPTQ defaults are act-order with static groups, and compressed-tensors for `gptq`)
RECIPES = {
    "rtn": ["rtn"],
    "rtn-sym": ["rtn", "--w-sym"],
    "awq": ["auto-awq"],
    "awq-tune": ["auto-awq", "--tune-steps", "100"],
    "gptq": ["gptq"],
    "gptq-c4": ["gptq", "--calib-dataset", "c4"],
    "gptq-c4-damp10": ["gptq", "--calib-dataset", "c4", "--damp-percent", "0.1"],
    "gptq-v1-sym": ["gptq", "--format", "gptq", "--no-act-order"],
    "gptq-asym": ["gptq", "--w-asym", "--format", "compressed-tensors", "--no-act-order"],
    "gptq-act-order": ["gptq", "--format", "gptq", "--act-order", "--no-static-groups"],
    "gptq-act-order-asym": ["gptq", "--act-order", "--no-static-groups", "--w-asym", "--format", "compressed-tensors"],
    "awq-gptq": ["auto-awq", "--rounding", "gptq"],
    "gptq-e2e": ["gptq", "--e2e-steps", "40"],
    "gptq-e2e20": ["gptq", "--e2e-steps", "20"],
    "awq-gptq-e2e20": ["auto-awq", "--rounding", "gptq", "--e2e-steps", "20"],
    "awq-gptq-plain": ["auto-awq", "--rounding", "gptq", "--no-act-order"],
    "awq-gptq-act-order": ["auto-awq", "--rounding", "gptq", "--act-order", "--no-static-groups", "--format",
                           "compressed-tensors"],
    "awq-gptq-act-order-damp10": ["auto-awq", "--rounding", "gptq", "--act-order", "--no-static-groups",
                                  "--damp-percent", "0.1", "--format", "compressed-tensors"],
    "awq-gptq-act-order-mse": ["auto-awq", "--rounding", "gptq", "--act-order", "--no-static-groups", "--mse-scales",
                               "--format", "compressed-tensors"],
    "awq-gptq-act-order-noclip": ["auto-awq", "--rounding", "gptq", "--act-order", "--no-static-groups", "--no-clip",
                                  "--format", "compressed-tensors"],
    "awq-gptq-act-order-mse-tune": ["auto-awq", "--rounding", "gptq", "--act-order", "--no-static-groups",
                                    "--mse-scales", "--tune-steps", "100", "--format", "compressed-tensors"],
    "awq-gptq-mse-tune": ["auto-awq", "--rounding", "gptq", "--mse-scales", "--tune-steps", "100"],
    "gptq-mse-tune30-s64": ["gptq", "--mse-scales", "--tune-steps", "30", "--calib-samples", "64"],
    "awq-gptq-mse-tune30-s64-g10": ["auto-awq", "--rounding", "gptq", "--mse-scales", "--tune-steps", "30",
                                    "--calib-samples", "64", "--n-grid", "10"],
    "rtn-rotate": ["rtn", "--rotate"],
    "awq-rotate": ["auto-awq", "--rotate"],
}


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
    ap.add_argument("--methods", default="fp16,rtn,awq,gptq,awq-gptq,gptq-e2e",
                    help=f"comma-separated: fp16, {', '.join(RECIPES)}")
    ap.add_argument("--eval", default="wikitext2,zh", help="evaluation texts (eval-ppl --dataset), first = the gap's")
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true",
                    help="score checkpoints already in --work (made by the commands shown) instead of re-making them")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="lt-quality-"))
    evals = args.eval.split(",")
    rows = []
    for name in args.methods.split(","):
        if name != "fp16" and name not in RECIPES:
            sys.exit(f"unknown method {name!r}; known: fp16, {', '.join(RECIPES)}")
        row = {"method": name}
        target = args.model
        if name != "fp16":
            out = work / name
            cmd = ["liteturbo", "lite", *RECIPES[name][:1], args.model, *RECIPES[name][1:],
                   "--w-group-size", str(args.group_size), "--work-dir", str(out), "--overwrite"]
            if not (args.reuse and (out / "liteturbo_quantize.json").is_file()):
                run(cmd)
            info = json.loads((out / "liteturbo_quantize.json").read_text())
            row.update(command=" ".join(cmd[:-3] + ["--work-dir", name]), seconds=info["wall_seconds"],
                       peak_gib=info["peak_memory_gib"], sym=info["options"]["w_sym"],
                       format=info["options"]["out_format"])
            target = str(out)
        for ds in evals:
            ecmd = ["liteturbo", "lite", "eval-ppl", target, "--seqlen", "2048", "--dataset", ds,
                    "--max-windows", str(args.max_windows), "--json"]
            log, _ = run(ecmd)
            row[f"ppl_{ds}"] = json.loads(log.strip().splitlines()[-1])["ppl"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    for ds in evals:
        base = next((r[f"ppl_{ds}"] for r in rows if r["method"] == "fp16"), None)
        rtn = next((r[f"ppl_{ds}"] for r in rows if r["method"] == "rtn"), None)
        for r in rows:
            if base and rtn and r["method"] not in ("fp16", "rtn"):
                r[f"gap_{ds}"] = (r[f"ppl_{ds}"] - base) / (rtn - base)
            if rtn and r["method"] not in ("fp16", "rtn"):
                r.setdefault("worse_than_rtn", [])
                if r[f"ppl_{ds}"] >= rtn:  # a calibrated method that loses to round-to-nearest on this text
                    r["worse_than_rtn"].append(ds)
    if args.json:
        print(json.dumps(rows))
        return
    heads = " | ".join(f"{ds} PPL | gap / RTN's" for ds in evals)
    print(f"| method | {heads} | quantize time (s) | peak memory (GiB) | command |")
    print("| --- |" + " ---: | ---: |" * len(evals) + " ---: | ---: | --- |")
    for r in rows:
        cells = " | ".join(f"{r[f'ppl_{ds}']:.2f} | " + (f"{r[f'gap_{ds}']:.0%}" if f"gap_{ds}" in r else "")
                           for ds in evals)
        mark = f" **worse than RTN on {', '.join(r['worse_than_rtn'])}**" if r.get("worse_than_rtn") else ""
        print(f"| {r['method']}{mark} | {cells} | {r.get('seconds', '')} | {r.get('peak_gib', '') or ''} | "
              f"`{r.get('command', 'liteturbo lite eval-ppl ' + args.model)}` |")


if __name__ == "__main__":
    main()
