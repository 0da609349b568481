"""Static sm_90 report of every Triton kernel configuration the engine launches, today's kernels beside the new ones.

    python bench/gpu_static.py [--json] [--old] [--quick]

Compiles each kernel for Hopper on this machine (no GPU needed; :mod:`bench.sm90` explains the method and the
numbers) and prints, per configuration: registers, spill bytes, shared memory, main-loop instructions per thread,
warp-instructions per unit of work and the H200 issue-bound ceiling as a fraction of the ~4.3 TB/s copy bandwidth.

- W4A16 (new, ``backends/triton/w4a16.py``): the GEMV kernel (small M) and the tensor-core kernel (larger M), bf16
  and fp16, every M bucket up to the dequantize crossover, group sizes 32/64/128/-1 (per channel), with the
  configuration and split-K an H200 (132 SMs) would get for a 4096 x 4096 weight; the load-time dequantize kernel.
  Unit: one weight (per row of M where the kernel serves several rows: ``per_weight_row``).
- W4A16 (old, ``kernels._w4a16_kernel`` / ``_dequant_w4_kernel``, the pre-issue-22 kernels kept as the reference
  path, still used for irregular act-order ``g_idx``): the same cases as launched by ``kernels.w4a16_gemm``.
- MoE W4A16 (``backends/triton/moe.py``): the fused experts kernel as :func:`backends.triton.moe.plan` launches it
  on an H200 for a Qwen3-30B-A3B sparse layer (hidden 2048, I 768, 128 experts, top-8): the gate/up launch (SiLU
  fused) and the down launch (routing weight fused) at T = 1 (decode), 16, 256, 512 and 2048 tokens, bf16 (and
  fp16 without ``--quick``), group sizes 128 (and 32, -1 without ``--quick``). Unit: one weight (gate/up reads two
  per output column); per weight row: divided by the rows an expert's block fills on average.
- Attention: from ``bench/gpu_static_attention.py`` (``rows(old)`` and ``summary(rows)``) when it exists.
- The row-wise kernels (RMSNorm, SiLU-and-mul, quantizing KV write, rotary fused with the KV write): registers
  and spills.

``--old`` prints today's (old) kernels' rows too (the JSON line always carries both W4A16 figures, and with
``--old`` today's attention figures as ``..._old``); ``--quick``: only M = 1 and group size 128, attention for GQA
groups 1 and 8 at head dim 128, the MoE kernel at T = 1 only, no row-wise kernels. The last stdout line with
``--json`` is one JSON object:
``w4a16_m1_warp_instr_per_weight`` (new, bf16, group 128; ``..._by_group`` and ``..._worst`` over the groups),
``w4a16_m1_warp_instr_per_weight_old``, ``attention_bf16_warp_instr_per_token_head``,
``attention_int4_warp_instr_per_token_head`` (null without the attention module), ``max_spill_bytes`` (new
kernels: W4A16, row-wise, MoE, attention; ``max_spill_config`` names the worst), ``max_spill_bytes_old``, the
issue-bound fractions, ``moe_decode_{gate_up,down}_{registers,spill_bytes,warp_instr_per_weight}`` (the MoE kernel
at T = 1, bf16, group 128) and ``max_spill_bytes_moe``, and ``toolchain`` (Triton's version, its ptxas's and
cuobjdump's ``--version`` lines, the target and ptxas options: registers and spills depend on the toolchain, not
on the host; :func:`sm90.toolchain`).
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton or any kernel module is imported: compile, not interpret

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import sm90  # noqa: E402

H200_SMS = sm90.H200_SMS
N_REF = K_REF = 4096  # the weight whose launch is modelled (multiples of 16: Triton's divisibility specialization)
DTYPES = {"bf16": "bf16", "fp16": "fp16"}
GROUPS = (32, 64, 128, -1)
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # up to the dequantize + cuBLAS crossover (128 rows)


def _ints(names, m):
    """Signature entries for int arguments; ``M == 1`` is specialized to a constant, as Triton's launcher does."""
    sig, const = {}, {}
    for n in names:
        if n == "M" and m == 1:
            const["M"] = 1
        else:
            sig[n] = "i32"
    return sig, const


