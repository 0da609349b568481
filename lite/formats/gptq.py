"""GPTQ on-disk layout (AutoGPTQ / GPTQModel ``checkpoint_format`` ``gptq`` = v1, and ``gptq_v2``).

For in_features ``K``, out_features ``N``, group size ``g``, 4 bits:

- ``qweight`` int32 ``[K/8, N]``: codes packed 8 per int32 along the *input* dim, sequentially
  (row ``r`` nibble ``j`` = input channel ``8r + j``).
- ``qzeros`` int32 ``[K/g, N/8]``: zero points packed sequentially along the output dim. **v1 stores
  ``zero - 1``** (a historical off-by-one of AutoGPTQ kept for compatibility); ``gptq_v2`` stores ``zero``.
- ``scales`` float16 ``[K/g, N]``; ``g_idx`` int32 ``[K]`` (group of each input channel; permuted with
  act-order/desc_act).
- dequantization ``W.T[k, n] = (q[k, n] - zero[g_idx[k], n]) * s[g_idx[k], n]``.

v1 cannot store a zero point of 0 (``0 - 1`` wraps to 15 in 4 bits and reads back as 16). liteturbo's GPTQ
therefore keeps asymmetric zero points in ``[1, 15]`` when writing v1 (``min_zero=1`` in the solver), and
:func:`pack_gptq` refuses a zero of 0 for v1 rather than write a checkpoint that loads wrong.
"""
from __future__ import annotations

import torch

from backends.types import QuantizedWeight

from .errors import LiteturboError
from .packing import pack_int32, unpack_int32

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def pack_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Canonical weight → ``{"qweight", "qzeros", "scales", "g_idx"}`` in the GPTQ layout."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise LiteturboError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    if qw.bits != 4:
        raise LiteturboError(f"liteturbo writes 4-bit GPTQ only, got bits={qw.bits}")
    zeros = qw.qzeros.to(torch.int64)
    if checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise LiteturboError("a zero point of 0 cannot be stored in the GPTQ v1 format (it stores zero - 1); "
                                 "quantize with zero points in [1, 15] or write checkpoint_format gptq_v2")
        zeros = zeros - 1
    return {
        "qweight": pack_int32(qw.qweight.t(), qw.bits, dim=0),
        "qzeros": pack_int32(zeros, qw.bits, dim=1),
        "scales": qw.scales.to(torch.float16).contiguous(),
        "g_idx": qw.group_index().to(torch.int32).contiguous(),
    }


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group_size: int, sym: bool, checkpoint_format: str = "gptq",
                bias: torch.Tensor | None = None) -> QuantizedWeight:
    """GPTQ tensors → canonical :class:`QuantizedWeight`. Raises ``LiteturboError`` on inconsistent shapes."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise LiteturboError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; expected one of "
                             f"{CHECKPOINT_FORMATS}")
    n = qweight.shape[1]
    k = qweight.shape[0] * 32 // bits
    if g_idx is not None and g_idx.numel() != k:
        raise LiteturboError(f"g_idx has {g_idx.numel()} entries, qweight implies in_features={k}")
    n_groups = scales.shape[0]
    if scales.shape[1] != n:
        raise LiteturboError(f"GPTQ scales have {scales.shape[1]} columns, qweight has {n}")
    codes = unpack_int32(qweight, bits, dim=0, size=k).t().contiguous()
    zeros = unpack_int32(qzeros, bits, dim=1, size=n).to(torch.int64)
    if zeros.shape[0] != n_groups:
        raise LiteturboError(f"GPTQ qzeros have {zeros.shape[0]} groups, scales have {n_groups}")
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    if int(zeros.max()) >= (1 << bits):
        # v1 asymmetric zero of 0 was written as 15 (wrapped -1); it cannot be recovered faithfully
        raise LiteturboError("this GPTQ v1 checkpoint stores a zero point that reads back as 16 (a zero of 0 "
                             "written with the v1 offset); re-quantize it or convert it to gptq_v2")
    gs = group_size if group_size != -1 else k
    trivial = g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // gs)
    return QuantizedWeight(bits=bits, group_size=group_size, sym=sym, qweight=codes, qzeros=zeros.to(torch.uint8),
                           scales=scales, g_idx=None if trivial else g_idx.to(torch.int32), bias=bias)


def gptq_quantization_config(bits: int, group_size: int, sym: bool, desc_act: bool, static_groups: bool,
                             damp_percent: float, true_sequential: bool, checkpoint_format: str = "gptq") -> dict:
    """``quantization_config`` (config.json) and the body of ``quantize_config.json`` for GPTQ."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
            "static_groups": static_groups, "damp_percent": damp_percent, "true_sequential": true_sequential,
            "checkpoint_format": checkpoint_format}
