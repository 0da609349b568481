"""Triton kernels of the Triton backend, each beside the torch reference it is tested against.

- :func:`w4a16_gemm`: ``x [M, K] @ W.T`` with ``W`` read as packed int4 (:func:`pack_w4` layout), dequantized in
  registers (``W = (q - z) * s`` per group, the :class:`~backends.types.QuantizedWeight` definition) and multiplied
  on tensor cores in fp16/bf16 with float32 accumulation. Split-K for decode-sized ``M`` (partial sums in float32,
  reduced by one ``sum``: deterministic, no atomics), one tile per program for larger ``M``. Ragged ``M``, ``N``,
  ``K`` are masked; an explicit ``g_idx`` (act-order checkpoints whose groups cannot be made contiguous) is read per
  input channel.
- :func:`dequantize_w4`: the same packed weight → dense ``W.T [K, N]``, for prefill-sized ``M`` where a dense
  cuBLAS GEMM wins (the crossover is a backend option).
- :func:`paged_attention`: attention of query rows over their sequence's context read through the block table
  from the paged KV cache (:class:`~backends.kv_cache.PagedKVCache` layout: head-major ``[KVH, slots, W]``), with
  16-bit, int8 or int4 keys/values dequantized in the kernel from their per-token scale and zero point; grouped
  query heads share one pass over their KV head; online softmax (Milakov & Gimelshein 2018) in float32.
- :func:`kv_write_quantized`: per token and KV head asymmetric int8/int4 quantization and the store into the
  cache, the exact definition of :func:`backends.kv_cache.quantize_per_token` (round half to even, IEEE division,
  float16 scale clamped to its normal range).
- :func:`add_rms_norm`, :func:`rms_norm`, :func:`silu_and_mul`: row-wise elementwise kernels (the residual add
  fused with the norm; SwiGLU's gate).

Triton's interpreter (``TRITON_INTERPRET=1``, read when this module is imported) runs all of them on CPU tensors;
that is how the tests check them on machines without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..platform import triton_interpret

_INTERPRET = triton_interpret()  # read when triton.jit decorates the kernels below, as Triton reads it


POISON = False  # tests set it: every output buffer starts as NaN (floats) / 0xA5 (integers), so an unwritten element fails


def empty_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized output buffer, or, when :data:`POISON` is set (tests), one filled with NaN (floats) or 0xA5
    (integers) so that an element a kernel fails to write shows."""
    if not POISON:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, 0xA5, dtype=dtype, device=device)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# --- packed int4 weights ---------------------------------------------------------------------------------
