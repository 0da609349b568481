"""Rotary position embedding fused with the KV-cache write: one launch per layer instead of torch's rotate-half ops
followed by the cache's index copies.

:func:`rotary_kv_write` rotates ``q [T, H, D]`` and ``k [T, KVH, D]`` (RoFormer, Su et al. 2021, rotate-half
convention: ``x·cos + rotate_half(x)·sin``) and, for a 16/32-bit cache, stores the rotated keys and the values at their
slots of the cache's head-major ``[KVH, slots, D]`` layout in the same program; for an int8/int4 cache it returns the
rotated keys for the quantizing write. q, k, v may be strided views of the fused QKV output (last dim contiguous).
Each product and the sum are rounded to the activation dtype as torch's elementwise ops round them, so the result
is bit-identical to :meth:`backends.base.Backend.rotary` + :meth:`~backends.kv_cache.PagedKVCache.write` (compiled
with ``enable_fp_fusion=False``: on a GPU, ptxas would otherwise contract a float32 product and sum into one FMA, one
rounding where torch makes two; seen on an H200, 1-ulp differences in a quarter of the elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..platform import triton_interpret
from . import kernels as _k

_INTERPRET = triton_interpret()


@triton.jit
def _rot(x1, x2, c1, c2, s1, s2, DT: tl.constexpr):
    """The two halves of ``x·cos + rotate_half(x)·sin``, each product and the sum rounded to ``DT`` (torch's order)."""
    a1 = (x1 * c1).to(DT).to(tl.float32)
    a2 = (x2 * c2).to(DT).to(tl.float32)
    b1 = (-x2 * s1).to(DT).to(tl.float32)
    b2 = (x1 * s2).to(DT).to(tl.float32)
    return (a1 + b1).to(DT), (a2 + b2).to(DT)


@triton.jit
def _rotary_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, n_slots,
                      H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                      H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, WRITE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    D: tl.constexpr = 2 * HALF
    DT = qo_ptr.dtype.element_ty
    offs = tl.arange(0, HALF_PAD)
    dm = offs < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + offs, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + offs, mask=dm, other=0.0).to(tl.float32)[None, :]
    hq = tl.arange(0, H_PAD)
    mq = (hq < H)[:, None] & dm[None, :]
    qp = q_ptr + t * stride_qt + hq[:, None] * stride_qh + offs[None, :]
    o1, o2 = _rot(tl.load(qp, mask=mq, other=0.0).to(tl.float32), tl.load(qp + HALF, mask=mq, other=0.0).to(tl.float32),
                  c1, c2, s1, s2, DT)
    qo = qo_ptr + t * (H * D) + hq[:, None] * D + offs[None, :]
    tl.store(qo, o1, mask=mq)
    tl.store(qo + HALF, o2, mask=mq)
    hk = tl.arange(0, KVH_PAD)
    mk = (hk < KVH)[:, None] & dm[None, :]
    kp = k_ptr + t * stride_kt + hk[:, None] * stride_kh + offs[None, :]
    k1, k2 = _rot(tl.load(kp, mask=mk, other=0.0).to(tl.float32), tl.load(kp + HALF, mask=mk, other=0.0).to(tl.float32),
                  c1, c2, s1, s2, DT)
    if WRITE:  # rotated keys and the values into the cache: [KVH, slots, D], head-major
        slot = tl.load(slots_ptr + t)
        at = hk[:, None].to(tl.int64) * n_slots * D + slot * D + offs[None, :]
        CT = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + at, k1.to(CT), mask=mk)
        tl.store(kc_ptr + at + HALF, k2.to(CT), mask=mk)
        vp = v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
        tl.store(vc_ptr + at, tl.load(vp, mask=mk, other=0.0).to(CT), mask=mk)
        tl.store(vc_ptr + at + HALF, tl.load(vp + HALF, mask=mk, other=0.0).to(CT), mask=mk)
    else:
        ko = ko_ptr + t * (KVH * D) + hk[:, None] * D + offs[None, :]
        tl.store(ko, k1, mask=mk)
        tl.store(ko + HALF, k2, mask=mk)


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotated ``q [T, H, D]`` (new, contiguous) and, without a cache, rotated ``k [T, KVH, D]``; with ``k_cache`` /
    ``v_cache`` (one layer, ``[KVH, slots, D]``, 16/32-bit) and ``slots`` int64 ``[T]``, the rotated keys and ``v``
    are stored there instead (``None`` returned for k). ``cos``/``sin``: ``[T, 1, D]`` or ``[T, D]`` in q's dtype.
    ``D`` must be even; q, k, v need a contiguous last dim."""
    t, h, d = q.shape
    kvh = k.shape[1]
    if d % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("rotary_kv_write needs an even head dim and a contiguous last dim")
    cos2, sin2 = cos.reshape(t, d), sin.reshape(t, d)
    if cos2.stride(-1) != 1 or sin2.stride() != cos2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    q_out = _k.empty_output((t, h, d), q.dtype, q.device)
    write = k_cache is not None
    k_out = None if write else _k.empty_output((t, kvh, d), q.dtype, q.device)
    if t == 0:
        return q_out, k_out
    half = d // 2
    _rotary_kv_kernel[(t,)](
        q, k, v, cos2, sin2, slots if write else q, q_out, k_out if not write else q_out,
        k_cache if write else q_out, v_cache if write else q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos2.stride(0),
        k_cache.shape[1] if write else 0,
        H=h, KVH=kvh, HALF=half, HALF_PAD=_k._next_pow2(half), H_PAD=_k._next_pow2(h), KVH_PAD=_k._next_pow2(kvh),
        WRITE=write, enable_fp_fusion=False)  # no FMA contraction: products and sums rounded as torch rounds them
    return q_out, k_out
