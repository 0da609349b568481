"""Sequential little-endian int32 packing shared by the GPTQ and compressed-tensors layouts.

Value ``j`` of each pack of ``32/bits`` consecutive values along ``dim`` sits in bits ``bits*j ..``.
(AWQ GEMM interleaves instead; see :mod:`lite.formats.awq`.)
"""
from __future__ import annotations

import sys

import torch

from .errors import LiteturboError


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint codes ``[R, C]`` in ``[0, 2**bits)`` → int32, packed along ``dim`` (0 or 1); pads with zeros."""
    per = 32 // bits
    c = codes.to(torch.int64)
    if dim == 0:
        c = c.t()
    r, n = c.shape
    pad = (-n) % per
    if pad:
        c = torch.cat([c, c.new_zeros(r, pad)], 1)
    c = c.view(r, -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (c << shifts).sum(-1)
    packed = (packed - ((packed >> 31) << 32)).to(torch.int32)
    return packed.t().contiguous() if dim == 0 else packed.contiguous()


def int32_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` → uint8 ``[R, C, 8]``: nibble ``j`` of each word = its bits ``4j .. 4j+3``.

    Reads the words' bytes (little-endian: byte ``b`` holds nibbles ``2b`` low and ``2b+1`` high), so the work and
    the temporaries stay in uint8 (1/8 of an int64 shift-and-mask); big-endian machines take the int64 path."""
    r, c = packed.shape
    if sys.byteorder != "little":
        shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * 4
        return ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 15).to(torch.uint8)
    b = packed.contiguous().view(torch.uint8).view(r, c, 4)
    return torch.stack([b & 15, b >> 4], -1).view(r, c, 8)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 → uint8 codes with ``size`` entries along ``dim``."""
    if packed.dtype != torch.int32:
        raise LiteturboError(f"packed tensor must be int32, got {packed.dtype}")
    per = 32 // bits
    p = packed.t() if dim == 0 else packed
    if bits == 4:
        vals = int32_nibbles(p).reshape(p.shape[0], -1)
    else:
        shifts = torch.arange(per, dtype=torch.int64) * bits
        vals = ((p.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], -1)
    if vals.shape[1] < size:
        raise LiteturboError(f"packed tensor holds {vals.shape[1]} values along dim {dim}, expected {size}")
    vals = vals[:, :size].to(torch.uint8)
    return vals.t().contiguous() if dim == 0 else vals.contiguous()
