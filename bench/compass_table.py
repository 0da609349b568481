"""The compass table of the GPU harness (bench/gpu_compass.py): every measured number beside its ceiling or
baseline and the ratio, rendered from the rows of ``results.jsonl``; printed last and written to ``compass.txt``.
"""
from __future__ import annotations

from compass_common import GIB, MIB, NAMES


def _f(v, fmt="{:.0f}", none="-"):
    if v is None:
        return none
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _g(v) -> str:
    """A rate with about three significant digits."""
    if v is None:
        return "-"
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 0.01 else f"{v:.0e}"


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def compass(rows: list[dict], budget: float, dry: bool) -> str:
    out = []
    env = {}
    for r in rows:
        if r.get("section") == "env":
            env.update({k: v for k, v in r.items() if v is not None})
    copy = env.get("copy_gbps")
    title = "liteturbo GPU compass" + (" (DRY RUN: CPU, Triton interpreter, tiny shapes)" if dry else "")
    out.append(f"== {title} ==")
    out.append(f"device {env.get('device_name', '?')}  SMs {env.get('sms', '?')}  L2 "
               f"{_f((env.get('l2_bytes') or 0) / MIB, '{:.0f} MiB') if env.get('l2_bytes') else '-'}  torch "
               f"{env.get('torch', '?')}  CUDA {env.get('cuda', '-')}  triton {env.get('triton', '?')}  "
               f"transformers {env.get('transformers', '?')}")
    out.append(f"ceilings: copy {_g(copy)} GB/s (read+write of {_f((env.get('bytes') or 0) / GIB, '{:.2f}')} GiB), "
               f"{env.get('dtype', '')} matmul {_g(env.get('matmul_tflops'))} TFLOP/s   budget {budget:.0f} s")

    # W4A16
    w = [r for r in rows if r.get("section") == "w4a16" and r.get("us") is not None]
    if w:
        out.append("")
        out.append("W4A16 (us per call; GB/s of 4-bit weight bytes; %copy = of the copy bandwidth; xcuBLAS = cuBLAS "
                   "16-bit time / time)")
        out.append(f"{'dtype':5} {'shape':7} {'M':>3} | {'triton':>8} {'GB/s':>6} {'%copy':>5} {'xcuBLAS':>7} | "
                   f"{'cuBLAS':>8} {'GB/s':>6} | {'deq+mm':>8} {'xcuB':>5} | {'t-int4':>8} {'xcuB':>5} | timing")
        keys = []
        for r in w:
            k = (r["dtype"], r["shape"], r["M"])
            if k not in keys:
                keys.append(k)
        by = {(r["dtype"], r["shape"], r["M"], r["impl"]): r for r in w}
        for dt, sh, m in keys:
            t, cb = by.get((dt, sh, m, "triton")), by.get((dt, sh, m, "cublas"))
            dq, i4 = by.get((dt, sh, m, "dequant_mm")), by.get((dt, sh, m, "torch_int4"))

            def x(r):
                return cb["us"] / r["us"] if r and cb else None
            timing = (t or cb or {}).get("timing", "")
            out.append(f"{_SHORT.get(dt, dt):5} {sh:7} {m:>3} | {_f(t and t['us'], '{:8.1f}'):>8} {_g(t and t['gbps']):>6} "
                       f"{_f(t and t.get('frac_copy') and 100 * t['frac_copy']):>5} {_f(x(t), '{:.2f}'):>7} | "
                       f"{_f(cb and cb['us'], '{:8.1f}'):>8} {_g(cb and cb['gbps']):>6} | "
                       f"{_f(dq and dq['us'], '{:8.1f}'):>8} {_f(x(dq), '{:.2f}'):>5} | "
                       f"{_f(i4 and i4['us'], '{:8.1f}'):>8} {_f(x(i4), '{:.2f}'):>5} | {timing.split(' ')[0]}")
        # one decoder layer's linears (every shape) at each M: the sums of times, the targets' terms
        for dt in dict.fromkeys(k[0] for k in keys):
            for m in dict.fromkeys(k[2] for k in keys if k[0] == dt):
                shapes = [k[1] for k in keys if k[0] == dt and k[2] == m]
                t = [by.get((dt, sh, m, "triton")) for sh in shapes]
                cb = [by.get((dt, sh, m, "cublas")) for sh in shapes]
                if m not in (1, max(k[2] for k in keys)) or not all(t) or not all(cb):
                    continue
                tt, tc = sum(r["us"] for r in t), sum(r["us"] for r in cb)
                gb = sum(r["bytes"] for r in t) / (tt / 1e6) / 1e9
                out.append(f"  layer ({'+'.join(shapes)}) {_SHORT.get(dt, dt)} M={m}: triton {tt:.1f} us = {_g(gb)} GB/s"
                           f" = {_f(copy and 100 * gb / copy)}% of copy; cuBLAS {tc:.1f} us: x{tc / tt:.2f}"
                           + ("  (targets at M=1: >= 70% of copy, >= 2.5x cuBLAS)" if m == 1 else ""))
    # attention
    a = [r for r in rows if r.get("section") == "attention" and r.get("us_per_layer") is not None]
    if a:
        ctx = a[0].get("ctx")
        out.append("")
        out.append(f"paged decode attention, context {ctx}, {a[0].get('layers')} layers of cache (us per layer call; "
                   f"Mtok-heads/s = context tokens x KV heads read per s; xbf16 = bf16 time / time)")
        out.append(f"{'kv':8} {'batch':>5} | {'us':>8} {'GB/s':>6} {'%copy':>5} {'Mtok-h/s':>9} {'xbf16':>6} | timing")
        bf = {r["batch"]: r for r in a if r["kv"] == "bfloat16"}
        for r in a:
            ref = bf.get(r["batch"])
            out.append(f"{r['kv']:8} {r['batch']:>5} | {_f(r['us_per_layer'], '{:8.1f}'):>8} {_g(r['gbps']):>6} "
                       f"{_f(r.get('frac_copy') and 100 * r['frac_copy']):>5} {_g(r['token_heads_per_s'] / 1e6):>9} "
                       f"{_f(ref['us_per_layer'] / r['us_per_layer'] if ref else None, '{:.2f}'):>6} | "
                       f"{str(r.get('timing', '')).split(' ')[0]}")
    # check
    c = [r for r in rows if r.get("section") == "check" and "max_rel_err" in r]
    if c:
        out.append("")
        bad = [r for r in c if not r.get("ok")]
        worst = {}
        for r in c:
            k = (r.get("kind"), r.get("impl"), r.get("dtype") or r.get("kv"))
            e = r.get("max_rel_err")
            worst[k] = max(worst.get(k, 0.0), e if e is not None else float("inf"))
        items = [f"{k[0]}/{k[1]}/{_SHORT.get(k[2], k[2])} {v:.1e}" for k, v in worst.items()]
        out.append(f"float64 check ({len(c)} outputs, {len(bad)} over tolerance; max |y - ref| / max |ref|):")
        for i in range(0, len(items), 4):
            out.append("  " + ", ".join(items[i:i + 4]))
        for r in bad[:6]:
            out.append(f"  OVER TOLERANCE: {r.get('kind')} {r.get('impl')} "
                       + " ".join(f"{k}={r[k]}" for k in ("dtype", "shape", "M", "kv", "batch") if r.get(k) is not None)
                       + f" err {_f(r.get('max_rel_err'), '{:.2e}')} (tol {r.get('tol')})")
    # checkpoint + decode
    ck = [r for r in rows if r.get("section") == "checkpoint" and not r.get("skipped") and not r.get("error")]
    dec = [r for r in rows if r.get("section") == "decode" and r.get("run")]
    loads = [r for r in rows if r.get("kind") == "load" and r.get("load_s") is not None]
    if ck or dec:
        out.append("")
        b = next((r for r in ck if r.get("kind") == "build"), {})
        p = next((r for r in ck if r.get("kind") == "probe"), {})
        out.append(f"checkpoint: {b.get('layers', '?')}/{b.get('full_layers', '?')} layers, "
                   f"{_f(b.get('gbytes'), '{:.2f}')} GB built in {_f(b.get('build_s'), '{:.1f}')} s; loads "
                   + ", ".join(f"{r.get('kv_cache_dtype') or r.get('kv')}: {r['load_s']:.1f} s" for r in loads)
                   + (f"; probes predicted {_g(p['est_full_s'])} s for the full model" if p.get("est_full_s") else ""))
    if dec:
        lay = next((r.get("layers") for r in dec if r.get("layers")), "?")
        out.append(f"decode ({lay}-layer model; ms per step; GPU ms = GPU busy per decode step (profiler); roofline = "
                   f"(weight + KV bytes per step) / copy bandwidth)")
        out.append(f"{'kv':8} {'run':8} | {'tok/s':>8} {'ms/step':>8} {'wall ms':>8} {'GPU ms':>7} {'kern/st':>7} "
                   f"{'roof ms':>8} {'%roof':>6} | {'ttft ms':>8}")
        for r in dec:
            if r.get("skipped"):
                continue
            out.append(f"{str(r.get('kv_cache_dtype') or r.get('kv')):8} {r['run']:8} | "
                       f"{_f(r.get('tokens_per_s'), '{:8.1f}'):>8} {_f(r.get('decode_ms_per_step'), '{:8.2f}'):>8} "
                       f"{_f(r.get('prof_wall_ms_per_step'), '{:8.2f}'):>8} {_f(r.get('gpu_ms_per_step'), '{:7.2f}'):>7} "
                       f"{_f(r.get('kernels_per_step')):>7} {_f(r.get('roofline_ms'), '{:8.2f}'):>8} "
                       f"{_f(r.get('frac_roofline') and 100 * r['frac_roofline'], '{:.0f}'):>6} | "
                       f"{_f(r.get('ttft_ms'), '{:8.1f}'):>8}")
    lg = [r for r in rows if r.get("section") == "logits" and "max_abs_diff_logprob" in r]
    if lg:
        out.append("")
        out.append("GPU vs CPU float32: " + "; ".join(
            f"{r['model']}: max |dlogprob| {_f(r['max_abs_diff_logprob'], '{:.1e}')}, tokens "
            f"{'equal' if r.get('tokens_equal') else 'DIFFER'}" for r in lg))
    ts = [r for r in rows if r.get("section") == "tests" and "summary" in r]
    if ts:
        out.append("")
        out.append(f"tests (rc {ts[-1].get('rc')}, {_f(ts[-1].get('seconds'))} s): {ts[-1]['summary']}")
    # skips and errors
    probs = [r for r in rows if r.get("error") or (r.get("skipped") and r.get("section") != "w4a16")]
    w4skips = [r for r in rows if r.get("skipped") and r.get("section") == "w4a16"]
    if probs or w4skips:
        out.append("")
        out.append("skipped / errors:")
        for r in probs[:14]:
            what = " ".join(f"{k}={r[k]}" for k in ("kind", "impl", "dtype", "shape", "M", "kv", "batch", "run", "model")
                            if r.get(k) is not None)
            msg = ("ERROR " + str(r["error"])) if r.get("error") else ("skipped: " + str(r["skipped"]))
            out.append(f"  {r['section']}{' ' + what if what else ''}: {msg}"[:200])
        if len(probs) > 14:
            out.append(f"  ... {len(probs) - 14} more in results.jsonl")
        if w4skips:
            reasons = sorted({str(r["skipped"])[:90] for r in w4skips})
            out.append(f"  w4a16: {len(w4skips)} skipped ({'; '.join(reasons[:3])})"[:300])
    n_err = sum(1 for r in rows if r.get("error"))
    done = sorted({r.get("section") for r in rows if not r.get("skipped") and not r.get("error")} & set(NAMES),
                  key=NAMES.index)
    out.append(f"sections with results: {', '.join(done)}; {n_err} error rows; {len(rows)} rows in results.jsonl")
    return "\n".join(out)
