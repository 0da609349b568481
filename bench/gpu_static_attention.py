"""Static sm_90 report of the paged decode attention: the new kernel (``backends/triton/attention.py``) beside
today's (``kernels._paged_attention_kernel``), compiled for Hopper on this machine (no GPU; :mod:`bench.sm90` explains
the method).

    python bench/gpu_static_attention.py [--json] [--quick]

One row per configuration the engine launches: KV cache bf16 / int8 / int4, GQA group (query heads per KV head)
1-8, head dim 64 / 128, compute dtype bf16, the cache's default block size (64, ``EngineConfig.block_size``), each
kernel with the launch parameters its wrapper uses (new: :func:`backends.triton.attention.config`; old:
``BLOCK_N=32``, Triton's default 4 warps and 3 stages). The unit of work is one token of context for one KV head
(the ``G`` query heads of that KV head are served by the same program):
``warp_instr_per_token_head = loop_instructions * num_warps / BLOCK_N``. The ceiling that count puts on the kernel
(:func:`sm90.issue_bound`) is in token-heads/s and in KV bytes/s (keys and values, scales and zero points included:
``2 * 2D`` bytes for bf16, ``2 * (D + 3)`` int8, ``2 * (D/2 + 3)`` int4), and as a ratio to what a bf16 cache of the
same head dim reaches at the copy bandwidth (``vs_bf16_memory_bound``: 2 means the int4 kernel can serve twice
the tokens per second of a memory-bound bf16 kernel).

``rows(old)`` and ``summary(rows)`` are what ``bench/gpu_static.py`` imports.
"""
from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported: compile, not interpret

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import sm90  # noqa: E402

KV_KINDS = {"bf16": 16, "int8": 8, "int4": 4}
GROUPS = tuple(range(1, 9))
HEAD_DIMS = (64, 128)
BLOCK_SIZE = 64  # EngineConfig.block_size's default: the tiles of the new kernel lie inside one cache block
OLD = dict(block_n=32, num_warps=4, num_stages=3)  # kernels.paged_attention's launch (Triton's defaults)
# integer arguments that are multiples of 16 in the modelled launch (Triton's divisibility specialization)
DIVISIBLE = ("stride_qt", "stride_ot", "n_slots")


def _signature(fn, dtype: str, kv_bits: int, split: bool) -> dict:
    """Triton type strings for every runtime argument of the attention kernels."""
    kv = f"*{dtype}" if kv_bits == 16 else "*u8"
    types = {"q_ptr": f"*{dtype}", "o_ptr": "*fp32" if split else f"*{dtype}", "ml_ptr": "*fp32", "k_ptr": kv,
             "v_ptr": kv, "ks_ptr": "*fp16", "kz_ptr": "*u8", "vs_ptr": "*fp16", "vz_ptr": "*u8",
             "rows_ptr": "*i32", "seq_ptr": "*i32", "ctx_ptr": "*i32", "bt_ptr": "*i32", "scale": "fp32",
             "qk_scale": "fp32", "acc_ptr": "*fp32", "out_ptr": f"*{dtype}"}
    sig = {}
    for name in fn.arg_names:
        if name in types:
            sig[name] = types[name]
        elif not name.isupper():  # runtime ints; the constexprs are upper case
            sig[name] = "i32"
    return sig


