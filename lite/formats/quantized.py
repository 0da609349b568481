"""Reading quantized linears out of a checkpoint's tensors, whatever format wrote them.

Supported ``quantization_config``s: AWQ GEMM (``quant_method: awq``), GPTQ v1/v2 (``quant_method: gptq``,
honouring ``checkpoint_format``), compressed-tensors ``pack-quantized`` W4A16 (group or channel strategy). Linears are
found by their packed tensor whatever their path, so a Mixture-of-Experts checkpoint's per-expert linears
(``model.layers.0.mlp.experts.5.up_proj``) load like any other, and its 16-bit routers (a plain ``.weight``) are not
among them.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

import torch

from backends.types import QuantizedWeight

from .errors import LiteturboError
from .gptq import CHECKPOINT_FORMATS

SUPPORTED_METHODS = ("awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class QuantSpec:
    """The parts of ``quantization_config`` the loader needs.

    method: awq | gptq | compressed-tensors. zero_point: asymmetric. checkpoint_format: gptq | gptq_v2.
    """

    method: str
    bits: int
    group_size: int
    zero_point: bool
    checkpoint_format: str = ""


def quantization_spec(config: dict) -> QuantSpec | None:
    """``None`` for a 16/32-bit checkpoint, else its :class:`QuantSpec`.

    Raises ``LiteturboError`` for methods or variants liteturbo cannot load.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise LiteturboError(f"AWQ version {version!r} is not supported; only 'gemm' checkpoints load")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        spec = QuantSpec("awq", bits, int(qc.get("group_size", qc.get("q_group_size", 128))),
                         bool(qc.get("zero_point", True)))
    elif method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise LiteturboError(f"GPTQ checkpoint_format {fmt!r} is not supported ({', '.join(CHECKPOINT_FORMATS)})")
        spec = QuantSpec("gptq", int(qc.get("bits", 4)), int(qc.get("group_size", 128)),
                         not bool(qc.get("sym", True)), fmt)
    elif method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise LiteturboError(f"compressed-tensors format {fmt!r} is not supported (only pack-quantized)")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1 or not groups[0].get("weights"):
            raise LiteturboError("compressed-tensors checkpoints with several config_groups are not supported")
        w = groups[0]["weights"]
        if groups[0].get("input_activations"):
            raise LiteturboError("compressed-tensors activation quantization is not supported (W4A16 only)")
        gs = -1 if w.get("strategy") == "channel" else int(w.get("group_size") or -1)
        spec = QuantSpec("compressed-tensors", int(w.get("num_bits", 4)), gs, not bool(w.get("symmetric", True)))
    else:
        raise LiteturboError(f"quantization method {method!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_METHODS)}")
    if spec.bits != 4:
        raise LiteturboError(f"{spec.method} checkpoints with bits={spec.bits} are not supported (only 4)")
    if spec.group_size != -1 and spec.group_size < 1:
        raise LiteturboError(f"quantization_config has group_size={spec.group_size}; it must be -1 (per channel) or "
                             f"positive")
    return spec


def quantized_prefixes(names, spec: QuantSpec) -> list[str]:
    """Module paths (e.g. ``model.layers.0.mlp.up_proj``) of the quantized linears among tensor ``names``,
    recognised by the format's packed-weight tensor (``qweight``, or ``weight_packed`` for compressed-tensors)."""
    from .registry import format_for_spec

    marker = "." + format_for_spec(spec.method, spec.checkpoint_format).tensors[0]
    return [k[: -len(marker)] for k in names if k.endswith(marker)]


def load_quantized_linears(state_dict: MutableMapping[str, torch.Tensor], spec: QuantSpec,
                           prefix: str = "") -> dict[str, QuantizedWeight]:
    """Pop every quantized linear (with its bias) whose module path starts with ``prefix`` from ``state_dict``.

    ``state_dict`` is a ``dict[str, Tensor]`` or a :class:`~lite.formats.checkpoint.LazyStateDict` (then only the
    tensors of the matching linears are read: ``prefix="model.layers.3."`` unpacks one decoder layer).
    Returns ``{prefix: QuantizedWeight}``; ``prefix`` is the module path, e.g. ``model.layers.0.mlp.up_proj``.
    Raises ``LiteturboError`` naming the layer whose tensors are missing or malformed.
    """
    from .registry import format_for_spec

    fmt = format_for_spec(spec.method, spec.checkpoint_format)
    out = {}
    for p in [q for q in quantized_prefixes(list(state_dict), spec) if q.startswith(prefix)]:
        try:
            bias = state_dict.pop(f"{p}.bias", None)
            parts = {n: state_dict.pop(f"{p}.{n}") for n in fmt.tensors if f"{p}.{n}" in state_dict}
            out[p] = fmt.unpack(parts, spec.bits, spec.group_size, not spec.zero_point, bias)
        except KeyError as e:
            raise LiteturboError(f"quantized layer {p} lacks tensor {p}.{e.args[0]}: the checkpoint is "
                                 f"incomplete") from None
        except (ValueError, RuntimeError) as e:
            if isinstance(e, LiteturboError):
                raise
            raise LiteturboError(f"quantized layer {p}: {e}") from e
    return out
