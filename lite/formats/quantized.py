"""Reading quantized linears out of a checkpoint's tensors, whatever format wrote them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.types import QuantizedWeight

from .awq import unpack_awq
from .errors import LiteturboError

SUPPORTED_METHODS = ("awq",)


@dataclass(frozen=True)
class QuantSpec:
    """The parts of ``quantization_config`` the loader needs."""

    method: str
    bits: int
    group_size: int
    zero_point: bool


def quantization_spec(config: dict) -> QuantSpec | None:
    """``None`` for a 16/32-bit checkpoint, else its :class:`QuantSpec`.

    Raises ``LiteturboError`` for methods or variants liteturbo cannot load.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise LiteturboError(f"quantization method {method!r} is not supported yet; supported: "
                             f"{', '.join(SUPPORTED_METHODS)}")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise LiteturboError(f"AWQ version {version!r} is not supported; only 'gemm' checkpoints load")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise LiteturboError(f"AWQ GEMM checkpoints with bits={bits} are not supported (only 4)")
    gs = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return QuantSpec(method, bits, gs, bool(qc.get("zero_point", True)))


def load_quantized_linears(state_dict: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, QuantizedWeight]:
    """Pop every ``<prefix>.qweight`` (with its qzeros/scales/bias) from ``state_dict``.

    Returns ``{prefix: QuantizedWeight}``; ``prefix`` is the module path, e.g. ``model.layers.0.mlp.up_proj``.
    Raises ``LiteturboError`` naming the tensor that is missing or malformed.
    """
    out = {}
    prefixes = [k[: -len(".qweight")] for k in state_dict if k.endswith(".qweight")]
    for p in prefixes:
        try:
            qweight = state_dict.pop(f"{p}.qweight")
            scales = state_dict.pop(f"{p}.scales")
            qzeros = state_dict.pop(f"{p}.qzeros", None)
        except KeyError as e:
            raise LiteturboError(f"quantized layer {p} lacks tensor {e.args[0]}: the checkpoint is incomplete") from None
        if spec.zero_point and qzeros is None:
            raise LiteturboError(f"quantized layer {p} lacks {p}.qzeros although zero_point is true")
        bias = state_dict.pop(f"{p}.bias", None)
        try:
            out[p] = unpack_awq(qweight, qzeros, scales, spec.bits, spec.group_size, spec.zero_point, bias)
        except (ValueError, RuntimeError) as e:
            raise LiteturboError(f"quantized layer {p}: {e}") from e
    return out
