"""AWQ GEMM on-disk layout (AutoAWQ ``WQLinear_GEMM``; also read by vLLM and transformers).

For a linear with ``in_features = K`` and ``out_features = N``, 4 bits, group size ``g``:

- ``qweight`` int32 ``[K, N/8]``: the codes of ``W.T`` packed 8 per int32 along the *output* dim. Nibble ``i``
  (bits ``4i .. 4i+3``) of column ``c`` holds output channel ``8c + AWQ_ORDER[i]``, with
  ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (AutoAWQ ``awq/modules/linear/gemm.py``, ``pack``).
- ``qzeros`` int32 ``[K/g, N/8]``: zero points packed the same way, stored as is (no offset).
- ``scales`` float16 ``[K/g, N]``.
- dequantization ``W.T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]``.

``config.json`` carries ``quantization_config = {quant_method: "awq", version: "gemm", bits, group_size,
zero_point}``, and for a Mixture-of-Experts model ``modules_to_not_convert``: the full paths of the 16-bit routers
and shared-expert gates (``model.layers.0.mlp.gate``, ...). Full paths, because readers match these entries
differently: AutoAWQ and vLLM as substrings (a bare ``"gate"``, AutoAWQ's own Mixtral entry, would also exclude
every ``gate_proj``/``gate_up_proj`` of Qwen-MoE), transformers from the start or as a suffix.
"""
from __future__ import annotations

import torch

from backends.types import QuantizedWeight

from .errors import LiteturboError
from .packing import int32_nibbles

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# position in the packed nibbles of output channel j (within its pack of 8)
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def pack_awq_int32(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Pack codes ``[R, N]`` (any int dtype, values in ``[0, 2**bits)``) → int32 ``[R, N * bits / 32]``.

    Raises ``LiteturboError`` if ``N`` is not a multiple of the pack factor.
    """
    if bits != 4:
        raise LiteturboError(f"the AWQ GEMM format stores 4-bit codes only, got bits={bits}")
    per = 32 // bits
    r, n = codes.shape
    if n % per:
        raise LiteturboError(f"AWQ GEMM packing needs the packed dimension ({n}) to be a multiple of {per}")
    c = codes.to(torch.int64).view(r, n // per, per)[:, :, AWQ_ORDER]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (c << shifts).sum(-1)  # < 2**32
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def unpack_awq_int32(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Inverse of :func:`pack_awq_int32`: int32 ``[R, C]`` → uint8 codes ``[R, C * 32 / bits]``."""
    if bits != 4:
        raise LiteturboError(f"the AWQ GEMM format stores 4-bit codes only, got bits={bits}")
    nib = int32_nibbles(packed)  # [R, C, 8] by nibble position
    return nib[:, :, AWQ_REVERSE_ORDER].reshape(packed.shape[0], -1)


def pack_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """Canonical weight → ``{"qweight", "qzeros", "scales"}`` tensors of the AWQ GEMM layout.

    Raises ``LiteturboError`` for act-order ``g_idx`` (AWQ GEMM has no g_idx) or bits != 4.
    """
    if not qw.has_trivial_g_idx():
        raise LiteturboError("the AWQ GEMM format cannot store an act-order g_idx; use the GPTQ format")
    out = {
        "qweight": pack_awq_int32(qw.qweight.t().contiguous(), qw.bits),
        "qzeros": pack_awq_int32(qw.qzeros, qw.bits),
        "scales": qw.scales.to(torch.float16).contiguous(),
    }
    return out


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
               zero_point: bool = True, bias: torch.Tensor | None = None) -> QuantizedWeight:
    """AWQ GEMM tensors → canonical :class:`QuantizedWeight`.

    ``zero_point=False`` checkpoints store zeros anyway; AutoAWQ's symmetric mode uses ``2**(bits-1)``.
    Raises ``LiteturboError`` when shapes are inconsistent.
    """
    codes = None
    if bits == 4:  # one parallel C++ pass (unpack, reorder and transpose) where the CPU kernels are ready
        from backends.cpu_ext import unpack_nibbles_t

        codes = unpack_nibbles_t(qweight, AWQ_REVERSE_ORDER)
    if codes is None:
        codes = unpack_awq_int32(qweight, bits).t().contiguous()  # [N, K]
    n, k = codes.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise LiteturboError(f"AWQ tensor with in_features={k} is not divisible by group_size={gs}")
    if tuple(scales.shape) != (k // gs, n):
        raise LiteturboError(f"AWQ scales have shape {tuple(scales.shape)}, expected {(k // gs, n)} "
                             f"for qweight {tuple(qweight.shape)} and group_size={group_size}")
    if zero_point:
        zeros = unpack_awq_int32(qzeros, bits)
        if tuple(zeros.shape) != (k // gs, n):
            raise LiteturboError(f"AWQ qzeros unpack to {tuple(zeros.shape)}, expected {(k // gs, n)}")
    else:
        zeros = torch.full((k // gs, n), 1 << (bits - 1), dtype=torch.uint8)
    return QuantizedWeight(bits=bits, group_size=group_size, sym=not zero_point, qweight=codes, qzeros=zeros,
                           scales=scales, bias=bias)


def awq_quantization_config(bits: int, group_size: int, zero_point: bool, unquantized: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` block AutoAWQ/transformers/vLLM expect for AWQ GEMM; ``unquantized`` (full module
    paths of 16-bit linears, e.g. MoE routers) becomes ``modules_to_not_convert`` when not empty."""
    qc = {"quant_method": "awq", "version": "gemm", "bits": bits, "group_size": group_size, "zero_point": zero_point}
    if unquantized:
        qc["modules_to_not_convert"] = list(unquantized)
    return qc
