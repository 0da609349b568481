"""Round-to-nearest (RTN) group-wise weight quantization: the baseline every calibrated method beats.

Objective: none beyond rounding (or, with ``mse``, the smallest rounding error over shrunk ranges); each group of ``group_size`` input channels of an output row gets
``scale = (max - min) / (2**bits - 1)`` and ``zero = round(-min / scale)`` (asymmetric), or
``scale = max|w| / (2**(bits-1) - 1)`` with zero ``2**(bits-1)`` (symmetric), as in AWQ's
``pseudo_quantize_tensor`` (Lin et al., MLSys 2024) and GPTQ's quantizer (Frantar et al., ICLR 2023).
"""
from __future__ import annotations

import torch

from backends.types import QuantizedWeight


MSE_SHRINK = 0.2  # --mse-scales: candidate ranges shrink the min/max by up to 20 %, in steps of 1 %
MSE_NORM = 2.4  # error norm of the MSE search (GPTQ reference implementation, ``Quantizer.find_params(mse=True)``)


def group_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0,
                 mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group ``w [..., group]`` (float32, shape ``[...]``; the scale already rounded
    to float16, as stored).

    Min/max rule (the range always includes 0): asymmetric ``scale = (max - min) / (2**bits - 1)``,
    ``zero = round(-min / scale)`` clamped to ``[min_zero, 2**bits - 1]``; symmetric ``scale = max|w| /
    (2**(bits-1) - 1)``, zero ``2**(bits-1)``. ``mse=True`` also tries the range shrunk by 1 % .. 20 % and keeps,
    per group, the one with the smallest ``Σ |Q(w) - w|^2.4`` (the GPTQ reference's MSE grid).
    """
    w = w.float()
    qmax = (1 << bits) - 1
    tiny = torch.finfo(torch.float16).tiny
    half = 1 << (bits - 1)
    if sym:
        amax0 = w.abs().amax(-1).clamp(min=1e-8)
    else:
        wmin0, wmax0 = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)

    def params(p: float):
        if sym:
            scale = (amax0 * p / (half - 1 if bits > 1 else 1)).to(torch.float16).float().clamp(min=tiny)
            return scale, torch.full_like(scale, half)
        scale = ((wmax0 - wmin0).clamp(min=1e-8) * p / qmax).to(torch.float16).float().clamp(min=tiny)
        return scale, torch.clamp(torch.round(-wmin0 * p / scale), min_zero, qmax)

    scale, zero = params(1.0)
    if not mse:
        return scale, zero
    best = None
    for k in range(int(round(MSE_SHRINK * 100)) + 1):
        s, z = params(1.0 - k / 100)
        q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, qmax)
        err = ((q - z.unsqueeze(-1)) * s.unsqueeze(-1) - w).abs().pow(MSE_NORM).sum(-1)
        if best is None:
            best, scale, zero = err, s, z
        else:
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                 bias: torch.Tensor | None = None, min_zero: int = 0, mse: bool = False) -> QuantizedWeight:
    """Quantize a dense weight ``[out, in]`` to a :class:`QuantizedWeight` (scales float16).

    ``group_size=-1`` quantizes each output row as one group. Raises ``ValueError`` when ``in`` is not
    divisible by ``group_size``. Scales and zero points: :func:`group_params` (the asymmetric range always
    includes 0, so a group of one sign, or a constant group, is represented within half a step; an all-zero group
    is exact; ``mse`` searches shrunk ranges). ``min_zero=1`` keeps asymmetric zero points storable in the GPTQ v1
    format (which writes ``zero - 1``).
    """
    out_f, in_f = weight.shape
    gs = in_f if group_size == -1 else group_size
    if in_f % gs:
        raise ValueError(f"in_features={in_f} is not divisible by group_size={gs}")
    w = weight.detach().float().reshape(out_f, in_f // gs, gs)
    qmax = (1 << bits) - 1
    s, zeros = group_params(w, bits, sym, min_zero, mse)
    q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1), 0, qmax)
    return QuantizedWeight(
        bits=bits, group_size=group_size, sym=sym,
        qweight=q.reshape(out_f, in_f).to(torch.uint8),
        qzeros=zeros.t().contiguous().to(torch.uint8),
        scales=s.t().contiguous().to(torch.float16),
        bias=bias,
    )


def fake_quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                  mse: bool = False) -> torch.Tensor:
    """Quantize then dequantize ``weight [out, in]`` with :func:`quantize_rtn`'s rule; float32 result.

    Used in the search loops of AWQ (scale and clip grids); identical numbers to
    ``quantize_rtn(...).dequantize()``.
    """
    return quantize_rtn(weight, bits, group_size, sym, mse=mse).dequantize(torch.float32)
