"""The one-call GPU harness (bench/gpu_compass.py) rehearsed on the CPU, so that no Python error can waste the GPU call.

The dry run uses Triton's interpreter, tiny shapes and wall clocks; it must leave one row per section (numbers or a
skip reason, never an error), at most 8 files, and a float64 check that agrees with what was timed. A second run
injects a crash, a hang, an exception and a sticky GPU error into sections and checks that each is recorded and the
run goes on to the next section.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the end-to-end tier (README)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_compass.py"
SECTIONS = ["env", "w4a16", "attention", "check", "checkpoint", "decode", "logits", "tests"]

pytest.importorskip("triton")


def _run(out: Path, *args: str, env_extra: dict | None = None, timeout: float = 175) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("GPU_COMPASS_FAULT", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _rows(out: Path) -> list[dict]:
    lines = (out / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]  # every line is valid JSON
    assert rows
    return rows


def _numbers(row: dict) -> bool:
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in row.items() if k != "t")


def test_dry_run_fills_every_section(tmp_path):
    out = tmp_path / "res"
    t = time.time()
    p = _run(out, "--budget-s", "150")
    took = time.time() - t
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(x.name for x in out.iterdir())
    assert len(files) <= 8, files
    assert {"results.jsonl", "compass.txt"} <= set(files)
    rows = _rows(out)
    errors = [r for r in rows if r.get("error")]
    assert not errors, "error rows: " + "\n".join(f"{r['section']}: {r['error']}\n{r.get('traceback', '')}"
                                                 for r in errors)
    for r in rows:
        assert isinstance(r.get("section"), str), r
        assert r.get("skipped") or _numbers(r), f"a row with neither numbers nor a skip reason: {r}"
    by = {s: [r for r in rows if r["section"] == s] for s in SECTIONS}
    for s, rs in by.items():
        assert rs, f"no row for section {s}"
    # the sections that the CPU can rehearse in full leave measured rows, not only skips
    for s in ("env", "w4a16", "attention", "check", "checkpoint", "decode", "logits", "tests"):
        assert any(not r.get("skipped") for r in by[s]), f"section {s} was only skipped: {by[s]}"
    assert any(r.get("impl") == "triton" and r.get("us") for r in by["w4a16"])
    assert any(r.get("impl") == "cublas" and r.get("us") for r in by["w4a16"])
    assert {r["kv"] for r in by["attention"] if r.get("us_per_layer")} == {"bfloat16", "int8", "int4"}
    # the float64 check of what was timed: W4A16 for every implementation, attention for every KV dtype
    checks = [r for r in by["check"] if "max_rel_err" in r]
    assert {r["impl"] for r in checks if r["kind"] == "w4a16"} >= {"triton", "cublas", "dequant_mm"}
    assert {r["kv"] for r in checks if r["kind"] == "attention"} == {"bfloat16", "int8", "int4"}
    bad = [r for r in checks if not r["ok"] or r["max_rel_err"] is None or r["max_rel_err"] > 0.05]
    assert not bad, f"float64 check over tolerance: {bad}"
    assert any(r.get("load_s") for r in by["checkpoint"])
    assert any(r.get("tokens_per_s") for r in by["decode"])
    lg = [r for r in by["logits"] if "max_abs_diff_logprob" in r]
    assert lg and all(r["max_abs_diff_logprob"] is not None and r["max_abs_diff_logprob"] < 1e-3 for r in lg), lg
    assert any("collected" in str(r.get("summary")) for r in by["tests"]), by["tests"]
    # the table is printed last and written to compass.txt
    table = (out / "compass.txt").read_text()
    assert "W4A16" in table and "attention" in table and "float64 check" in table
    assert p.stdout.rstrip().endswith(table.rstrip())
    assert took < 180, f"the dry run took {took:.0f} s"


def test_faults_are_recorded_and_the_run_goes_on(tmp_path):
    """A crash (the process dies), a hang (ended at the section's hard limit), an exception and a sticky GPU error:
    each leaves an error row for its section, and the next section still runs in a fresh process."""
    out = tmp_path / "res"
    t = time.time()
    p = _run(out, "--sections", "env,attention,check,logits", "--budget-s", "30",
             env_extra={"GPU_COMPASS_FAULT": "env:crash,attention:raise,check:hang,logits:sticky"}, timeout=90)
    took = time.time() - t
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(out)
    err = {r["section"]: r["error"] for r in rows if r.get("error")}
    assert "died" in err["env"]
    assert "injected fault in attention" in err["attention"]
    assert "over its time" in err["check"]
    assert "sticky" in err["logits"]
    for s in ("w4a16", "checkpoint", "decode", "tests"):
        assert any(r["section"] == s and "not asked" in str(r.get("skipped")) for r in rows), s
    assert took < 60, took
    # nothing the harness started is left running
    mine = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if str(out) in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    mine.append(d.name)
            except OSError:
                pass
    assert not mine, f"processes left running: {mine}"
