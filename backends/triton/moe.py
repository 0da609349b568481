"""Fused Mixture-of-Experts W4A16 kernels (the Triton backend's ``experts`` op), in the manner of vLLM's ``fused_moe``.

Routing (:func:`moe_align`, torch ops on the device, no host synchronization, so a decode step stays capturable): the
``T x k`` (token, expert) pairs, numbered ``p = t * k + j``, are sorted by expert (stably) and each expert's run is
padded to a multiple of ``BLOCK_M`` with the sentinel ``T * k``; ``block_expert[b]`` is the expert of row block ``b``
and ``n_padded`` the padded length (as vLLM's ``moe_align_block_size``: ``sorted_token_ids``, ``expert_ids``,
``num_tokens_post_padded``). The grid is sized from host ints alone, ``T * k + min(E, T * k) * (BLOCK_M - 1)`` rows
at most; programs whose row block starts past ``n_padded`` return at once.

Weights (:class:`~backends.triton.backend.TritonW4ExpertsHandle`): every expert prepared by the backend's
``prepare_w4a16`` (the tiled layout of :mod:`backends.triton.w4a16`, int32 ``[ceil(N/128), K8P, 128]``) and stacked
on a leading expert dim: qweight ``[E, ceil(N/128), K8P, 128]``, scales ``[E, groups, N]`` (compute dtype), zero
points uint8 ``[E, groups, N]``. The fused gate/up weight is ``[2I, H]``, gate rows first.

:func:`_moe_w4a16_kernel`: one program per (row block, ``BLOCK_N`` output columns); grid axis 0 runs over row
blocks, so the programs launched together read the same weight tile of an expert (its other row blocks, in prefill)
from L2. The program reads its expert id, gathers its rows of the activations (``x[p // k]`` for gate/up, ``h[p]``
for down; padding rows masked), streams the expert's 4-bit words along K, converts them to the exact integers
``q - z`` (the magic-number conversion of :func:`backends.triton.w4a16.unpack8`; shift-and-mask in the
interpreter), ``tl.dot`` s them with the activations in float32 accumulation and applies the group's scale per K tile
(K tiles never straddle a group). ``GATED`` (the first launch): two accumulators, gate column ``n`` and up column
``n + I`` of the same expert, and ``silu(gate) * up`` in the epilogue → ``h [T*k, I]`` in the compute dtype.
The second launch is the down projection ``[H, I]``, the routing weight multiplied in its float32 epilogue →
``y [T*k, H]``; the sum over the ``k`` experts of a token is ``y.view(T, k, H).sum(1)`` (torch, float32 accumulation,
one rounding). No split-K: a decode's parallelism comes from narrow column tiles (:func:`plan`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..platform import triton_interpret
from .w4a16 import group_params, unpack8, use_asm
from .w4a16_plan import TILE_K, TILE_N, kernel_group

_INTERPRET = triton_interpret()  # read when triton.jit decorates the kernels below, as Triton reads it

__all__ = ["moe_align", "plan", "fused_moe_w4a16", "moe_w4a16_gemm", "kernel_takes"]


def kernel_takes(group_size: int, k: int) -> bool:
    """Whether :func:`_moe_w4a16_kernel` takes a projection with ``k`` inputs in groups of ``group_size``: one group
    over K, or groups that are a multiple of 16 dividing K (``tl.dot`` K tiles of at least 16 inside one group)."""
    g = kernel_group(group_size, k)
    return g == 0 or (g % 16 == 0 and k % g == 0)


# --- routing: (token, expert) pairs sorted and padded by expert -------------------------------------------------------
def max_padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the padded length for ``pairs`` rows (a multiple of ``block_m``): each expert that has rows
    (at most ``min(E, pairs)``) pads its run by at most ``block_m - 1``."""
    em = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-em // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids int32 [EM], block_expert int32 [EM / block_m], n_padded int32 [1])`` for ``topk_ids [T, k]``:
    pair ``p = t * k + j`` at its expert's padded position (experts in ascending order, pairs of one expert in
    ascending ``p``), padding rows ``T * k``; ``EM`` = :func:`max_padded_rows` (a host int: no synchronization).
    Blocks past ``n_padded`` get the last expert (their programs return without reading it)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat.index_select(0, order)
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    dest = (ends - padded).index_select(0, e_sorted) + torch.arange(n, device=dev) - first.index_select(0, e_sorted)
    em = max_padded_rows(n, num_experts, block_m)
    sorted_ids = torch.full((em,), n, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, em, block_m, device=dev, dtype=torch.int64)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