def _row(name, rep, units, rows_used=1, bytes_per_unit=0.5, **extra):
    # kernels without a loop (one tile per program): the whole kernel is the work of one tile
    wipu = sm90.warp_instr_per_unit(rep, units, None if rep.get("loop") else rep["n_instructions"])
    bound = sm90.issue_bound(wipu / rows_used, bytes_per_unit)
    return {"name": name, "registers": rep["registers"], "spill_bytes": rep["spill_bytes"],
            "shared_bytes": rep["shared_bytes"], "n_instructions": rep["n_instructions"],
            "loop_instructions": sm90.loop_instructions(rep), "num_warps": rep["num_warps"],
            "num_stages": rep["num_stages"], "warp_instr_per_weight": round(wipu, 4),
            "warp_instr_per_weight_row": round(wipu / rows_used, 4),
            "issue_bound_fraction_of_copy_bw": round(bound["fraction_of_copy_bw"], 3),
            "loop_top": dict(list((rep["loop"] or {}).get("histogram", {}).items())[:6]), **extra}


# --- W4A16, new ----------------------------------------------------------------------------------------------------
def w4a16_new_rows(quick=False):
    """Report rows of the tiled W4A16 kernels as the engine launches them for a 4096 x 4096 weight on an H200 (the
    launch table's config and split per dtype, group size and M bucket) and of the load-time dequantize kernel."""
    from backends.triton import w4a16 as W

    out = []
    ms = (1,) if quick else M_BUCKETS
    groups = (128,) if quick else GROUPS
    cases = [(dt, gs) for dt in DTYPES for gs in groups] + [("fp32", 128)]  # float32 activations: one group size
    for dt, gs in cases:
        for m in ms:
            p = W.launch_params(m, N_REF, K_REF, gs, sms=H200_SMS, fp32=dt == "fp32")
            gemv = p["kind"] == "gemv"
            bm, bn, bk, split = p["block_m"], p["block_n"], p["block_k"], p["split"]
            sig, const = _ints(("M", "N", "K", "K8P", "NP", "stride_xm", "k_per_split"), m)
            sig.update(x_ptr=f"*{dt}", qw_ptr="*i32", s_ptr=f"*{dt}", z_ptr="*u8", bias_ptr=f"*{dt}",
                       out_ptr=f"*{dt}", ws_ptr="*fp32" if split > 1 else f"*{dt}",
                       cnt_ptr="*i32" if split > 1 else "*u8")
            const.update(GROUP=p["group"], HAS_BIAS=False, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         EVEN_K=True, EVEN_N=True)
            if gemv:
                const["ASM"] = True
                fn = W._w4a16_gemv_kernel
            else:
                const.update(IEEE=dt == "fp32", ASM=True)
                fn = W._w4a16_dot_kernel
            rep = sm90.compile_report(fn, sig, const, p["num_warps"], p["num_stages"],
                                      divisible=[n for n in sig if not sig[n].startswith("*")])
            out.append(_row(f"w4a16 new {p['kind']} {dt} M={m} g{gs} bm{bm} bn{bn} bk{bk} split{split}", rep,
                            bn * bk, min(m, bm), kernel="w4a16", version="new", dtype=dt, m=m, group_size=gs,
                            kind=p["kind"]))
    for dt in DTYPES:
        for gs in ((128,) if quick else GROUPS):
            sig = dict(qw_ptr="*i32", s_ptr=f"*{dt}", z_ptr="*u8", out_ptr=f"*{dt}", N="i32", K="i32", K8P="i32")
            const = dict(GROUP=W.kernel_group(gs, K_REF), BLOCK_K=64, BLOCK_N=64)
            rep = sm90.compile_report(W._dequant_tiled_kernel, sig, const, 4, 3, divisible=("N", "K", "K8P"))
            out.append(_row(f"w4a16 new dequant {dt} g{gs}", rep, 64 * 64, kernel="w4a16_dequant", version="new",
                            dtype=dt, group_size=gs))
    return out


