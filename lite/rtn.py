"""Round-to-nearest (RTN) group-wise weight quantization: the baseline every calibrated method beats.

Objective: none beyond rounding; each group of ``group_size`` input channels of an output row gets
``scale = (max - min) / (2**bits - 1)`` and ``zero = round(-min / scale)`` (asymmetric), or
``scale = max|w| / (2**(bits-1) - 1)`` with zero ``2**(bits-1)`` (symmetric), as in AWQ's
``pseudo_quantize_tensor`` (Lin et al., MLSys 2024) and GPTQ's quantizer (Frantar et al., ICLR 2023).
"""
from __future__ import annotations

import torch

from backends.types import QuantizedWeight


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                 bias: torch.Tensor | None = None, min_zero: int = 0) -> QuantizedWeight:
    """Quantize a dense weight ``[out, in]`` to a :class:`QuantizedWeight` (scales float16).

    ``group_size=-1`` quantizes each output row as one group. Raises ``ValueError`` when ``in`` is not
    divisible by ``group_size``. The asymmetric range always includes 0 (as GPTQ's quantizer does), so a
    group of one sign, or a constant group, is represented within half a step instead of being clipped by
    a zero point outside ``[0, 2**bits)``; an all-zero group is exact. ``min_zero=1`` keeps asymmetric zero
    points storable in the GPTQ v1 format (which writes ``zero - 1``).
    """
    out_f, in_f = weight.shape
    gs = in_f if group_size == -1 else group_size
    if in_f % gs:
        raise ValueError(f"in_features={in_f} is not divisible by group_size={gs}")
    w = weight.detach().float().reshape(out_f, in_f // gs, gs)
    qmax = (1 << bits) - 1
    if sym:
        amax = w.abs().amax(-1).clamp(min=1e-8)
        half = 1 << (bits - 1)
        scales = (amax / (half - 1 if bits > 1 else 1)).to(torch.float16)
        s = scales.float().clamp(min=torch.finfo(torch.float16).tiny)
        zeros = torch.full_like(s, half)
    else:
        wmin, wmax = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        rng = (wmax - wmin).clamp(min=1e-8)
        scales = (rng / qmax).to(torch.float16)
        s = scales.float().clamp(min=torch.finfo(torch.float16).tiny)
        zeros = torch.clamp(torch.round(-wmin / s), min_zero, qmax)
    q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1), 0, qmax)
    return QuantizedWeight(
        bits=bits, group_size=group_size, sym=sym,
        qweight=q.reshape(out_f, in_f).to(torch.uint8),
        qzeros=zeros.t().contiguous().to(torch.uint8),
        scales=scales.t().contiguous(),
        bias=bias,
    )


def fake_quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False) -> torch.Tensor:
    """Quantize then dequantize ``weight [out, in]`` with :func:`quantize_rtn`'s rule; float32 result.

    Vectorised for the search loops of AWQ (scale and clip grids); identical numbers to
    ``quantize_rtn(...).dequantize()``.
    """
    return quantize_rtn(weight, bits, group_size, sym).dequantize(torch.float32)