def pack_w4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` in ``[0, 16)`` → int32 ``[ceil(K/8), N]``: input channel ``k`` of output ``n`` sits
    in bits ``4*(k % 8)`` of word ``[k // 8, n]`` (GPTQ's sequential order, K padded with code 0)."""
    from .w4a16_plan import pack_words  # byte level: nibble pairs OR-ed into bytes, viewed as int32, transposed

    return pack_words(codes).t().contiguous()


def unpack_w4(words: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_w4`: int32 ``[ceil(K/8), N]`` → uint8 ``[N, K]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    parts = [(w >> (4 * j)) & 15 for j in range(8)]
    codes = torch.stack(parts, 1).reshape(-1, words.shape[1])[:k]
    return codes.t().to(torch.uint8).contiguous()


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
                  M, N, K, stride_xm, group_size, k_per_split,
                  HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wk_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(qw_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=wk_mask, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_GIDX:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        else:
            g = offs_k // group_size
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=wk_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=wk_mask, other=0).to(tl.int32)
        w = (q - z).to(tl.float32) * s  # [BLOCK_K, BLOCK_N]
        if IEEE:  # float32 activations, or Triton's interpreter (whose bf16 dot is wrong): exact float32 products
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:  # tensor cores: 16-bit operands, float32 accumulation
            acc += tl.dot(x, w.to(x.dtype))
    out_off = offs_m[:, None] * N + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * M * N + out_off, acc, mask=o_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               n: int, k: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               split_k: int = 1, block_m: int | None = None, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32, contiguous rows) times the packed weight → ``[M, N]`` in ``x.dtype``.

    qweight int32 ``[ceil(K/8), N]`` (:func:`pack_w4`); scales ``[n_groups, N]`` (any float dtype); zeros uint8
    ``[n_groups, N]`` zero-point codes; g_idx int32 ``[K]`` or None (then group = ``k // group_size``).
    ``split_k`` > 1 splits the K loop over that many programs per output tile (float32 partials, summed after).
    """
    m = x.shape[0]
    if block_m is None:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    split_k = max(1, min(split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k > 1:
        out = empty_output((split_k, m, n), torch.float32, x.device)
    else:
        out = empty_output((m, n), x.dtype, x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](x, qweight, scales, zeros, g_idx if g_idx is not None else zeros,
                        bias if bias is not None else scales, out, m, n, k, x.stride(0), group_size, k_per_split,
                        HAS_GIDX=g_idx is not None, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
                        IEEE=x.dtype == torch.float32 or _INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    if split_k > 1:
        y = out.sum(0)
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype)
    return out


@triton.jit
def _dequant_w4_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size,
                       HAS_GIDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        g = offs_k // group_size
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.int32)
    w = (q - z).to(tl.float32) * s
    tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, n: int, k: int,
                  dtype: torch.dtype, g_idx: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  block_k: int = 64, block_n: int = 64) -> torch.Tensor:
    """Dense ``W.T [K, N]`` in ``dtype`` from the packed weight (see :func:`w4a16_gemm` for the operands)."""
    if out is None:
        out = empty_output((k, n), dtype, qweight.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequant_w4_kernel[grid](qweight, scales, zeros, g_idx if g_idx is not None else zeros, out, n, k, group_size,
                             HAS_GIDX=g_idx is not None, BLOCK_K=block_k, BLOCK_N=block_n)
    return out


# --- paged attention -------------------------------------------------------------------------------------
@triton.jit
def _load_kv(ptr, s_ptr, z_ptr, head, slot, t_mask, offs_d, d_mask, n_slots,
             D: tl.constexpr, KV_BITS: tl.constexpr):
    """[BLOCK_N, D_PAD] float32 keys or values of ``slot`` (dequantized for int8/int4)."""
    mask = t_mask[:, None] & d_mask[None, :]
    if KV_BITS == 16:
        x = tl.load(ptr + head * n_slots * D + slot[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        return x.to(tl.float32)
    if KV_BITS == 8:
        codes = tl.load(ptr + head * n_slots * D + slot[:, None] * D + offs_d[None, :], mask=mask, other=0)
        codes = codes.to(tl.float32)
    else:
        half: tl.constexpr = D // 2
        byte = tl.load(ptr + head * n_slots * half + slot[:, None] * half + (offs_d % half)[None, :], mask=mask,
                       other=0).to(tl.int32)
        codes = ((byte >> ((offs_d >= half).to(tl.int32) * 4)[None, :]) & 15).to(tl.float32)
    sc = tl.load(s_ptr + head * n_slots + slot, mask=t_mask, other=0.0).to(tl.float32)
    zp = tl.load(z_ptr + head * n_slots + slot, mask=t_mask, other=0).to(tl.float32)
    return (codes - zp[:, None]) * sc[:, None]


@triton.jit
def _paged_attention_kernel(q_ptr, o_ptr, ml_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                            rows_ptr, seq_ptr, ctx_ptr, bt_ptr, bt_stride, stride_qt, stride_ot, n_slots, block_size,
                            scale, partition, n_rows, n_heads,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                            KV_BITS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    row = tl.load(rows_ptr + r)
    seq = tl.load(seq_ptr + r)
    ctx = tl.load(ctx_ptr + r)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * D + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    t_lo = part * partition
    t_hi = tl.minimum(t_lo + partition, ctx)
    for start in range(t_lo, t_hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < t_hi
        blk = tl.load(bt_ptr + seq * bt_stride + t // block_size, mask=t_mask, other=0).to(tl.int64)
        slot = blk * block_size + t % block_size
        k = _load_kv(k_ptr, ks_ptr, kz_ptr, kvh, slot, t_mask, offs_d, d_mask, n_slots, D, KV_BITS)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = _load_kv(v_ptr, vs_ptr, vz_ptr, kvh, slot, t_mask, offs_d, d_mask, n_slots, D, KV_BITS)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    if SPLIT:
        # this partition's running max and sum ([parts, R, H, 2]) and unnormalized output ([parts, R, H, D])
        base = (part * n_rows + r) * n_heads + heads
        tl.store(ml_ptr + base * 2, m_i, mask=g_mask)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=g_mask)
        tl.store(o_ptr + base[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    else:
        o = acc / l_i[:, None]
        tl.store(o_ptr + row * stride_ot + heads[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


def paged_attention(q: torch.Tensor, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_scale: torch.Tensor | None, k_zero: torch.Tensor | None, v_scale: torch.Tensor | None,
                    v_zero: torch.Tensor | None, rows: torch.Tensor, row_seq: torch.Tensor, row_ctx: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int, scale: float, kv_bits: int,
                    max_ctx: int | None = None, partition: int | None = None, block_n: int = 32) -> None:
    """Write into ``out[rows[r]]`` the attention of ``q[rows[r]]`` (``q, out [T, H, D]``) over the first
    ``row_ctx[r]`` tokens of sequence ``row_seq[r]``, whose slots are ``block_tables[seq, t // block_size] *
    block_size + t % block_size``.

    k, v: one layer of the cache, ``[KVH, slots, D]`` (16-bit, ``kv_bits=16``), uint8 ``[KVH, slots, D]`` (int8) or
    ``[KVH, slots, D/2]`` (int4, byte ``j`` = channel ``j`` low nibble, ``j + D/2`` high); k_scale etc. float16 /
    uint8 ``[KVH, slots]`` for the quantized kinds. rows, row_seq, row_ctx: int32 ``[R]``; block_tables int32
    ``[B, max_blocks]``. H must be a multiple of KVH (grouped-query heads share their KV head).

    ``partition``: split each context into partitions of this many tokens, one program each, combined afterwards
    (flash-decoding, Dao et al. 2023: keeps the GPU busy when rows x KV heads are few and contexts long); needs
    ``max_ctx`` (the longest ``row_ctx``, a host int). ``None``/0: one program per (row, KV head).
    """
    t, h, d = q.shape
    kvh, n_slots = k.shape[0], k.shape[1]
    g = h // kvh
    n_rows = rows.shape[0]
    if kv_bits == 16:
        k_scale = k_zero = v_scale = v_zero = k  # unused
    parts = 1 if not partition or max_ctx is None else max(1, triton.cdiv(max_ctx, partition))
    consts = dict(G=g, G_PAD=_next_pow2(g), D=d, D_PAD=_next_pow2(d), KV_BITS=kv_bits, BLOCK_N=block_n)
    if parts == 1:
        _paged_attention_kernel[(n_rows, kvh, 1)](
            q, out, out, k, v, k_scale, k_zero, v_scale, v_zero, rows, row_seq, row_ctx, block_tables,
            block_tables.stride(0), q.stride(0), out.stride(0), n_slots, block_size, scale, 1 << 30, n_rows, h,
            SPLIT=False, **consts)
        return
    acc = empty_output((parts, n_rows, h, d), torch.float32, q.device)
    ml = empty_output((parts, n_rows, h, 2), torch.float32, q.device)
    _paged_attention_kernel[(n_rows, kvh, parts)](
        q, acc, ml, k, v, k_scale, k_zero, v_scale, v_zero, rows, row_seq, row_ctx, block_tables,
        block_tables.stride(0), q.stride(0), out.stride(0), n_slots, block_size, scale, partition, n_rows, h,
        SPLIT=True, **consts)
    m, l_sum = ml[..., 0], ml[..., 1]  # partitions past a row's context: m = -inf, l = 0
    m_all = m.amax(0)
    w = torch.exp(m - m_all)  # [parts, R, H]; exp(-inf) = 0 for empty partitions
    o = (acc * w.unsqueeze(-1)).sum(0) / (l_sum * w).sum(0).unsqueeze(-1)
    out[rows.long()] = o.to(out.dtype)


# --- KV write with quantization --------------------------------------------------------------------------
@triton.jit
def _rint(x):
    """Round half to even (as torch.round), exactly: floor and the fraction are exact in float32."""
    r = tl.floor(x)
    f = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (f > 0.5) | ((f == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _scale_zero(lo, hi, QMAX: tl.constexpr):
    """float16 scale (and its float32 value) and zero point of the range ``[min(lo, 0), max(hi, 0)]``."""
    lo = tl.minimum(lo, 0.0)
    hi = tl.maximum(hi, 0.0)
    scale = tl.math.div_rn(hi - lo, QMAX * 1.0)
    scale = tl.minimum(tl.maximum(scale, 6.103515625e-05), 65504.0).to(tl.float16)  # float16's normal range
    s = scale.to(tl.float32)
    zero = tl.minimum(tl.maximum(_rint(tl.math.div_rn(-lo, s)), 0.0), QMAX * 1.0)
    return s, scale, zero


@triton.jit
def _codes(x, s, zero, QMAX: tl.constexpr):
    return tl.minimum(tl.maximum(_rint(tl.math.div_rn(x, s) + zero), 0.0), QMAX * 1.0).to(tl.int32)


@triton.jit
def _kv_write_kernel(x_ptr, slots_ptr, store_ptr, scale_ptr, zero_ptr, stride_xt, stride_xh, n_slots,
                     D: tl.constexpr, HALF_PAD: tl.constexpr, D_PAD: tl.constexpr, BITS: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    base = x_ptr + t * stride_xt + head * stride_xh
    QMAX: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        offs = tl.arange(0, D_PAD)
        mask = offs < D
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        s, scale, zero = _scale_zero(tl.min(tl.where(mask, x, float("inf")), axis=0),
                                     tl.max(tl.where(mask, x, float("-inf")), axis=0), QMAX)
        tl.store(store_ptr + head * n_slots * D + slot * D + offs, _codes(x, s, zero, QMAX).to(tl.uint8), mask=mask)
    else:
        half: tl.constexpr = D // 2
        offs = tl.arange(0, HALF_PAD)
        mask = offs < half
        x_lo = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x_hi = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
        s, scale, zero = _scale_zero(tl.min(tl.where(mask, tl.minimum(x_lo, x_hi), float("inf")), axis=0),
                                     tl.max(tl.where(mask, tl.maximum(x_lo, x_hi), float("-inf")), axis=0), QMAX)
        packed = _codes(x_lo, s, zero, QMAX) | (_codes(x_hi, s, zero, QMAX) << 4)
        tl.store(store_ptr + head * n_slots * half + slot * half + offs, packed.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + head * n_slots + slot, scale)
    tl.store(zero_ptr + head * n_slots + slot, zero.to(tl.uint8))


def kv_write_quantized(x: torch.Tensor, slots: torch.Tensor, store: torch.Tensor, scale: torch.Tensor,
                       zero: torch.Tensor, bits: int) -> None:
    """Quantize ``x [T, KVH, D]`` (any float dtype and strides with a contiguous last dim) per token and head and
    write codes, float16 scale and uint8 zero point at ``slots [T]`` of one layer's ``store`` (uint8 ``[KVH, slots,
    D]`` for int8, ``[KVH, slots, D/2]`` for int4) and ``scale``/``zero`` ``[KVH, slots]``: bit-identical to
    :func:`backends.kv_cache.quantize_per_token` + :func:`~backends.kv_cache.pack_int4`."""
    t, kvh, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    grid = (t, kvh)
    _kv_write_kernel[grid](x, slots, store, scale, zero, x.stride(0), x.stride(1), store.shape[1], D=d,
                           HALF_PAD=_next_pow2(d // 2), D_PAD=_next_pow2(d), BITS=bits)


# --- row-wise elementwise --------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        h = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(x.dtype)  # the residual stream is kept in the activation dtype, as the unfused add does
        tl.store(res_out_ptr + row * stride_ro + offs, h, mask=mask)
        x = h
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf / tl.sqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of the rows of ``x [R, N]`` (last dim contiguous) with ``weight [N]``; with ``residual [R, N]``, first
    ``h = x + residual`` (rounded to x's dtype) → ``(rms_norm(h), h)``; else → ``rms_norm(x)``."""
    r, n = x.shape
    out = empty_output(x.shape, x.dtype, x.device)
    res_out = empty_output(x.shape, x.dtype, x.device) if residual is not None else out
    rr = residual if residual is not None else x
    _rms_norm_kernel[(r,)](x, rr, weight, out, res_out, x.stride(0), rr.stride(0), out.stride(0), res_out.stride(0),
                           n, eps, HAS_RES=residual is not None, BLOCK=_next_pow2(n))
    return (out, res_out) if residual is not None else out


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounded to the activation dtype, as torch's
    tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` → ``[R, I]`` (rows with a contiguous last dim)."""
    r, two_i = gate_up.shape
    i = two_i // 2
    out = empty_output((r, i), gate_up.dtype, gate_up.device)
    block = min(block, _next_pow2(i))
    _silu_and_mul_kernel[(r, triton.cdiv(i, block))](gate_up, out, gate_up.stride(0), out.stride(0), i, BLOCK=block)
    return out
