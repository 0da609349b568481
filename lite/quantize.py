"""The quantization pipeline: read a checkpoint, quantize the decoder linears, write a W4A16 checkpoint."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .formats import (DECODER_LINEARS, LiteturboError, arch_spec, atomic_output_dir, awq_quantization_config,
                      copy_tokenizer_files, load_config, load_state_dict, pack_awq, resolve_model, write_json)
from .rtn import quantize_rtn


@dataclass
class QuantConfig:
    """Options of a weight-quantization run (validated on construction).

    w_bits: bits per weight (the AWQ GEMM format stores 4). w_group_size: input channels per group, or -1.
    w_sym: symmetric (no zero point). work_dir: output checkpoint folder. overwrite: replace ``work_dir``.
    """

    w_bits: int = 4
    w_group_size: int = 128
    w_sym: bool = False
    work_dir: str = "./work_dir"
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.w_bits != 4:
            raise LiteturboError(f"--w-bits {self.w_bits} is not supported: the AWQ GEMM format stores 4-bit weights")
        if self.w_group_size != -1 and (self.w_group_size < 8 or self.w_group_size % 8):
            raise LiteturboError(f"--w-group-size must be -1 or a positive multiple of 8, got {self.w_group_size}")


def decoder_linear_names(state_dict: dict, num_layers: int) -> list[str]:
    """Module paths of the decoder linears present in ``state_dict``, in layer order."""
    names = []
    for i in range(num_layers):
        for lin in DECODER_LINEARS:
            p = f"model.layers.{i}.{lin}"
            if f"{p}.weight" in state_dict:
                names.append(p)
    return names


def check_group_size(state_dict: dict, names: list[str], group_size: int) -> None:
    """Raise ``LiteturboError`` naming the first layer whose in_features is not divisible by ``group_size``."""
    if group_size == -1:
        return
    for p in names:
        out_f, in_f = state_dict[f"{p}.weight"].shape
        if in_f % group_size:
            good = [g for g in (128, 64, 32) if all(state_dict[f"{n}.weight"].shape[1] % g == 0 for n in names)]
            hint = f"; use --w-group-size {good[0]}" if good else "; use --w-group-size -1 (per-channel)"
            raise LiteturboError(f"layer {p} has in_features={in_f}, which is not divisible by the group size "
                                 f"{group_size}{hint}")
        if out_f % 8:
            raise LiteturboError(f"layer {p} has out_features={out_f}, not a multiple of 8 as AWQ GEMM packing needs")


def quantize_checkpoint(model: str | None, qcfg: QuantConfig, method: str = "rtn") -> Path:
    """Quantize ``model`` (name or folder) with ``method`` and write an AWQ GEMM checkpoint to ``qcfg.work_dir``.

    Validates everything (architecture, group-size divisibility, output folder) before any work. Returns the
    output folder. Raises ``LiteturboError`` for bad input.
    """
    t0 = time.perf_counter()
    src = resolve_model(model)
    config = load_config(src)
    arch_spec(config)
    if config.get("quantization_config"):
        raise LiteturboError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                             f"start from a 16/32-bit checkpoint")
    out = Path(qcfg.work_dir).expanduser().absolute()
    if out.exists() and not qcfg.overwrite and (not out.is_dir() or any(out.iterdir())):
        raise LiteturboError(f"{out} already exists; choose another --work-dir or pass --overwrite")
    sd = load_state_dict(src)
    names = decoder_linear_names(sd, int(config["num_hidden_layers"]))
    if not names:
        raise LiteturboError(f"no decoder linear weights (model.layers.N.*_proj.weight) found in {src}")
    check_group_size(sd, names, qcfg.w_group_size)

    if method != "rtn":
        raise LiteturboError(f"unknown method {method!r}")
    with atomic_output_dir(out, overwrite=qcfg.overwrite) as tmp:
        from safetensors.torch import save_file

        for p in tqdm(names, desc=f"{method} W{qcfg.w_bits}A16 g{qcfg.w_group_size}", unit="linear"):
            w = sd.pop(f"{p}.weight")
            qw = quantize_rtn(w, qcfg.w_bits, qcfg.w_group_size, qcfg.w_sym)
            for k, v in pack_awq(qw).items():
                sd[f"{p}.{k}"] = v
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config = dict(config)
        config["quantization_config"] = awq_quantization_config(qcfg.w_bits, qcfg.w_group_size, not qcfg.w_sym)
        write_json(tmp / "config.json", config)
        copy_tokenizer_files(src, tmp)
    print(f"[liteturbo] wrote {out} ({len(names)} linears, {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return out