# --- MoE W4A16 (backends/triton/moe.py) --------------------------------------------------------------------------
MOE_SHAPE = dict(hidden=2048, inter=768, experts=128, top_k=8)  # Qwen3-30B-A3B's sparse layers
MOE_TOKENS = (1, 16, 256, 512, 2048)


def moe_rows(quick=False):
    """Report rows of the fused MoE kernel (gate/up with SiLU, down with the routing weight) as
    :func:`backends.triton.moe.plan` launches it on an H200 for :data:`MOE_SHAPE` at :data:`MOE_TOKENS` tokens."""
    from backends.triton import moe as Moe

    out = []
    hidden, inter, experts, top_k = (MOE_SHAPE[k] for k in ("hidden", "inter", "experts", "top_k"))
    dts = ("bf16",) if quick else tuple(DTYPES)
    groups = (128,) if quick else (32, 128, -1)
    tokens = (1,) if quick else MOE_TOKENS
    for dt in dts:
        for gs in groups:
            for t in tokens:
                pairs = t * top_k
                p = Moe.plan(pairs, experts, hidden, inter, gs, gs, sms=H200_SMS)
                bm = p["block_m"]
                rows = min(bm, -(-pairs // min(experts, pairs)))  # rows an expert's block fills, on average
                for name, n, k, gated in (("gate_up", inter, hidden, True), ("down", hidden, inter, False)):
                    c = p[name]
                    bn, bk = c["block_n"], c["block_k"]
                    sn = 2 * n if gated else n
                    ints = dict(N=n, K=k, K8P=-(-k // 128) * 16, NT=-(-sn // 128), SN=sn,
                                stride_se=sn * (1 if gs <= 0 else k // gs), num_valid=pairs, stride_am=k,
                                stride_om=n)
                    sig = {key: "i32" for key in ints}
                    sig.update(a_ptr=f"*{dt}", qw_ptr="*i32", s_ptr=f"*{dt}", z_ptr="*u8", out_ptr=f"*{dt}",
                               tw_ptr=f"*{dt}", sorted_ptr="*i32", bexp_ptr="*i32", npad_ptr="*i32")
                    const = dict(TOP_K=top_k if gated else 1, GROUP=Moe.kernel_group(gs, k), GATED=gated,
                                 MUL_WEIGHT=not gated, IEEE=False, ASM=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 EVEN_K=k % bk == 0, EVEN_N=n % bn == 0)
                    rep = sm90.compile_report(Moe._moe_w4a16_kernel, sig, const, c["num_warps"], c["num_stages"],
                                              divisible=[key for key, v in ints.items() if v % 16 == 0])
                    units = bn * bk * (2 if gated else 1)
                    out.append(_row(f"moe {name} {dt} T={t} g{gs} bm{bm} bn{bn} bk{bk}", rep, units, rows,
                                    kernel="moe", dtype=dt, tokens=t, group_size=gs, launch=name, block_m=bm,
                                    block_n=bn, block_k=bk, programs_n=-(-n // bn)))
    return out


# --- W4A16, old (kernels.w4a16_gemm as launched by the backend before issue 22) ------------------------------------
def w4a16_old_rows(quick=False):
    """Report rows of the pre-issue-22 gptq-layout kernels (``kernels.w4a16_gemm``), the reference path."""
    from backends.triton import kernels as Kn

    out = []
    ms = (1,) if quick else M_BUCKETS
    for dt in DTYPES:
        for gs in ((128,) if quick else GROUPS):
            for m in ms:
                bm = 16 if m <= 16 else (32 if m <= 32 else 64)
                tiles = -(-m // 16) * -(-N_REF // 64)
                split = max(1, min(-(-2 * H200_SMS // tiles), K_REF // 512, 16)) if m <= 64 else 1
                sig, const = _ints(("M", "N", "K", "stride_xm", "group_size", "k_per_split"), m)
                sig.update(x_ptr=f"*{dt}", qw_ptr="*i32", s_ptr=f"*{dt}", z_ptr="*u8", g_ptr="*u8",
                           bias_ptr=f"*{dt}", out_ptr="*fp32" if split > 1 else f"*{dt}")
                const.update(HAS_GIDX=False, HAS_BIAS=False, SPLIT=split > 1, IEEE=False, BLOCK_M=bm, BLOCK_N=64,
                             BLOCK_K=64)
                rep = sm90.compile_report(Kn._w4a16_kernel, sig, const, 4, 3,
                                          divisible=[n for n in sig if not sig[n].startswith("*")])
                out.append(_row(f"w4a16 old dot {dt} M={m} g{gs} bm{bm} split{split}", rep, 64 * 64, min(m, bm),
                                kernel="w4a16", version="old", dtype=dt, m=m, group_size=gs, kind="dot"))
    for dt in DTYPES:
        sig = dict(qw_ptr="*i32", s_ptr=f"*{dt}", z_ptr="*u8", g_ptr="*u8", out_ptr=f"*{dt}", N="i32", K="i32",
                   group_size="i32")
        rep = sm90.compile_report(Kn._dequant_w4_kernel, sig, dict(HAS_GIDX=False, BLOCK_K=64, BLOCK_N=64), 4, 3,
                                  divisible=("N", "K", "group_size"))
        out.append(_row(f"w4a16 old dequant {dt}", rep, 64 * 64, kernel="w4a16_dequant", version="old", dtype=dt))
    return out


# --- row-wise kernels ------------------------------------------------------------------------------------------------
def rowwise_rows():
    """Report rows (registers, spills) of the row-wise kernels: RMSNorm, SiLU-and-mul, KV write, rotary."""
    from backends.triton import kernels as Kn

    out = []
    cases = []
    for dt in DTYPES:
        for res in (False, True):
            cases.append((f"rms_norm {dt} hidden 4096 res={res}", Kn._rms_norm_kernel,
                          dict(x_ptr=f"*{dt}", r_ptr=f"*{dt}", w_ptr=f"*{dt}", out_ptr=f"*{dt}", res_out_ptr=f"*{dt}",
                               stride_x="i32", stride_r="i32", stride_o="i32", stride_ro="i32", N="i32", eps="fp32"),
                          dict(HAS_RES=res, BLOCK=4096)))
        cases.append((f"silu_and_mul {dt}", Kn._silu_and_mul_kernel,
                      dict(gu_ptr=f"*{dt}", out_ptr=f"*{dt}", stride_gu="i32", stride_o="i32", I="i32"),
                      dict(BLOCK=1024)))
        for bits in (8, 4):
            for d in (64, 128):
                cases.append((f"kv_write int{bits} {dt} D={d}", Kn._kv_write_kernel,
                              dict(x_ptr=f"*{dt}", slots_ptr="*i32", store_ptr="*u8", scale_ptr="*fp16",
                                   zero_ptr="*u8", stride_xt="i32", stride_xh="i32", n_slots="i32"),
                              dict(D=d, HALF_PAD=d // 2, D_PAD=d, BITS=bits)))
        from backends.triton import rotary as Rt

        for write in (True, False):  # Llama-3-8B: 32 heads, 8 KV heads, head dim 128
            cases.append((f"rotary_kv_write {dt} H=32 KVH=8 D=128 write={write}", Rt._rotary_kv_kernel,
                          dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}",
                               slots_ptr="*i64", qo_ptr=f"*{dt}", ko_ptr=f"*{dt}", kc_ptr=f"*{dt}", vc_ptr=f"*{dt}",
                               stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32", stride_vt="i32",
                               stride_vh="i32", stride_ct="i32", n_slots="i32"),
                          dict(H=32, KVH=8, HALF=64, HALF_PAD=64, H_PAD=32, KVH_PAD=8, WRITE=write)))
    for name, fn, sig, const in cases:
        try:
            rep = sm90.compile_report(fn, sig, const, 4, 3)
        except Exception as e:  # a signature changed under us: report, do not fail the run
            out.append({"name": name, "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            continue
        out.append({"name": name, "registers": rep["registers"], "spill_bytes": rep["spill_bytes"],
                    "shared_bytes": rep["shared_bytes"], "n_instructions": rep["n_instructions"],
                    "num_warps": 4, "kernel": "rowwise", "version": "new"})
    return out


# --- attention (the other half's module) ---------------------------------------------------------------------------
def attention(old: bool, quick: bool = False):
    """``(new (rows, summary), old (rows, summary) or None, reason skipped or None)`` from
    ``bench/gpu_static_attention.py``."""
    path = HERE / "gpu_static_attention.py"
    if not path.exists():
        return None, None, "bench/gpu_static_attention.py not present yet"
    try:
        spec = importlib.util.spec_from_file_location("gpu_static_attention", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        kw = {}
        if quick:  # a corner of the grid: GQA groups 1 and 8, head dim 128
            import inspect

            if {"groups", "head_dims"} <= set(inspect.signature(mod.rows).parameters):
                kw = dict(groups=(1, 8), head_dims=(128,))
        new_rows = mod.rows(False, **kw)
        old_rows = mod.rows(True, **kw) if old else None
        return (new_rows, mod.summary(new_rows)), ((old_rows, mod.summary(old_rows)) if old_rows is not None
                                                   else None), None
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return None, None, f"bench/gpu_static_attention.py failed: {type(e).__name__}: {e}"


def _print_rows(title, rows):
    print(f"\n## {title}")
    for r in rows:
        if "skipped" in r:
            print(f"  {r['name']:<62} skipped: {r['skipped']}")
            continue
        if "registers" not in r:
            continue
        s = (f"  {r['name']:<62} w{r.get('num_warps', '?')} regs {r['registers']:>3} spill {r['spill_bytes']:>4}B "
             f"smem {r['shared_bytes']:>6}B")
        if "loop_instructions" in r:
            s += f" loop {r['loop_instructions']:>5}"
        if "warp_instr_per_weight" in r:
            s += f"  {r['warp_instr_per_weight']:.3f}/weight {r['warp_instr_per_weight_row']:.3f}/weight-row"
        if "warp_instr_per_token_head" in r:
            s += f"  {r['warp_instr_per_token_head']:.2f}/token-head"
        if "issue_bound_fraction_of_copy_bw" in r:
            s += f"  bound {r['issue_bound_fraction_of_copy_bw']:.2f}x copy bw"
        print(s)


def _pick(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def main(argv=None) -> dict:
    """Compile and print every row, then the summary; returns the summary dict (``{"error": ...}`` where no
    cuobjdump is found)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the headline figures")
    ap.add_argument("--old", action="store_true", help="also print today's (old) kernels' rows")
    ap.add_argument("--quick", action="store_true", help="only M = 1 and group size 128")
    args = ap.parse_args(argv)
    try:
        sm90.cuobjdump_path()
    except sm90.StaticReportError as e:
        print(f"static report unavailable: {e}")
        if args.json:
            print(json.dumps({"error": str(e)}))
        return {"error": str(e)}

    tc = sm90.toolchain()
    print(f"# toolchain: triton {tc['triton']}; ptxas {tc['ptxas']}; target {tc['target']} "
          f"(registers and spills depend on these, not on the host)")
    new = w4a16_new_rows(args.quick)
    old = w4a16_old_rows(args.quick)
    rowwise = [] if args.quick else rowwise_rows()
    moe = moe_rows(args.quick)
    _print_rows("W4A16 (new: backends/triton/w4a16.py)", new)
    _print_rows("MoE W4A16 (backends/triton/moe.py: Qwen3-30B-A3B layer, top-8 of 128 experts)", moe)
    if args.old:
        _print_rows("W4A16 (old: kernels._w4a16_kernel, the reference path)", old)
    if rowwise:
        _print_rows("row-wise kernels", rowwise)
    att_new, att_old, why = attention(args.old, args.quick)
    if why:
        print(f"\n## attention: skipped ({why})")
    else:
        _print_rows("attention (new, from bench/gpu_static_attention.py)",
                    [r for r in att_new[0] if isinstance(r, dict) and "name" in r])
        if att_old:
            _print_rows("attention (old)", [r for r in att_old[0] if isinstance(r, dict) and "name" in r])

    m1 = _pick(new, dtype="bf16", m=1, group_size=128, kernel="w4a16")
    m1_old = _pick(old, dtype="bf16", m=1, group_size=128, kernel="w4a16")
    compiled = [r for r in new + rowwise + moe if "spill_bytes" in r]
    att_sum = att_new[1] if att_new else {}
    if att_new:
        compiled += [r for r in att_new[0] if isinstance(r, dict) and "spill_bytes" in r]
    spills_new = [r["spill_bytes"] for r in compiled]
    worst_spill = max(compiled, key=lambda r: r["spill_bytes"]) if compiled else None
    m1_rows = [r for r in new if r.get("kernel") == "w4a16" and r.get("m") == 1]
    by_group = {str(g): max(r["warp_instr_per_weight"] for r in m1_rows if r["group_size"] == g)
                for g in sorted({r["group_size"] for r in m1_rows})}
    summary = {
        "w4a16_m1_warp_instr_per_weight": m1["warp_instr_per_weight"],
        "w4a16_m1_warp_instr_per_weight_old": m1_old["warp_instr_per_weight"],
        "w4a16_m1_issue_bound_fraction": m1["issue_bound_fraction_of_copy_bw"],
        "w4a16_m1_issue_bound_fraction_old": m1_old["issue_bound_fraction_of_copy_bw"],
        "w4a16_m1_registers": m1["registers"],
        "attention_bf16_warp_instr_per_token_head": att_sum.get("attention_bf16_warp_instr_per_token_head"),
        "attention_int4_warp_instr_per_token_head": att_sum.get("attention_int4_warp_instr_per_token_head"),
        "w4a16_m1_warp_instr_per_weight_by_group": by_group,
        "w4a16_m1_warp_instr_per_weight_worst": max(by_group.values()),
        "max_spill_bytes": max(spills_new) if spills_new else 0,
        "max_spill_config": worst_spill["name"] if worst_spill and worst_spill["spill_bytes"] else None,
        "max_spill_bytes_w4a16": max(r["spill_bytes"] for r in new),
        "max_spill_bytes_old": max(r["spill_bytes"] for r in old),
        "toolchain": tc,
    }
    for launch in ("gate_up", "down"):
        r = _pick(moe, dtype="bf16", tokens=1, group_size=128, launch=launch)
        if r:
            summary[f"moe_decode_{launch}_registers"] = r["registers"]
            summary[f"moe_decode_{launch}_spill_bytes"] = r["spill_bytes"]
            summary[f"moe_decode_{launch}_warp_instr_per_weight"] = r["warp_instr_per_weight"]
    summary["max_spill_bytes_moe"] = max((r["spill_bytes"] for r in moe), default=0)
    for key, val in (att_sum or {}).items():
        summary.setdefault(key, val)
    if att_old:
        for key in ("attention_bf16_warp_instr_per_token_head", "attention_int8_warp_instr_per_token_head",
                    "attention_int4_warp_instr_per_token_head"):
            summary[key + "_old"] = att_old[1].get(key)
    print("\n## summary")
    for key, val in summary.items():
        print(f"  {key}: {val}")
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
