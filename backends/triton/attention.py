"""Paged decode attention on tensor cores: both products as ``tl.dot`` with the GQA group padded to 16 rows.

One program computes one query row (a decode token, or one row of a chunked prefill: every row sees its own
context length) for a block of up to ``BLOCK_H`` query heads that share a KV head, over one partition of its
context. The query heads of a KV head are padded to ``BLOCK_H = 16`` rows, the smallest ``M`` of an MMA, so
``Q·Kᵀ`` and ``P·V`` run as ``[16, W] x [W, BLOCK_N]`` and ``[16, BLOCK_N] x [BLOCK_N, W]`` dots with float32
accumulation (the grouped-head layout of SGLang's Triton ``decode_attention``, after LightLLM's GQA flash
decoding; flash-decoding split, Dao et al. 2023). The softmax is online (Milakov & Gimelshein 2018) in base 2:
``log2(e)`` is folded into the softmax scale so every exponential is one ``exp2``.

Quantized KV (:mod:`backends.kv_cache`: codes ``c``, float16 scale ``s`` and uint8 zero point ``z`` per token
and KV head, ``x = (c - z)·s``) is never dequantized element by element. The integer codes are exact in
16-bit floats and go straight into the dots; the per-token parameters are folded in around them:

- scores: ``q·k_t = s_t·(q·c_t − z_t·Σq)``: one dot on the codes, then per token one multiply-add;
- output: ``Σ_t p_t·v_t = Σ_t (p_t s_t)·c_t − Σ_t (p_t s_t)·z_t``: the scales multiply ``P`` (``[16, BLOCK_N]``)
  before the dot, the zero points accumulate element-wise beside it (with the same rounded ``p·s`` the dot
  multiplies) and are reduced once at the end.

Codes become dot operands without an int → float conversion: OR-ing a code into the mantissa of a magic number
gives ``OFF + c`` exactly (bfloat16 ``0x4300 | c`` = 128 + c, float16 ``0x6400 | c`` = 1024 + c), and ``OFF`` is
added to the zero point instead of being subtracted from every code. int4 rows are read once, as uint32 words:
byte ``j`` holds channel ``j`` (low nibble) and channel ``j + D/2`` (high nibble), so one mask-and-or per word
gives two low-nibble codes as a 16-bit pair, the low-nibble plane dots with ``q[:, :D/2]`` and the high-nibble
plane with ``q[:, D/2:]`` (for ``P·V`` the two planes give output columns ``[:D/2]`` and ``[D/2:]``). A word's pairs
come out in channel order (0, 2, 1, 3); ``q`` is loaded, and the output stored, in that order, so no code is ever
moved to its channel. (int4 rows that are not whole words, ``D % 8 != 0``, take a byte path with the same math.)

Split-KV (flash-decoding): with partitions, each program writes its unnormalized output, running max and sum;
:func:`_combine_kernel` (one launch, one program per row and query head) merges a row's partitions in order. A
row's result depends only on its own context, the tile sizes and the partition, never on the other rows of the
batch: with a fixed ``partition`` and ``split=True`` it is bit-for-bit batch invariant.

The kernel handles every row the engine gives today's :func:`backends.triton.kernels.paged_attention` (same
arguments), which stays as the reference of the static comparison (``bench/gpu_static_attention.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kernels as _k

_INTERPRET = _k._INTERPRET
LOG2E = 1.4426950408889634
BLOCK_H = 16  # query heads per program: the MMA's smallest M


@triton.jit
def _tile_slots(bt_row, start, offs_n, t_hi, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr):
    """Cache slots of tokens ``start + offs_n`` and the token mask. With ``PAGE`` (the tile lies inside one cache
    block) the slots are ``slot0 + offs_n`` and only the int64 scalar ``slot0`` is returned (one block-table entry
    per tile); otherwise an int64 slot per token (one block-table entry per token)."""
    t_mask = (start + offs_n) < t_hi
    if PAGE:
        blk = tl.load(bt_row + start // BLOCK_SIZE).to(tl.int64)
        slot = blk * BLOCK_SIZE + start % BLOCK_SIZE
    else:
        t = start + offs_n
        blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + t % BLOCK_SIZE
    return slot, t_mask


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """``a @ b (+ acc)`` with float32 accumulation: tensor cores on the 16-bit operands (``F32 == ""``), or float32
    operands at ``input_precision=F32``: "tf32x3" (float32 models on a GPU: three TF32 products, about float32's
    precision, on tensor cores) or "ieee" (Triton's interpreter, whose 16-bit dot is not the GPU's)."""
    # one return after the branches: Triton's code generator also compiles what follows an ``if F32: return``, and a
    # dot of float32 and 16-bit operands does not compile
    if F32 != "":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision=F32)
    else:
        out = tl.dot(a, b, acc=acc)
    return out


@triton.jit
def _codes(x, CODE: tl.constexpr, DT: tl.constexpr):
    """Integer codes ``x`` → values ``x + OFF`` (the kernel's ``OFF``, folded into the zero points). ``CODE`` 1:
    bfloat16 by the magic number ``0x4300 | x`` = 128 + x (x < 128: int4); 2: float16 ``0x6400 | x`` = 1024 + x
    (x < 1024: int4 and int8); one logic op per pair of values, no int → float conversion. 0: converted to ``DT``,
    ``OFF = 0`` (int8 under bfloat16 queries, whose 255 no bfloat16 magic number holds)."""
    if CODE == 1:
        out = (x.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
    elif CODE == 2:
        out = (x.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    else:
        out = x.to(DT)
    return out


@triton.jit
def _halves(a, b, MDT: tl.constexpr):
    """uint32 ``[N, M]`` words each holding two 16-bit values → ``MDT [N, 4M]`` ordered (a.lo, a.hi, b.lo, b.hi)
    per word: the order that makes every pair of neighbours one register (no byte moves)."""
    x = tl.join(tl.join(a & 0xFFFF, b & 0xFFFF), tl.join(a >> 16, b >> 16))  # [N, M, 2 (a/b), 2 (lo/hi)]
    n: tl.constexpr = a.shape[0]
    m: tl.constexpr = a.shape[1]
    return tl.reshape(x.to(tl.uint16), (n, 4 * m)).to(MDT, bitcast=True)


@triton.jit
def _nibble_planes(w, CODE: tl.constexpr):
    """uint32 words ``[N, M]`` of int4 bytes (byte j: channel j in the low nibble, j + D/2 in the high one) → the
    low and high nibble planes ``[N, 4M]`` as ``code + OFF`` (:func:`_codes`' magic numbers, two codes per logic
    op), channels in the order (0, 2, 1, 3) within each word (:func:`_halves`)."""
    MAGIC: tl.constexpr = 0x43004300 if CODE == 1 else 0x64006400
    MDT: tl.constexpr = tl.bfloat16 if CODE == 1 else tl.float16
    a = (w & 0x000F000F) | MAGIC  # channels 4i, 4i + 2
    b = ((w >> 8) & 0x000F000F) | MAGIC  # 4i + 1, 4i + 3
    c = ((w >> 4) & 0x000F000F) | MAGIC
    d = ((w >> 12) & 0x000F000F) | MAGIC
    return _halves(a, b, MDT), _halves(c, d, MDT)


@triton.jit
def _byte_plane(w, CODE: tl.constexpr):
    """uint32 words ``[N, M]`` of int8 codes → ``float16 [N, 4M]`` values ``1024 + code`` (``CODE`` 2's magic
    number, two codes per logic op), channels in the order (0, 2, 1, 3) within each word (:func:`_halves`)."""
    tl.static_assert(CODE == 2, "int8 words take float16's magic number")
    a = (w & 0x00FF00FF) | 0x64006400  # channels 4i, 4i + 2
    b = ((w >> 8) & 0x00FF00FF) | 0x64006400  # 4i + 1, 4i + 3
    return _halves(a, b, tl.float16)


@triton.jit
def _load_q(q_ptrs, hw_mask, qk_scale, W: tl.constexpr, KV_BITS: tl.constexpr, Q16: tl.constexpr):
    """(q, q_hi, Σq, qk_scale): the query heads of one KV head ``[BLOCK_H, W_PAD]`` padded with zero rows; for int4
    the channels of the low nibbles (q) and of the high nibbles (q_hi, else q again) apart; Σq per head (the zero
    points' share of the scores; zeros for a 16-bit cache). ``Q16`` (int8 under bfloat16 queries): q into float16
    exactly, scaled by a power of two that brings max|q| into [2^13, 2^14) (bfloat16's 8-bit mantissa fits
    float16's 11), undone in the returned scores' scale."""
    q = tl.load(q_ptrs, mask=hw_mask, other=0.0)
    q_hi = q
    if KV_BITS == 4:
        q_hi = tl.load(q_ptrs + W, mask=hw_mask, other=0.0)
    if Q16:
        qf = q.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
        e = tl.floor(tl.log2(16384.0 / tl.maximum(amax, 1e-30)))
        e = tl.minimum(tl.maximum(e, -126.0), 127.0)
        pow2 = ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        q = (qf * pow2).to(tl.float16)
        qk_scale = qk_scale / pow2
    q_sum = tl.sum(q.to(tl.float32), axis=1) * 0.0
    if KV_BITS != 16:
        q_sum = tl.sum(q.to(tl.float32), axis=1)
        if KV_BITS == 4:
            q_sum += tl.sum(q_hi.to(tl.float32), axis=1)
    return q, q_hi, q_sum, qk_scale


@triton.jit
def _store_out(o_ptrs, ml_ptrs, acc, acc_hi, acc_z, m_i, l_i, h_mask, hw_mask, W: tl.constexpr,
               KV_BITS: tl.constexpr, SPLIT: tl.constexpr):
    """Store a program's result: with ``SPLIT`` the partition's unnormalized output (``[parts, R, H, D]`` float32)
    and running max (base 2) and sum (``[parts, R, H, 2]``); else the normalized output in the output's dtype. int4:
    ``acc_hi`` holds output channels ``[D/2, D)``. Quantized KV: the zero points' share ``acc_z`` is subtracted."""
    if KV_BITS != 16:
        z_term = tl.sum(acc_z, axis=1)
        acc = acc - z_term[:, None]
        acc_hi = acc_hi - z_term[:, None]
    if SPLIT:
        tl.store(ml_ptrs, m_i, mask=h_mask)
        tl.store(ml_ptrs + 1, l_i, mask=h_mask)
        tl.store(o_ptrs, acc, mask=hw_mask)
        if KV_BITS == 4:
            tl.store(o_ptrs + W, acc_hi, mask=hw_mask)
    else:
        inv = 1.0 / l_i
        tl.store(o_ptrs, (acc * inv[:, None]).to(o_ptrs.dtype.element_ty), mask=hw_mask)
        if KV_BITS == 4:
            tl.store(o_ptrs + W, (acc_hi * inv[:, None]).to(o_ptrs.dtype.element_ty), mask=hw_mask)


@triton.jit
def _decode_attention_kernel(
        q_ptr, o_ptr, ml_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
        rows_ptr, seq_ptr, ctx_ptr, bt_ptr, bt_stride, stride_qt, stride_ot, n_slots,
        qk_scale, partition, n_rows, n_heads,
        G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, W_PAD: tl.constexpr, KV_BITS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
        CODE: tl.constexpr, WORDS: tl.constexpr, Q16: tl.constexpr, F32: tl.constexpr):
    r = tl.program_id(0)
    hb = tl.program_id(1)  # KV head x head block: query heads kvh*G + [h0, h0 + BLOCK_H)
    part = tl.program_id(2)
    HB: tl.constexpr = (G + BLOCK_H - 1) // BLOCK_H
    kvh = hb // HB
    h0 = (hb % HB) * BLOCK_H
    W: tl.constexpr = D // 2 if KV_BITS == 4 else D  # stored width of one token's row
    OFF: tl.constexpr = 128.0 if CODE == 1 else (1024.0 if CODE == 2 else 0.0)  # see _codes
    row = tl.load(rows_ptr + r).to(tl.int64)
    seq = tl.load(seq_ptr + r).to(tl.int64)
    ctx = tl.load(ctx_ptr + r)
    offs_h = tl.arange(0, BLOCK_H)
    offs_w = tl.arange(0, W_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = (h0 + offs_h) < G
    w_mask = offs_w < W
    heads = kvh * G + h0 + offs_h
    hw_mask = h_mask[:, None] & w_mask[None, :]
    if Q16:  # int8 under bfloat16 queries: float16 operands (int8 codes fit float16's magic number, not bfloat16's)
        DT = tl.float16
    else:
        DT = q_ptr.dtype.element_ty  # the dots' operand type (16-bit, or float32)
    if WORDS:  # int4/int8 read as uint32 words: the channel of each plane position is (0, 2, 1, 3) within each word
        ch_w = (offs_w & ~3) | ((offs_w & 1) << 1) | ((offs_w & 2) >> 1)
    else:
        ch_w = offs_w
    q, q_hi, q_sum, qk_scale = _load_q(q_ptr + row * stride_qt + heads[:, None] * D + ch_w[None, :], hw_mask,
                                       qk_scale, W, KV_BITS, Q16)

    head_off = kvh.to(tl.int64) * n_slots  # int64: head * n_slots * W passes 2^31 on large pools
    k_base = k_ptr + head_off * W
    v_base = v_ptr + head_off * W
    bt_row = bt_ptr + seq * bt_stride
    tile_offs = offs_n[:, None] * W + offs_w[None, :]
    if WORDS:
        W4: tl.constexpr = W // 4
        offs_i = tl.arange(0, W_PAD // 4)
        i_mask = offs_i < W4
        kw_base = k_base.to(tl.pointer_type(tl.uint32))
        vw_base = v_base.to(tl.pointer_type(tl.uint32))
        word_offs = offs_n[:, None] * W4 + offs_i[None, :]

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, W_PAD), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_H, W_PAD), dtype=tl.float32)  # int4's high-nibble output channels (else unused)
    acc_z = tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32)  # Σ_t (p·s)_t (z_t + OFF), reduced after the loop
    t_lo = part * partition
    t_hi = tl.minimum(t_lo + partition, ctx)
    for start in range(t_lo, t_hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)  # partitions are whole tiles: aligned slots, vector scale loads
        slot, t_mask = _tile_slots(bt_row, start, offs_n, t_hi, BLOCK_SIZE, PAGE)
        if PAGE:  # contiguous slots: a scalar base and the loop-invariant tile offsets
            k_ptrs = k_base + slot * W + tile_offs
            v_ptrs = v_base + slot * W + tile_offs
            if WORDS:
                kw_ptrs = kw_base + slot * W4 + word_offs
                vw_ptrs = vw_base + slot * W4 + word_offs
            slot = slot + offs_n
        else:
            k_ptrs = k_base + slot[:, None] * W + offs_w[None, :]
            v_ptrs = v_base + slot[:, None] * W + offs_w[None, :]
            if WORDS:
                kw_ptrs = kw_base + slot[:, None] * W4 + offs_i[None, :]
                vw_ptrs = vw_base + slot[:, None] * W4 + offs_i[None, :]
        kv_mask = t_mask[:, None] & w_mask[None, :]
        if WORDS:
            word_mask = t_mask[:, None] & i_mask[None, :]
        # scores [BLOCK_H, BLOCK_N], in log2 units (qk_scale = softmax scale x log2(e))
        if KV_BITS == 16:
            kt = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(DT)
            s = _dot(q, tl.trans(kt), None, F32) * qk_scale
        else:
            if WORDS:
                kw = tl.load(kw_ptrs, mask=word_mask, other=0)
            else:
                kb = tl.load(k_ptrs, mask=kv_mask, other=0)
            ksc = tl.load(ks_ptr + head_off + slot, mask=t_mask, other=0.0).to(tl.float32) * qk_scale
            kz = tl.load(kz_ptr + head_off + slot, mask=t_mask, other=0).to(tl.float32) + OFF
            if KV_BITS == 8:
                if WORDS:
                    s = _dot(q, tl.trans(_byte_plane(kw, CODE)), None, F32)
                else:
                    s = _dot(q, tl.trans(_codes(kb, CODE, DT)), None, F32)
            elif WORDS:  # the tile once as words, its two nibble planes against the two halves of q
                k_lo, k_hi = _nibble_planes(kw, CODE)
                s = _dot(q, tl.trans(k_lo), None, F32)
                s = _dot(q_hi, tl.trans(k_hi), s, F32)
            else:  # the byte tile once, its two nibble planes against the two halves of q
                s = _dot(q, tl.trans(_codes(kb & 15, CODE, DT)), None, F32)
                s = _dot(q_hi, tl.trans(_codes(kb >> 4, CODE, DT)), s, F32)
            s = (s - q_sum[:, None] * kz[None, :]) * ksc[None, :]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if KV_BITS == 16:
            vt = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(DT)
            acc = _dot(p.to(DT), vt, acc * alpha[:, None], F32)
        else:
            if WORDS:
                vw = tl.load(vw_ptrs, mask=word_mask, other=0)
            else:
                vb = tl.load(v_ptrs, mask=kv_mask, other=0)
            vsc = tl.load(vs_ptr + head_off + slot, mask=t_mask, other=0.0).to(tl.float32)
            vz = tl.load(vz_ptr + head_off + slot, mask=t_mask, other=0).to(tl.float32) + OFF
            ps = (p * vsc[None, :]).to(DT)  # the value scales folded into P
            # the zero points' share, with the same (rounded) weights the dot multiplies
            acc_z = acc_z * alpha[:, None] + ps.to(tl.float32) * vz[None, :]
            if KV_BITS == 8:
                if WORDS:
                    acc = _dot(ps, _byte_plane(vw, CODE), acc * alpha[:, None], F32)
                else:
                    acc = _dot(ps, _codes(vb, CODE, DT), acc * alpha[:, None], F32)
            elif WORDS:  # low nibbles give output channels [0, D/2), high nibbles [D/2, D)
                v_lo, v_hi = _nibble_planes(vw, CODE)
                acc = _dot(ps, v_lo, acc * alpha[:, None], F32)
                acc_hi = _dot(ps, v_hi, acc_hi * alpha[:, None], F32)
            else:
                acc = _dot(ps, _codes(vb & 15, CODE, DT), acc * alpha[:, None], F32)
                acc_hi = _dot(ps, _codes(vb >> 4, CODE, DT), acc_hi * alpha[:, None], F32)
    if SPLIT:  # this partition's rows of the partials
        base = (part.to(tl.int64) * n_rows + r) * n_heads + heads
        o_ptrs, ml_ptrs = o_ptr + base[:, None] * D + ch_w[None, :], ml_ptr + base * 2
    else:
        o_ptrs, ml_ptrs = o_ptr + row * stride_ot + heads[:, None] * D + ch_w[None, :], ml_ptr
    _store_out(o_ptrs, ml_ptrs, acc, acc_hi, acc_z, m_i, l_i, h_mask, hw_mask, W, KV_BITS, SPLIT)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, rows_ptr, ctx_ptr, stride_ot, partition, n_rows, n_heads,
                    D: tl.constexpr, D_PAD: tl.constexpr):
    """out[rows[r], h] = the merge of row r's partitions (only those its context covers, in order)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    ctx = tl.load(ctx_ptr + r)
    offs = tl.arange(0, D_PAD)
    mask = offs < D
    m = float("-inf")
    l_sum = 0.0
    acc = tl.zeros((D_PAD,), dtype=tl.float32)
    for p in range(0, tl.cdiv(ctx, partition)):
        base = (p * n_rows + r).to(tl.int64) * n_heads + h
        m_p = tl.load(ml_ptr + base * 2)
        l_p = tl.load(ml_ptr + base * 2 + 1)
        a_p = tl.load(acc_ptr + base * D + offs, mask=mask, other=0.0)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_p - m_new)
        acc = acc * alpha + a_p * beta
        l_sum = l_sum * alpha + l_p * beta
        m = m_new
    tl.store(out_ptr + row * stride_ot + h * D + offs, (acc / l_sum).to(out_ptr.dtype.element_ty), mask=mask)


# tile configuration per KV kind: BLOCK_N tokens per iteration (a divisor of the engine's default block size of 64,
# so a tile lies inside one cache block), warps, software-pipeline stages (>= 2: the next tile's loads overlap this
# one's math). Chosen by the sm_90 static count (bench/gpu_static_attention.py): no spills for GQA groups 1-8 and
# head dims 64/128, <= 130 registers. int4 takes 3 stages: with 2, ptxas keeps it at 128 registers and, for some
# groups, spills a few bytes (outside the loop) to do so. Never a function of the batch.
CONFIGS = {
    16: dict(block_n=64, num_warps=4, num_stages=2),
    8: dict(block_n=64, num_warps=4, num_stages=2),
    4: dict(block_n=64, num_warps=4, num_stages=3),
}


def config(kv_bits: int, head_dim: int, block_size: int) -> dict:
    """The tile configuration (``block_n``, ``num_warps``, ``num_stages``) for a cache; the same for every batch."""
    return dict(CONFIGS[kv_bits])


def constexprs(dtype: torch.dtype, kv_bits: int, group: int, head_dim: int, block_size: int, block_n: int,
               interpret: bool = False) -> dict:
    """The kernel's compile-time parameters for a launch (also what the static report compiles): ``dtype`` the
    query's; ``interpret``: for Triton's interpreter (float32 dots everywhere)."""
    f32 = "ieee" if interpret else ("tf32x3" if dtype == torch.float32 else "")
    w = head_dim // 2 if kv_bits == 4 else head_dim
    # codes → dot operands (_codes): the magic numbers of the query's 16-bit type; float32 dots take either
    code = 0
    if kv_bits == 4:
        code = 2 if dtype == torch.float16 else 1
    elif kv_bits == 8:
        code = 2
    return dict(G=group, BLOCK_H=BLOCK_H, D=head_dim, W_PAD=max(16, _k._next_pow2(w)), KV_BITS=kv_bits,
                BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGE=block_size % block_n == 0, CODE=code,
                WORDS=kv_bits != 16 and w % 4 == 0, Q16=kv_bits == 8 and dtype == torch.bfloat16, F32=f32)


def decode_attention(q: torch.Tensor, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_scale: torch.Tensor | None, k_zero: torch.Tensor | None, v_scale: torch.Tensor | None,
                     v_zero: torch.Tensor | None, rows: torch.Tensor, row_seq: torch.Tensor, row_ctx: torch.Tensor,
                     block_tables: torch.Tensor, block_size: int, scale: float, kv_bits: int,
                     max_ctx: int | None = None, partition: int | None = None, split: bool | None = None,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> None:
    """Write into ``out[rows[r]]`` the attention of ``q[rows[r]]`` (``q, out [T, H, D]``, last two dims
    contiguous) over the first ``row_ctx[r]`` tokens of sequence ``row_seq[r]``, whose slots are
    ``block_tables[seq, t // block_size] * block_size + t % block_size``. Same operands as
    :func:`backends.triton.kernels.paged_attention`: k, v one layer of the cache ``[KVH, slots, W]`` (16-bit;
    uint8 int8 codes; uint8 int4 nibble pairs, ``W = D/2``), scales float16 and zero points uint8 ``[KVH, slots]``
    (quantized kinds); rows, row_seq, row_ctx int32 ``[R]`` (every ``row_ctx >= 1``); block_tables int32
    ``[B, max_blocks]``; H a multiple of KVH.

    ``partition``: tokens per context partition (rounded up to a multiple of the tile), one program each, merged
    by the combine kernel; needs ``max_ctx`` (the longest ``row_ctx``, a host int). ``split``: ``None`` = through
    the partials only when some row has more than one partition; ``True`` = always (``batch_invariant``: the
    path, hence the bits, of a row never depend on the other rows). Raises ``ValueError`` when ``split`` is asked
    without a partition.
    """
    t, h, d = q.shape
    kvh, n_slots = k.shape[0], k.shape[1]
    g = h // kvh
    n_rows = rows.shape[0]
    if n_rows == 0:
        return
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    assert out.stride(2) == 1 and out.stride(1) == d, "out must have contiguous heads"
    cfg = config(kv_bits, d, block_size)
    bn = block_n or cfg["block_n"]
    warps = num_warps or cfg["num_warps"]
    stages = num_stages or cfg["num_stages"]
    if kv_bits == 16:
        k_scale = k_zero = v_scale = v_zero = k  # unused
    if partition:
        partition = triton.cdiv(partition, bn) * bn  # tiles never straddle partitions
        if max_ctx is None:
            raise ValueError("a partitioned attention needs max_ctx")
    parts = triton.cdiv(max_ctx, partition) if partition else 1
    if split and not partition:
        raise ValueError("split=True needs a partition")
    do_split = bool(split) or parts > 1
    consts = dict(constexprs(q.dtype, kv_bits, g, d, block_size, bn, _INTERPRET), num_warps=warps,
                  num_stages=stages)
    heads_grid = kvh * triton.cdiv(g, BLOCK_H)
    qk_scale = scale * LOG2E
    if not do_split:
        _decode_attention_kernel[(n_rows, heads_grid, 1)](
            q, out, out, k, v, k_scale, k_zero, v_scale, v_zero, rows, row_seq, row_ctx, block_tables,
            block_tables.stride(0), q.stride(0), out.stride(0), n_slots, qk_scale, 1 << 30, n_rows, h,
            SPLIT=False, **consts)
        return
    acc = _k.empty_output((parts, n_rows, h, d), torch.float32, q.device)
    ml = _k.empty_output((parts, n_rows, h, 2), torch.float32, q.device)
    _decode_attention_kernel[(n_rows, heads_grid, parts)](
        q, acc, ml, k, v, k_scale, k_zero, v_scale, v_zero, rows, row_seq, row_ctx, block_tables,
        block_tables.stride(0), q.stride(0), out.stride(0), n_slots, qk_scale, partition, n_rows, h,
        SPLIT=True, **consts)
    _combine_kernel[(n_rows, h)](acc, ml, out, rows, row_ctx, out.stride(0), partition, n_rows, h, D=d,
                                 D_PAD=_k._next_pow2(d))

