"""The quantization pipeline: read a checkpoint, quantize the decoder linears, write a W4A16 checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .formats import DECODER_LINEARS, LiteturboError


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
    """Round-to-nearest quantization of ``model`` into an AWQ GEMM checkpoint at ``qcfg.work_dir``.

    A thin front of :func:`lite.pipeline.quantize_model` (layer by layer, atomic output). Raises
    ``LiteturboError`` for bad input, before any work.
    """
    from .pipeline import PipelineConfig, quantize_model

    if method != "rtn":
        raise LiteturboError(f"quantize_checkpoint runs rtn only; use lite.pipeline.quantize_model for {method}")
    cfg = PipelineConfig(method="rtn", w_bits=qcfg.w_bits, w_group_size=qcfg.w_group_size, w_sym=qcfg.w_sym,
                         out_format="awq", device="cpu")
    return quantize_model(model, cfg, qcfg.work_dir, overwrite=qcfg.overwrite)