def bytes_per_token_head(kv: str, d: int) -> int:
    """KV bytes one token of one KV head reads (keys and values; scales and zero points for int8/int4)."""
    bits = KV_KINDS[kv]
    return 2 * (d * 2 if bits == 16 else d * bits // 8 + 3)


def _report(kernel_name, fn, sig, const, warps, stages, block_n, kv, g, d, **extra) -> dict:
    row = {"name": f"{kernel_name} kv={kv} G={g} D={d}", "kernel": kernel_name, "kv": kv, "group": g, "head_dim": d,
           "block_n": block_n, "num_warps": warps, "num_stages": stages, **extra}
    try:
        rep = sm90.compile_report(fn, sig, const, warps, stages, divisible=DIVISIBLE)
    except Exception as e:  # a signature changed under us: say so in the row, do not fail the run
        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    wipu = sm90.warp_instr_per_unit(rep, block_n)
    nbytes = bytes_per_token_head(kv, d)
    bound = sm90.issue_bound(wipu, nbytes)
    bf16_mem = sm90.H200_COPY_BW / bytes_per_token_head("bf16", d)  # token-heads/s of a memory-bound bf16 kernel
    row.update({
        "registers": rep["registers"], "spill_bytes": rep["spill_bytes"], "shared_bytes": rep["shared_bytes"],
        "n_instructions": rep["n_instructions"], "loop_instructions": sm90.loop_instructions(rep),
        "warp_instr_per_token_head": round(wipu, 2), "bytes_per_token_head": nbytes,
        "issue_bound_token_heads_per_s": round(bound["units_per_s"], -6),
        "issue_bound_bytes_per_s": round(bound["bytes_per_s"], -9),
        "issue_bound_fraction_of_copy_bw": round(bound["fraction_of_copy_bw"], 3),
        "vs_bf16_memory_bound": round(bound["units_per_s"] / bf16_mem, 3),
        "loop_top": dict(list((rep["loop"] or {}).get("histogram", {}).items())[:6]),
    })
    return row


def _new_row(kv: str, g: int, d: int, dtype: str = "bf16", block_size: int = BLOCK_SIZE) -> dict:
    from backends.triton import attention as A

    import torch

    bits = KV_KINDS[kv]
    cfg = A.config(bits, d, block_size)
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    const = dict(A.constexprs(tdtype, bits, g, d, block_size, cfg["block_n"], interpret=False), SPLIT=False)
    fn = A._decode_attention_kernel
    return _report("decode", fn, _signature(fn, dtype, bits, False), const, cfg["num_warps"], cfg["num_stages"],
                   cfg["block_n"], kv, g, d, block_size=block_size, dtype=dtype)


def _old_row(kv: str, g: int, d: int, dtype: str = "bf16") -> dict:
    from backends.triton import kernels as K

    bits = KV_KINDS[kv]
    const = dict(G=g, G_PAD=K._next_pow2(g), D=d, D_PAD=K._next_pow2(d), KV_BITS=bits, BLOCK_N=OLD["block_n"],
                 SPLIT=False)
    fn = K._paged_attention_kernel
    return _report("old", fn, _signature(fn, dtype, bits, False), const, OLD["num_warps"], OLD["num_stages"],
                   OLD["block_n"], kv, g, d, dtype=dtype)


def _combine_row(d: int, dtype: str = "bf16") -> dict:
    from backends.triton import attention as A

    fn = A._combine_kernel
    row = _report("combine", fn, _signature(fn, dtype, 16, False), dict(D=d, D_PAD=d), 4, 3, 1, "bf16", 1, d)
    # its loop runs over partitions, not tokens: the per-token figures do not apply
    for key in ("warp_instr_per_token_head", "issue_bound_token_heads_per_s", "issue_bound_bytes_per_s",
                "issue_bound_fraction_of_copy_bw", "vs_bf16_memory_bound"):
        row.pop(key, None)
    return row


def rows(old: bool, groups=GROUPS, head_dims=HEAD_DIMS, kvs=tuple(KV_KINDS), dtype: str = "bf16") -> list[dict]:
    """One dict per configuration (see the module docstring): today's kernel (``old=True``) or the new one (with
    the split-KV combine kernel's rows, ``kernel == "combine"``)."""
    out = []
    for kv in kvs:
        for d in head_dims:
            for g in groups:
                out.append(_old_row(kv, g, d, dtype) if old else _new_row(kv, g, d, dtype))
    if not old:
        out += [_combine_row(d, dtype) for d in head_dims]
    return out


def summary(rs: list[dict]) -> dict:
    """Headline figures of :func:`rows`' output: per KV kind the worst warp-instructions per token x KV head over
    the GQA groups and head dims (``..._config`` names the row it comes from), the int4 issue bound against a
    memory-bound bf16 cache (worst head dim), and the largest spill of any row."""
    out = {}
    attn = [r for r in rs if "warp_instr_per_token_head" in r]
    for kv in KV_KINDS:
        mine = [r for r in attn if r["kv"] == kv]
        if not mine:
            continue
        worst = max(mine, key=lambda r: r["warp_instr_per_token_head"])
        out[f"attention_{kv}_warp_instr_per_token_head"] = worst["warp_instr_per_token_head"]
        out[f"attention_{kv}_config"] = worst["name"]
        out[f"attention_{kv}_vs_bf16_memory_bound"] = min(r["vs_bf16_memory_bound"] for r in mine)
        out[f"attention_{kv}_max_registers"] = max(r["registers"] for r in mine)
    compiled = [r for r in rs if "spill_bytes" in r]
    out["attention_max_spill_bytes"] = max((r["spill_bytes"] for r in compiled), default=None)
    out["attention_rows_skipped"] = sum(1 for r in rs if "skipped" in r)
    return out


def _table(new: list[dict], old: list[dict]) -> str:
    """Old and new side by side, one line per (kv, D, G)."""
    by_key = {(r["kv"], r["head_dim"], r["group"]): r for r in old}
    head = (f"{'kv':<5}{'D':>4}{'G':>3} | {'old: regs':>9} {'spill':>6} {'loop':>5} {'wi/tok·h':>9} | "
            f"{'new: regs':>9} {'spill':>6} {'smem':>6} {'loop':>5} {'wi/tok·h':>9} {'bound':>6} {'vs bf16':>8}")
    lines = [head, "-" * len(head)]
    for r in new:
        if r["kernel"] != "decode":
            continue
        o = by_key.get((r["kv"], r["head_dim"], r["group"]), {})

        def cell(x, key, width, fmt="{}"):
            return f"{fmt.format(x[key]) if key in x else '-':>{width}}"

        lines.append(f"{r['kv']:<5}{r['head_dim']:>4}{r['group']:>3} | {cell(o, 'registers', 9)} "
                     f"{cell(o, 'spill_bytes', 6)} {cell(o, 'loop_instructions', 5)} "
                     f"{cell(o, 'warp_instr_per_token_head', 9, '{:.1f}')} | {cell(r, 'registers', 9)} "
                     f"{cell(r, 'spill_bytes', 6)} {cell(r, 'shared_bytes', 6)} {cell(r, 'loop_instructions', 5)} "
                     f"{cell(r, 'warp_instr_per_token_head', 9, '{:.1f}')} "
                     f"{cell(r, 'issue_bound_fraction_of_copy_bw', 6, '{:.2f}')} "
                     f"{cell(r, 'vs_bf16_memory_bound', 8, '{:.2f}')}")
    for r in new + old:
        if "skipped" in r:
            lines.append(f"skipped {r['name']}: {r['skipped']}")
    for r in new:
        if r["kernel"] == "combine" and "registers" in r:
            lines.append(f"combine D={r['head_dim']}: regs {r['registers']} spill {r['spill_bytes']}B "
                         f"loop {r['loop_instructions']} (per partition)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="end with one JSON line: both summaries")
    ap.add_argument("--quick", action="store_true", help="GQA groups 1 and 8 only")
    args = ap.parse_args(argv)
    groups = (1, 8) if args.quick else GROUPS
    new, old = rows(False, groups), rows(True, groups)
    print("paged decode attention, sm_90 static report (compute bf16, block size 64; 'bound' = issue-bound KV "
          "bytes/s over the ~4.3 TB/s copy bandwidth; 'vs bf16' = issue-bound token-heads/s over a memory-bound bf16 "
          "cache's)")
    print(_table(new, old))
    out = {"new": summary(new), "old": summary(old)}
    print("\nsummary (worst over groups and head dims)")
    for key in out["new"]:
        print(f"  {key}: new {out['new'][key]}  old {out['old'].get(key)}")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
