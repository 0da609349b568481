"""compressed-tensors ``pack-quantized`` layout (what llm-compressor writes and vLLM loads).

Per linear (``N`` out, ``K`` in, group size ``g``), stored codes are the *signed* quantized values plus
``2**(bits-1)`` (so canonical unsigned codes):

- ``weight_packed`` int32 ``[N, K/8]``: packed sequentially along the input dim.
- ``weight_scale`` ``[N, K/g]`` (16-bit), ``weight_shape`` int ``[2]`` = ``(N, K)``.
- ``weight_zero_point`` int32 ``[N/8, K/g]`` (asymmetric only): signed zero points + ``2**(bits-1)``
  packed along the output dim. Symmetric schemes store none (zero point 0 = canonical 8).
- ``weight_g_idx`` int32 ``[K]`` (optional, act-order).
- dequantization ``W[n, k] = (q - zp) * scale`` in signed terms = canonical ``(u - z) * s``.

``quantization_config.ignore`` names the linears left 16-bit: ``lm_head``, and in a Mixture-of-Experts model the
routers and shared-expert gates as regexes on their names within a layer (``re:.*\\.mlp\\.gate$``, as llm-compressor's
MoE recipes write them; compressed-tensors and vLLM match ``re:`` entries with ``re.match``).
"""
from __future__ import annotations

import re

import torch

from backends.types import QuantizedWeight

from .errors import LiteturboError
from .packing import pack_int32, unpack_int32


def pack_compressed(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Canonical weight → ``weight_packed``/``weight_scale``/``weight_shape`` (+ zero point, g_idx) tensors."""
    out = {
        "weight_packed": pack_int32(qw.qweight, qw.bits, dim=1),
        "weight_scale": qw.scales.t().contiguous().to(torch.float16),
        "weight_shape": torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64),
    }
    if not qw.sym:
        out["weight_zero_point"] = pack_int32(qw.qzeros.t(), qw.bits, dim=0)
    if not qw.has_trivial_g_idx():
        out["weight_g_idx"] = qw.group_index().to(torch.int32)
    return out


def unpack_compressed(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool,
                      bias: torch.Tensor | None = None) -> QuantizedWeight:
    """``weight_*`` tensors of one linear → canonical :class:`QuantizedWeight`."""
    try:
        shape = [int(v) for v in tensors["weight_shape"].tolist()]
        packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    except KeyError as e:
        raise LiteturboError(f"compressed-tensors layer lacks {e.args[0]}") from None
    n, k = shape
    codes = unpack_int32(packed, bits, dim=1, size=k)
    n_groups = scale.shape[1]
    if scale.shape[0] != n:
        raise LiteturboError(f"weight_scale has shape {tuple(scale.shape)}, expected ({n}, groups)")
    if sym:
        zeros = torch.full((n_groups, n), 1 << (bits - 1), dtype=torch.uint8)
    else:
        if "weight_zero_point" not in tensors:
            raise LiteturboError("asymmetric compressed-tensors layer lacks weight_zero_point")
        zeros = unpack_int32(tensors["weight_zero_point"], bits, dim=0, size=n).t().contiguous()
    g_idx = tensors.get("weight_g_idx")
    gs = group_size if group_size != -1 else k
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k) // gs):
        g_idx = None
    return QuantizedWeight(bits=bits, group_size=group_size, sym=sym, qweight=codes, qzeros=zeros,
                           scales=scale.t().contiguous(), g_idx=None if g_idx is None else g_idx.to(torch.int32),
                           bias=bias)


def compressed_quantization_config(bits: int, group_size: int, sym: bool, actorder: str | None,
                                   unquantized: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` block of a W4A16 ``pack-quantized`` checkpoint. ``unquantized``: full module paths
    of other 16-bit linears (``model.layers.{i}.mlp.gate``, ...), listed in ``ignore`` as one regex per name within
    a layer (``re:.*\\.mlp\\.gate$``)."""
    names = dict.fromkeys(m.split(".", 3)[3] if m.startswith("model.layers.") else m for m in unquantized)
    ignore = ["lm_head"] + [r"re:.*\." + re.escape(n) + "$" for n in names]
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": bits, "type": "int", "symmetric": sym,
                        "strategy": "group" if group_size != -1 else "channel",
                        "group_size": group_size if group_size != -1 else None, "dynamic": False,
                        "actorder": actorder, "observer": "minmax"},
            "input_activations": None, "output_activations": None,
        }},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
