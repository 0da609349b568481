"""Round-to-nearest (RTN) group-wise weight quantization without calibration data: plain min/max rounding (the
baseline every calibrated method beats) and the least-squares fit of each group's scale and zero point
(:func:`fit_group_params`, ``lite rtn``'s default).

Plain objective: none beyond rounding (or, with ``mse``, the smallest rounding error over shrunk ranges); each group of ``group_size`` input channels of an output row gets
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


FIT_SHRINKS = (1.0, 0.9, 0.8)  # starting ranges of the least-squares fit (fractions of the min/max range)
FIT_STEPS = 2  # assign codes, then refit scale and zero, this many times per start
FIT_ROWS = 256  # output rows fitted at a time (keeps the temporaries in cache)


def fit_group_params(w: torch.Tensor, bits: int, min_zero: int = 0,
                     importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric scale and integer zero point of each group ``w [..., group]`` (float32 ``[...]``, the scale
    rounded to float16 as stored) that minimize the weighted rounding error ``Σ c (s (q - z) - w)²`` without
    calibration data.

    For each starting range (the min/max range shrunk by :data:`FIT_SHRINKS`), :data:`FIT_STEPS` times: assign
    codes ``q = clamp(round(w / s) + z)``, fit ``w ≈ a q + b`` by weighted least squares, take ``z = round(-b / a)``
    and refit ``s`` with that integer zero point; each group keeps the start with the smallest error, never worse
    than min/max rounding (which is a candidate). This is llama.cpp's ``make_qkx2_quants`` search (k-quants: scale
    and minimum by least squares over shrunk ranges) with the minimum restricted to ``-s z`` for an integer ``z``,
    as the AWQ and GPTQ formats store it. ``importance [group]`` or broadcastable to ``w`` (``c``; e.g. the square
    of the norm weight that scales each input channel): ``None`` = uniform.
    """
    w = w.float()
    qmax = (1 << bits) - 1
    tiny = torch.finfo(torch.float16).tiny
    c = None if importance is None else importance.float().expand_as(w)

    def wsum(x):
        """``Σ c x`` over each group."""
        return (x if c is None else x * c).sum(-1)

    wmin, wmax = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    sc = torch.full_like(wmin, w.shape[-1]) if c is None else c.sum(-1)
    sw = wsum(w)

    def codes(s, z):
        """Codes of every weight under scale ``s`` and zero ``z`` (float32)."""
        return torch.round(w / s.unsqueeze(-1)).add_(z.unsqueeze(-1)).clamp_(0, qmax)

    def error(s, z):
        """Weighted squared rounding error of each group."""
        return wsum(codes(s, z).sub_(z.unsqueeze(-1)).mul_(s.unsqueeze(-1)).sub_(w).square_())

    best_s = ((wmax - wmin).clamp(min=1e-8) / qmax).to(torch.float16).float().clamp(min=tiny)
    best_z = torch.clamp(torch.round(-wmin / best_s), min_zero, qmax)
    best = error(best_s, best_z)
    for shrink in FIT_SHRINKS:
        s = ((wmax - wmin).clamp(min=1e-8) * shrink / qmax).to(torch.float16).float().clamp(min=tiny)
        z = torch.clamp(torch.round(-wmin * shrink / s), min_zero, qmax)
        for _ in range(FIT_STEPS):
            q = codes(s, z)
            cq = q if c is None else q * c
            sq, sqq, sqw = cq.sum(-1), (cq * q).sum(-1), (cq * w).sum(-1)
            det = sc * sqq - sq * sq
            a = (sc * sqw - sq * sw) / det.clamp(min=1e-30)
            b = (sw - a * sq) / sc.clamp(min=1e-30)
            ok = (det > 1e-12 * sc * sqq) & (a > tiny)
            s = torch.where(ok, a, s)
            z = torch.where(ok, torch.clamp(torch.round(-b / s), min_zero, qmax), z)
            # refit the scale for the integer zero point: s = Σ c d w / Σ c d², d = q - z
            zq = z * sc  # Σ c z
            num = sqw - z * sw
            den = sqq - 2 * z * sq + z * zq
            s = torch.where((den > 0) & (num > 0), num / den.clamp(min=1e-30), s)
            s = s.to(torch.float16).float().clamp(min=tiny)
        err = error(s, z)
        better = err < best
        best = torch.where(better, err, best)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                 bias: torch.Tensor | None = None, min_zero: int = 0, mse: bool = False, fit: bool = False,
                 importance: torch.Tensor | None = None) -> QuantizedWeight:
    """Quantize a dense weight ``[out, in]`` to a :class:`QuantizedWeight` (scales float16).

    ``group_size=-1`` quantizes each output row as one group. Raises ``ValueError`` when ``in`` is not
    divisible by ``group_size``. Scales and zero points: :func:`group_params` (the asymmetric range always
    includes 0, so a group of one sign, or a constant group, is represented within half a step; an all-zero group
    is exact; ``mse`` searches shrunk ranges), or with ``fit`` (asymmetric only) :func:`fit_group_params`, the
    least-squares fit weighted by ``importance [in]`` (per input channel; ``None`` = uniform), fitted
    :data:`FIT_ROWS` output rows at a time. ``min_zero=1`` keeps asymmetric zero points storable in the GPTQ v1
    format (which writes ``zero - 1``).
    """
    out_f, in_f = weight.shape
    gs = in_f if group_size == -1 else group_size
    if in_f % gs:
        raise ValueError(f"in_features={in_f} is not divisible by group_size={gs}")
    if importance is not None and tuple(importance.shape) != (in_f,):
        raise ValueError(f"importance must have shape ({in_f},), got {tuple(importance.shape)}")
    w = weight.detach().float().reshape(out_f, in_f // gs, gs)
    qmax = (1 << bits) - 1
    if fit and not sym:
        imp = None if importance is None else importance.float().reshape(in_f // gs, gs)
        parts = [fit_group_params(w[r:r + FIT_ROWS], bits, min_zero, imp) for r in range(0, out_f, FIT_ROWS)]
        s, zeros = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
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
