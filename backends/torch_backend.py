"""Reference backend in plain torch; runs on any device.

On CPU the W4A16 linear uses torch's fused int4 kernel ``aten._weight_int4pack_mm_for_cpu`` (weights repacked
once by ``aten._convert_weight_to_int4pack_for_cpu``); elsewhere, or for layouts that kernel cannot take
(bits != 4, act-order ``g_idx``, odd group sizes), it dequantizes then multiplies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .base import Backend
from .types import AttentionMetadata, QuantizedWeight

_INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class Int4PackHandle:
    """torch CPU int4pack weight: ``packed`` uint8 ``[out, in/2]``, ``scale_zeros`` ``[in/g, out, 2]``."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    group_size: int
    out_features: int
    bias: torch.Tensor | None
    dtype: torch.dtype
    in_perm: torch.Tensor | None = None  # act-order: input channels sorted by group, applied to x per call


@dataclass
class DequantHandle:
    """Fallback: keeps the canonical uint8 codes and dequantizes on every call (memory stays ~1 byte/weight)."""

    qw: QuantizedWeight
    dtype: torch.dtype
    bias: torch.Tensor | None


def act_order_permutation(qw: QuantizedWeight) -> torch.Tensor | None:
    """For an act-order ``g_idx`` whose groups all have ``group_size`` members: the input permutation that
    makes groups contiguous (``x[:, perm] @ W[:, perm].T == x @ W.T``); ``None`` for trivial or irregular g_idx."""
    if qw.has_trivial_g_idx():
        return None
    gs = qw.effective_group_size
    perm = torch.argsort(qw.g_idx.long(), stable=True)
    if not torch.equal(qw.g_idx.long()[perm], torch.arange(qw.in_features) // gs):
        return None
    return perm


def int4pack_supported(qw: QuantizedWeight, device: torch.device) -> bool:
    """Whether torch's CPU int4pack kernel can hold ``qw`` without changing its numbers (act-order g_idx
    is accepted when a permutation of the inputs makes its groups contiguous)."""
    return (
        device.type == "cpu"
        and qw.bits == 4
        and qw.out_features % 16 == 0  # the packer tiles N by 16
        and qw.effective_group_size in _INT4PACK_GROUP_SIZES
        and qw.in_features % qw.effective_group_size == 0
        and (qw.has_trivial_g_idx() or act_order_permutation(qw) is not None)
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def pack_int4_for_cpu(qw: QuantizedWeight, dtype: torch.dtype) -> Int4PackHandle:
    """Repack canonical codes for ``aten._weight_int4pack_mm_for_cpu``.

    That kernel computes ``W = (q - 8) * scale + zero``; the canonical ``W = (q - z) * s`` maps onto it
    with ``zero = (8 - z) * s`` (exact up to the rounding of ``zero`` in ``dtype``).
    """
    perm = act_order_permutation(qw)
    codes = qw.qweight if perm is None else qw.qweight[:, perm]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
    s = qw.scales.float()
    zero = (8.0 - qw.qzeros.float()) * s
    scale_zeros = torch.stack([s, zero], dim=-1).to(dtype).contiguous()
    bias = None if qw.bias is None else qw.bias.to(dtype)
    return Int4PackHandle(packed, scale_zeros, qw.effective_group_size, qw.out_features, bias, dtype, perm)


class TorchBackend(Backend):
    """Plain-torch kernels. ``int4_kernel=False`` forces the dequantize-then-matmul fallback."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu", int4_kernel: bool = True) -> None:
        super().__init__(device)
        self.int4_kernel = int4_kernel

    # --- W4A16 ---------------------------------------------------------------------------------
    def prepare_w4a16(self, qw: QuantizedWeight, dtype: torch.dtype) -> Any:
        """int4pack on CPU when the layout allows (see :func:`int4pack_supported`), else a :class:`DequantHandle`."""
        if self.int4_kernel and int4pack_supported(qw, self.device):
            return pack_int4_for_cpu(qw, dtype)
        moved = QuantizedWeight(
            bits=qw.bits, group_size=qw.group_size, sym=qw.sym,
            qweight=qw.qweight.to(self.device), qzeros=qw.qzeros.to(self.device),
            scales=qw.scales.to(self.device), g_idx=None if qw.g_idx is None else qw.g_idx.to(self.device),
        )
        return DequantHandle(moved, dtype, None if qw.bias is None else qw.bias.to(self.device, dtype))

    def w4a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """See :meth:`Backend.w4a16_linear`; computes in the handle's dtype, returns ``x.dtype``."""
        if isinstance(handle, Int4PackHandle):
            xin = x if x.dtype == handle.dtype else x.to(handle.dtype)
            if handle.in_perm is not None:
                xin = xin.index_select(-1, handle.in_perm)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xin, handle.packed, handle.group_size, handle.scale_zeros)
            if handle.bias is not None:
                y = y + handle.bias
            return y if y.dtype == x.dtype else y.to(x.dtype)
        w = handle.qw.dequantize(x.dtype)
        return F.linear(x, w, None if handle.bias is None else handle.bias.to(x.dtype))

    def w8a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """``aten._weight_int8pack_mm`` for 16-bit CPU activations, else the generic path."""
        q, scales = handle
        if self.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and hasattr(
                torch.ops.aten, "_weight_int8pack_mm"):
            return torch.ops.aten._weight_int8pack_mm(x, q, scales.to(x.dtype))
        return super().w8a16_linear(x, handle)

    # --- elementwise ----------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As transformers' LlamaRMSNorm: statistics in float32, scaled in ``x.dtype``."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Rotate-half RoPE of q and k with precomputed cos/sin ``[T, 1, D]``."""
        return _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)

    # --- paged KV --------------------------------------------------------------------------------
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """``index_copy_`` of ``k, v [T, KVH, D]`` into the flattened caches at ``slot_mapping``."""
        nb, bs, kvh, d = k_cache.shape
        k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """SDPA per prefill sequence, and one padded SDPA for all one-token (decode) queries of the step."""
        nb, bs, kvh, d = k_cache.shape
        k_flat, v_flat = k_cache.view(nb * bs, kvh, d), v_cache.view(nb * bs, kvh, d)
        plan = meta.scratch.get("torch_attn")
        if plan is None:  # gather indices and masks are the same for every layer of the step
            plan = meta.scratch["torch_attn"] = _attention_plan(meta, bs, q.device)
        singles, decode = plan
        out = q.new_empty(q.shape) if (len(singles) + (decode is not None)) > 1 or decode is not None else None
        for qs, qe, slots, mask, causal in singles:
            kb = k_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
            vb = v_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            if kb.dtype != q.dtype:
                kb, vb = kb.to(q.dtype), vb.to(q.dtype)
            qb = q[qs:qe].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=True)
            o = o.squeeze(0).transpose(0, 1)
            if out is None:
                return o
            out[qs:qe] = o
        if decode is not None:
            # all one-token queries at once: K/V gathered into [B, KVH, L, D] padded to the longest context
            rows, idx, mask = decode
            b, length = idx.shape
            kb = k_flat.index_select(0, idx.view(-1)).view(b, length, kvh, d).transpose(1, 2)
            vb = v_flat.index_select(0, idx.view(-1)).view(b, length, kvh, d).transpose(1, 2)
            if kb.dtype != q.dtype:
                kb, vb = kb.to(q.dtype), vb.to(q.dtype)
            qb = q.index_select(0, rows).unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
            out.index_copy_(0, rows, o.squeeze(2))
        return out