# --- launch plan ------------------------------------------------------------------------------------------------------
def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(0, int(v) - 1).bit_length())


def _block_k(group: int, k: int, want: int) -> int:
    bk = min(want, TILE_K, _pow2_at_least(k, 16))
    if group:
        while group % bk:
            bk //= 2
    return bk


def plan(pairs: int, num_experts: int, hidden: int, inter: int, group_gate_up: int, group_down: int, *,
         sms: int = 1, batch_invariant: bool = False, fp32: bool = False) -> dict:
    """The launch plan of :func:`fused_moe_w4a16` for ``pairs = T * k`` rows: ``block_m`` (shared by both launches:
    16 while an expert averages at most 16 rows, a decode's case, then 32 and 64) and per launch (``"gate_up"``:
    ``N = I``, ``K = H``; ``"down"``: ``N = H``, ``K = I``) ``block_n, block_k, num_warps, num_stages``.
    ``block_n``: the widest of 128/64/32 (no wider than N needs) that still gives at least one program per
    multiprocessor (``sms``), so the few row blocks of a decode are split over enough column tiles (gate/up: at most
    64 from 32-row blocks, two accumulators); 8 warps for 32- and 64-row blocks, else 4. ``block_k``:
    128 (32 for float32 activations), no more than K needs and dividing the group. ``batch_invariant``: the tiles
    do not depend on ``pairs`` (16-row blocks, 64-column tiles), so a token's bits do not depend on its batch."""
    active = max(1, min(num_experts, pairs))
    per_expert = -(-max(pairs, 1) // active)
    if batch_invariant:
        block_m = 16
    else:
        block_m = 16 if per_expert <= 16 else (32 if per_expert <= 32 else 64)
    blocks = active * -(-per_expert // block_m)
    out = {"block_m": block_m}
    for name, n, k, gs, gated in (("gate_up", inter, hidden, group_gate_up, True),
                                  ("down", hidden, inter, group_down, False)):
        cap = _pow2_at_least(n, 32)
        if batch_invariant:
            bn = min(64, cap)
        else:
            bn = next((c for c in (128, 64, 32) if c <= cap and blocks * -(-n // c) >= sms), 32)
            bn = min(bn, cap)
        if gated and block_m >= 32:
            bn = min(bn, 64)  # two float32 accumulators
        bk = _block_k(kernel_group(gs, k), k, 32 if fp32 else 128)
        # 16-row blocks stream weights (fewest instructions per weight: 4 warps); larger blocks spread their
        # float32 accumulators over 8 warps
        warps = 8 if block_m >= 32 and block_m * bn * (2 if gated else 1) >= 32 * 128 else 4
        out[name] = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": 1 if fp32 else 3}
    return out


# --- the kernel -------------------------------------------------------------------------------------------------------
@triton.jit
def _w_operand(w_ptrs, k0, z, n_mask, op_ty: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_N: tl.constexpr, ASM: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` exact integers ``q - z`` of the K tile at ``k0`` (tiled layout) in ``op_ty``."""
    BK8: tl.constexpr = BLOCK_K // 8
    if EVEN_N:
        w = tl.load(w_ptrs + (k0 // 8) * 128)
    else:
        w = tl.load(w_ptrs + (k0 // 8) * 128, mask=n_mask[None, :], other=0)
    d0, d1, d2, d3, d4, d5, d6, d7 = unpack8(w, z, ASM)
    # [BK8, BN] x 8 channels -> [BK, BN] (row 8 r + j), as the dense tensor-core kernel of w4a16.py
    t = tl.join(tl.join(tl.join(d0.to(op_ty), d4.to(op_ty)), tl.join(d2.to(op_ty), d6.to(op_ty))),
                tl.join(tl.join(d1.to(op_ty), d5.to(op_ty)), tl.join(d3.to(op_ty), d7.to(op_ty))))
    return tl.reshape(tl.permute(tl.reshape(t, (BK8, BLOCK_N, 8)), (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def _moe_w4a16_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, tw_ptr, sorted_ptr, bexp_ptr, npad_ptr,
                      N, K, K8P, NT, SN, stride_se, num_valid, stride_am, stride_om,
                      TOP_K: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                      IEEE: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """One (row block, column tile): ``out[p, n] = sum_k a[p // TOP_K, k] W_e[n, k]`` for the block's pairs ``p``
    of expert ``e``; ``GATED``: ``silu(gate) * up`` of weight rows ``n`` and ``n + N`` (``SN = 2N``); ``MUL_WEIGHT``:
    times ``tw[p]``. ``N`` output columns, ``K`` inputs, ``K8P`` words per column of the tiled layout, ``NT`` its
    128-column tiles per expert, ``SN`` columns of the stored weight (the scales' row stride), ``stride_se`` the
    scales' (and zero points') expert stride."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    BK8: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_mask = pair < num_valid
    expert = tl.load(bexp_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BK8)
    a_ptrs = a_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    qw_e = qw_ptr + expert * NT * K8P * 128
    col = (offs_r * 128)[:, None]
    wg_ptrs = qw_e + ((offs_n // 128).to(tl.int64) * K8P * 128 + offs_n % 128)[None, :] + col
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_se
    if IEEE:  # float32 activations, or Triton's interpreter (whose bf16 dot is wrong): exact float32 products
        op_ty: tl.constexpr = tl.float32
    else:  # tensor cores: x and the exact integers q - z in 16 bits, float32 accumulation
        op_ty: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        offs_u = offs_n + N
        wu_ptrs = qw_e + ((offs_u // 128).to(tl.int64) * K8P * 128 + offs_u % 128)[None, :] + col
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GROUP == 0:  # one group over K: zero points here, scales at the end
        z, s = group_params(z_e, s_e, 0, SN, offs_n, n_mask)
        if GATED:
            z_u, s_u = group_params(z_e, s_e, 0, SN, offs_u, n_mask)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(a_ptrs + k0, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(a_ptrs + k0, mask=row_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        if IEEE:
            x = x.to(tl.float32)
        if GROUP != 0:
            z, s = group_params(z_e, s_e, k0 // GROUP, SN, offs_n, n_mask)
        q = _w_operand(wg_ptrs, k0, z, n_mask, op_ty, BLOCK_N, BLOCK_K, EVEN_N, ASM)
        if IEEE:
            part = tl.dot(x, q, input_precision="ieee")
        else:
            part = tl.dot(x, q)
        if GROUP != 0:
            acc += part * s
        else:
            acc += part
        if GATED:
            if GROUP != 0:
                z_u, s_u = group_params(z_e, s_e, k0 // GROUP, SN, offs_u, n_mask)
            q_u = _w_operand(wu_ptrs, k0, z_u, n_mask, op_ty, BLOCK_N, BLOCK_K, EVEN_N, ASM)
            if IEEE:
                part_u = tl.dot(x, q_u, input_precision="ieee")
            else:
                part_u = tl.dot(x, q_u)
            if GROUP != 0:
                acc_u += part_u * s_u
            else:
                acc_u += part_u
    if GROUP == 0:
        acc = acc * s
        if GATED:
            acc_u = acc_u * s_u
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_u
    if MUL_WEIGHT:
        acc = acc * tl.load(tw_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# --- host side --------------------------------------------------------------------------------------------------------
def moe_w4a16_gemm(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, n: int, k: int, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                   n_padded: torch.Tensor, num_valid: int, top_k: int, *, gated: bool,
                   topk_weights: torch.Tensor | None, block_m: int, block_n: int, block_k: int, num_warps: int = 4,
                   num_stages: int = 3) -> torch.Tensor:
    """One launch of :func:`_moe_w4a16_kernel` → ``[num_valid, n]`` in ``a.dtype``, row ``p`` for pair ``p``.
    ``a``: the activations (row ``p // top_k`` feeds pair ``p``); ``qweight [E, ceil(SN/128), K8P, 128]``,
    ``scales`` / ``zeros [E, groups, SN]`` with ``SN = 2n`` when ``gated`` (gate rows first) else ``n``;
    ``topk_weights``: ``num_valid`` routing weights multiplied in (pair order) or None."""
    from .kernels import empty_output

    e, nt, k8p, tile = qweight.shape
    sn = scales.shape[2]
    if scales.shape != zeros.shape or scales.stride() != zeros.stride() or scales.stride(2) != 1:
        raise ValueError(f"scales {tuple(scales.shape)} and zero points {tuple(zeros.shape)} must be [E, groups, SN] "
                         f"alike, contiguous along SN")
    if tile != TILE_N or sn != (2 * n if gated else n) or nt * TILE_N < sn or k8p * 8 < k:
        raise ValueError(f"stacked weight [E={e}, {nt}, {k8p}, {tile}] with scales {tuple(scales.shape)} does not fit "
                         f"N={n} (gated={gated}), K={k}")
    if block_m < 16 or block_n < 16 or block_k < 16 or block_k > TILE_K or block_n > TILE_N:
        raise ValueError(f"tiles must be 16..128 (tl.dot), got block_m={block_m} block_n={block_n} block_k={block_k}")
    group = kernel_group(group_size, k)
    if group % block_k:
        raise ValueError(f"block_k={block_k} does not divide the group size {group}")
    out = empty_output((num_valid, n), a.dtype, a.device)
    if num_valid == 0:
        return out
    if a.stride(-1) != 1:
        a = a.contiguous()
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    tw = topk_weights if topk_weights is not None else scales
    _moe_w4a16_kernel[grid](a, qweight, scales, zeros, out, tw, sorted_ids, block_expert, n_padded,
                            n, k, k8p, nt, sn, scales.stride(0), num_valid, a.stride(0), out.stride(0),
                            TOP_K=top_k, GROUP=group, GATED=gated, MUL_WEIGHT=topk_weights is not None,
                            IEEE=a.dtype == torch.float32 or _INTERPRET, ASM=use_asm(a.device),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                            EVEN_N=n % block_n == 0, num_warps=num_warps, num_stages=num_stages)
    return out


def fused_moe_w4a16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, gate_up: tuple,
                    down: tuple, group_gate_up: int, group_down: int, inter: int, *, sms: int = 1,
                    batch_invariant: bool = False, config: dict | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, ``e = topk_ids[t, j]`` → ``[T, H]`` in
    ``x.dtype``. ``gate_up`` / ``down``: the stacked ``(qweight, scales, zeros)`` of the module docstring;
    ``topk_weights`` ``[T, k]`` (None: unweighted). ``config`` overrides :func:`plan` (keys ``block_m`` and
    ``gate_up`` / ``down`` dicts; for tests and benchmarks)."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = gate_up[0].shape[0]
    pairs = t * top_k
    p = plan(pairs, num_experts, hidden, inter, group_gate_up, group_down, sms=sms,
             batch_invariant=batch_invariant, fp32=x.dtype == torch.float32)
    if config:
        p = {**p, **{key: ({**p[key], **val} if isinstance(val, dict) else val) for key, val in config.items()}}
    if t == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert, n_padded = moe_align(topk_ids, num_experts, p["block_m"])
    h = moe_w4a16_gemm(x, *gate_up, group_gate_up, inter, hidden, sorted_ids, block_expert, n_padded, pairs, top_k,
                       gated=True, topk_weights=None, block_m=p["block_m"], **p["gate_up"])
    w = None if topk_weights is None else topk_weights.reshape(-1)
    if w is not None and w.stride(0) != 1:
        w = w.contiguous()
    y = moe_w4a16_gemm(h, *down, group_down, hidden, inter, sorted_ids, block_expert, n_padded, pairs, 1,
                       gated=False, topk_weights=w, block_m=p["block_m"], **p["down"])
    return y.view(t, top_k, hidden).sum(1)