def _attention_plan(meta: AttentionMetadata, bs: int, device: torch.device):
    """Per step: (single-sequence jobs, batched-decode job or None)."""
    singles, dec = [], []
    for b in range(meta.num_seqs):
        qs, qe = meta.query_start[b], meta.query_start[b + 1]
        t, ctx = qe - qs, meta.context_lens[b]
        table = torch.tensor(meta.block_tables[b][:(ctx + bs - 1) // bs], dtype=torch.long)
        slots = (table.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:ctx]
        if t == 1:
            dec.append((qs, slots))
            continue
        mask = None
        if t < ctx:  # query j sits at position ctx - t + j and sees keys 0 .. ctx - t + j
            rows = torch.arange(t, device=device).unsqueeze(1) + (ctx - t)
            mask = torch.arange(ctx, device=device).unsqueeze(0) <= rows
        singles.append((qs, qe, slots.to(device), mask, t == ctx))
    decode = None
    if len(dec) == 1:
        qs, slots = dec[0]
        singles.append((qs, qs + 1, slots.to(device), None, False))
    elif dec:
        length = max(len(sl) for _, sl in dec)
        idx = torch.zeros(len(dec), length, dtype=torch.long)
        mask = torch.zeros(len(dec), 1, 1, length, dtype=torch.bool)
        for i, (_, sl) in enumerate(dec):
            idx[i, :len(sl)] = sl
            mask[i, 0, 0, :len(sl)] = True
        rows = torch.tensor([qs for qs, _ in dec], dtype=torch.long)
        decode = (rows.to(device), idx.to(device), mask.to(device))
    return singles, decode


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
