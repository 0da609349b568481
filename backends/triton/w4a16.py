"""W4A16 decode GEMV and GEMM kernels on a load-time tiled weight layout (the Triton backend's W4A16 path).

Layout (:func:`pack_tiled`, made once at load time, byte level): the int4 codes of ``W [N, K]`` as int32 words
``[ceil(N / 128), K8P, 128]`` (``K8P`` = ``ceil(K / 128) * 16`` words along K): word ``[t, r, c]`` holds input
channels ``8r .. 8r + 7`` of output ``128t + c``, channel ``8r + j`` in bits ``4j`` (GPTQ's sequential order inside
the word, as :func:`backends.triton.kernels.pack_w4`). A program's weight tile is one contiguous stream along K, a
warp's 16-byte vector loads cover 512 contiguous bytes, and the padding (code-0 words) means the weight loads carry
no K mask (nor an N mask when the column block divides the padded N). Scales ``[groups, N]`` in the compute
dtype, zero points uint8 ``[groups, N]``, both loaded as vectors along N, once per K tile.

- :func:`w4a16_matmul` picks, per call, the **GEMV** kernel (``M`` up to ``gemv_max_m``, no ``tl.dot``): each
  thread holds whole words, converts the 8 codes of a word with magic-number bit tricks (``lop3`` into the fp16
  ``0x6400`` exponent, the zero point subtracted in packed fp16 — exact —, ``cvt`` to float32: the conversion
  of FasterTransformer / Marlin, by ``tl.inline_asm_elementwise``), accumulates ``x * (q - z)`` in float32 per
  K tile and applies the group's scale once per tile (``s * sum x (q - z)``; once per kernel for one group over
  K); or the **tensor-core** kernel for more rows: the same conversion, the exact integers ``q - z`` in the
  activation dtype as the dot's operand (float32 products, float32 accumulation), the group's scale applied to
  the tile's dot product in float32 (K tiles never straddle a group).
- **Split-K** is reduced inside the kernel: every program of a split stores its float32 partial tile, takes a
  ticket from a per-tile counter (``atomic_add`` with acquire-release ordering, partials read back past L1), and
  the last one sums the partials in split order, adds the bias, casts and stores, then resets the counter: one
  launch, and the same bits on every run (no float atomics). The counters are one zeroed buffer per device, so
  split-K launches must not run concurrently on two streams.
- The inline assembly is PTX: under Triton's interpreter (``TRITON_INTERPRET=1``) and on ROCm, ``ASM=False``
  computes the same values with shifts and masks (``q - z`` is an exact small integer either way).

``batch_invariant``: the kernel, tiles and split are fixed independently of ``M`` (the tensor-core kernel with
16-row tiles, the split from N and K), so a row's result does not depend on the rows batched with it.

Configurations (block sizes, warps, stages, split, the GEMV/GEMM crossover) come from ``w4a16_configs.json`` beside
this file, keyed by ``N,K`` and an ``M`` bucket, with defaults for shapes it does not list (tuned on an H200 by
``bench/w4a16_tune.py``: the GEMV serves M = 1, the tensor-core kernel from M = 2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..platform import triton_interpret
from .w4a16_plan import (M_BUCKETS, TILE_K, TILE_N, choose_split, get_config, kernel_group,  # noqa: F401 (re-exported)
                         launch_params, load_configs, m_bucket, pack_tiled, pack_words, supports, unpack_tiled)

_INTERPRET = triton_interpret()


# --- int4 → float32 -----------------------------------------------------------------------------------------
# word w and the zero point z as packed fp16 pairs: zlo = (1024 + z, 1024 + z), nzhi = -(64 + z, 64 + z).
# lop3 (w & mask) | 0x6400 makes fp16 1024 + q (low nibble of a byte) or 1024 + 16 q (high nibble); subtracting
# zlo, or fma(h, 1/16, nzhi), gives q - z exactly in fp16; cvt.f32.f16 widens. Outputs $0..$7 = channels 0..7.
_I4_TO_F32 = tl.constexpr("""{
.reg .b32 t, h0, h1, h2, h3, m0, m1, mg, sx;
.reg .b16 l0, u0, l1, u1, l2, u2, l3, u3;
mov.b32 m0, 0x000f000f;
mov.b32 m1, 0x00f000f0;
mov.b32 mg, 0x64006400;
mov.b32 sx, 0x2c002c00;
shr.u32 t, $8, 8;
lop3.b32 h0, $8, m0, mg, 0xea;
lop3.b32 h1, $8, m1, mg, 0xea;
lop3.b32 h2, t, m0, mg, 0xea;
lop3.b32 h3, t, m1, mg, 0xea;
sub.f16x2 h0, h0, $9;
fma.rn.f16x2 h1, h1, sx, $10;
sub.f16x2 h2, h2, $9;
fma.rn.f16x2 h3, h3, sx, $10;
mov.b32 {l0, u0}, h0;
mov.b32 {l1, u1}, h1;
mov.b32 {l2, u2}, h2;
mov.b32 {l3, u3}, h3;
cvt.f32.f16 $0, l0;
cvt.f32.f16 $1, l1;
cvt.f32.f16 $2, l2;
cvt.f32.f16 $3, l3;
cvt.f32.f16 $4, u0;
cvt.f32.f16 $5, u1;
cvt.f32.f16 $6, u2;
cvt.f32.f16 $7, u3;
}""")


@triton.jit
def _zero_pairs(z):
    """uint8/int32 zero points → (zlo, nzhi) int32 packed fp16 pairs for :data:`_I4_TO_F32`."""
    zi = z.to(tl.int32)
    zlo = (zi * 0x00010001) | 0x64006400
    nzhi = (zi * 0x00100010) | -738143232  # 0xD400D400 as int32
    return zlo, nzhi


@triton.jit
def unpack8(w, z, ASM: tl.constexpr):
    """The 8 channels of int32 words ``w`` minus zero points ``z`` (broadcastable) as float32 (exact integers)."""
    if ASM:
        zlo, nzhi = _zero_pairs(z)
        d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
            _I4_TO_F32, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r", [w, zlo, nzhi], dtype=(tl.float32,) * 8, is_pure=True,
            pack=1)
    else:
        zi = z.to(tl.int32)
        d0 = ((w & 15) - zi).to(tl.float32)
        d1 = (((w >> 4) & 15) - zi).to(tl.float32)
        d2 = (((w >> 8) & 15) - zi).to(tl.float32)
        d3 = (((w >> 12) & 15) - zi).to(tl.float32)
        d4 = (((w >> 16) & 15) - zi).to(tl.float32)
        d5 = (((w >> 20) & 15) - zi).to(tl.float32)
        d6 = (((w >> 24) & 15) - zi).to(tl.float32)
        d7 = (((w >> 28) & 15) - zi).to(tl.float32)
    return d0, d1, d2, d3, d4, d5, d6, d7


# --- split-K epilogue -----------------------------------------------------------------------------------------
@triton.jit
def _epilogue(acc, offs_m, offs_n, m_mask, n_mask, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, tile,
              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Store ``acc [BLOCK_M, BLOCK_N]`` (float32): directly (bias added, cast), or, with ``SPLIT`` > 1, as this
    split's partial; the last split of the tile to arrive sums all partials in split order and stores."""
    o_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT > 1:
        pid_k = tl.program_id(2)
        mn = (tl.zeros([], dtype=tl.int64) + M) * N  # M may be the constant 1 (Triton specializes it)
        tl.store(ws_ptr + pid_k * mn + o_off, acc, mask=o_mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            acc = tl.load(ws_ptr + o_off, mask=o_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                acc += tl.load(ws_ptr + s * mn + o_off, mask=o_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


# --- GEMV (small M, no tl.dot) --------------------------------------------------------------------------------
@triton.jit
def _x8(x_row, kk, K, EVEN_K: tl.constexpr):
    """Activations ``x_row[kk + j]``, j = 0..7 (zero past K unless ``EVEN_K``)."""
    if EVEN_K:
        x0 = tl.load(x_row + kk)
        x1 = tl.load(x_row + kk + 1)
        x2 = tl.load(x_row + kk + 2)
        x3 = tl.load(x_row + kk + 3)
        x4 = tl.load(x_row + kk + 4)
        x5 = tl.load(x_row + kk + 5)
        x6 = tl.load(x_row + kk + 6)
        x7 = tl.load(x_row + kk + 7)
    else:
        x0 = tl.load(x_row + kk, mask=kk < K, other=0.0)
        x1 = tl.load(x_row + kk + 1, mask=kk + 1 < K, other=0.0)
        x2 = tl.load(x_row + kk + 2, mask=kk + 2 < K, other=0.0)
        x3 = tl.load(x_row + kk + 3, mask=kk + 3 < K, other=0.0)
        x4 = tl.load(x_row + kk + 4, mask=kk + 4 < K, other=0.0)
        x5 = tl.load(x_row + kk + 5, mask=kk + 5 < K, other=0.0)
        x6 = tl.load(x_row + kk + 6, mask=kk + 6 < K, other=0.0)
        x7 = tl.load(x_row + kk + 7, mask=kk + 7 < K, other=0.0)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _dot8(acc, x_row, kk, K, d0, d1, d2, d3, d4, d5, d6, d7, EVEN_K: tl.constexpr):
    """``acc [BK8, BN] + sum_j x_row[kk + j] * d_j`` in float32, j in order."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_row, kk, K, EVEN_K)
    acc += x0.to(tl.float32)[:, None] * d0
    acc += x1.to(tl.float32)[:, None] * d1
    acc += x2.to(tl.float32)[:, None] * d2
    acc += x3.to(tl.float32)[:, None] * d3
    acc += x4.to(tl.float32)[:, None] * d4
    acc += x5.to(tl.float32)[:, None] * d5
    acc += x6.to(tl.float32)[:, None] * d6
    acc += x7.to(tl.float32)[:, None] * d7
    return acc


@triton.jit
def _load_words(w_ptrs, k0, offs_n, NP, EVEN_N: tl.constexpr):
    """The ``[BK8, BLOCK_N]`` int32 words of the K tile at ``k0`` (tiled layout), streamed once (``evict_first``);
    columns past the padded ``NP`` masked unless the column block divides it."""
    if EVEN_N:
        w = tl.load(w_ptrs + (k0 // 8) * 128, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs + (k0 // 8) * 128, mask=(offs_n < NP)[None, :], other=0, eviction_policy="evict_first")
    return w


@triton.jit
def group_params(z_ptr, s_ptr, g, N, offs_n, n_mask):
    """Zero points (``[1, BLOCK_N]``, integer) and float32 scales of group ``g`` for the block's columns."""
    z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0)[None, :]
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return z, s


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, K8P, NP, stride_xm, k_per_split,
                       GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BK8: tl.constexpr = BLOCK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BK8)
    rows = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    w_ptrs = qw_ptr + ((offs_n // 128).to(tl.int64) * K8P * 128 + offs_n % 128)[None, :] + (offs_r * 128)[:, None]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if BLOCK_M == 1:
        acc = tl.zeros((BK8, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GROUP == 0:  # one group over K: zero point here, scale at the end
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0)[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = _load_words(w_ptrs, k0, offs_n, NP, EVEN_N)
        if GROUP != 0:
            z, s = group_params(z_ptr, s_ptr, k0 // GROUP, N, offs_n, n_mask)
        d0, d1, d2, d3, d4, d5, d6, d7 = unpack8(w, z, ASM)
        kk = k0 + offs_r * 8
        if BLOCK_M == 1:
            x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
            if GROUP != 0:
                a = _dot8(tl.zeros((BK8, BLOCK_N), dtype=tl.float32), x_row, kk, K, d0, d1, d2, d3, d4, d5, d6, d7,
                          EVEN_K)
                acc += a * s
            else:
                acc = _dot8(acc, x_row, kk, K, d0, d1, d2, d3, d4, d5, d6, d7, EVEN_K)
        else:
            for mi in tl.static_range(BLOCK_M):
                m = pid_m * BLOCK_M + mi
                x_row = x_ptr + tl.where(m < M, m, 0).to(tl.int64) * stride_xm  # rows past M read row 0, unused
                a = _dot8(tl.zeros((BK8, BLOCK_N), dtype=tl.float32), x_row, kk, K, d0, d1, d2, d3, d4, d5, d6, d7,
                          EVEN_K)
                if GROUP != 0:
                    a = a * s
                r = tl.sum(a, axis=0)
                acc = tl.where(rows[:, None] == mi, acc + r[None, :], acc)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=0)[None, :]
    else:
        out = acc
    if GROUP == 0:
        out = out * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    offs_m = pid_m * BLOCK_M + rows
    _epilogue(out, offs_m, offs_n, offs_m < M, n_mask, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
              pid_m * tl.num_programs(1) + pid_n, HAS_BIAS, SPLIT)


# --- tensor cores (larger M) ------------------------------------------------------------------------------------
@triton.jit
def _w4a16_dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                      M, N, K, K8P, NP, stride_xm, k_per_split,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                      ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BK8: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BK8)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = qw_ptr + ((offs_n // 128).to(tl.int64) * K8P * 128 + offs_n % 128)[None, :] + (offs_r * 128)[:, None]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if IEEE:  # float32 activations, or Triton's interpreter (whose bf16 dot is wrong): exact float32 products
        op_ty: tl.constexpr = tl.float32
    else:  # tensor cores: x and the exact integers q - z in 16 bits, float32 accumulation
        op_ty: tl.constexpr = x_ptr.dtype.element_ty
    if GROUP == 0:  # one group over K: zero point and scale loaded once
        z = tl.load(z_ptr + offs_n, mask=n_mask, other=0)[None, :]
        s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = _load_words(w_ptrs, k0, offs_n, NP, EVEN_N)
        if GROUP != 0:
            z, s = group_params(z_ptr, s_ptr, k0 // GROUP, N, offs_n, n_mask)
        d0, d1, d2, d3, d4, d5, d6, d7 = unpack8(w, z, ASM)
        # [BK8, BN] x 8 channels -> [BK, BN] (row 8 r + j): each join adds a minor dimension, so the first join
        # picks bit 2 of j, the last bit 0; then one permute and reshape
        t = tl.join(tl.join(tl.join(d0.to(op_ty), d4.to(op_ty)), tl.join(d2.to(op_ty), d6.to(op_ty))),
                    tl.join(tl.join(d1.to(op_ty), d5.to(op_ty)), tl.join(d3.to(op_ty), d7.to(op_ty))))
        q = tl.reshape(tl.permute(tl.reshape(t, (BK8, BLOCK_N, 8)), (0, 2, 1)), (BLOCK_K, BLOCK_N))
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        if IEEE:
            part = tl.dot(x.to(tl.float32), q, input_precision="ieee")
        else:
            part = tl.dot(x, q)
        if GROUP != 0:
            acc += part * s
        else:
            acc += part
    if GROUP == 0:
        acc = acc * s
    _epilogue(acc, offs_m, offs_n, m_mask, n_mask, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
              pid_m * tl.num_programs(1) + pid_n, HAS_BIAS, SPLIT)


# --- dense dequantization (prefill-sized M: dequantize, then cuBLAS) -------------------------------------------
@triton.jit
def _dequant_tiled_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, K8P, GROUP: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + ((offs_n // 128).to(tl.int64) * K8P * 128 + offs_n % 128)[None, :] +
                    ((offs_k // 8) * 128)[:, None], mask=mask, other=0)
    q = (words >> ((offs_k % 8) * 4)[:, None]) & 15
    if GROUP != 0:
        g = offs_k // GROUP
    else:
        g = offs_k * 0
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.int32)
    w = (q - z).to(tl.float32) * s
    tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# --- host side --------------------------------------------------------------------------------------------------
_COUNTERS: dict = {}
_KEEP: list = []  # counters outlive any CUDA graph that captured them


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 tile counters for the split-K ticket (each last program resets its own to 0)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
        _KEEP.append(buf)
    return buf


def use_asm(device: torch.device) -> bool:
    """The PTX conversion runs on NVIDIA GPUs only: not in the interpreter, not on ROCm (the shift-and-mask twin)."""
    return not _INTERPRET and device.type == "cuda" and torch.version.hip is None


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, n: int, k: int, bias: torch.Tensor | None = None, *, split_k: int | None = None,
                 sms: int = 1, batch_invariant: bool = False, config: dict | None = None,
                 kind: str | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` → ``[M, N]`` in ``x.dtype`` from the :func:`pack_tiled` weight.

    scales ``[groups, N]`` (any float dtype), zeros uint8 ``[groups, N]``. ``split_k``: fixed split (None/0: from
    ``sms``, the multiprocessor count). ``batch_invariant``: one kernel, tile and split for every ``M`` (the
    tensor-core kernel, 16-row tiles, the split from N and K only), so a row's bits do not depend on its batch.
    ``config`` / ``kind`` override the table (for benchmarks and tests).
    """
    from .kernels import empty_output

    m = x.shape[0]
    if kernel_group(group_size, k) % 8:
        raise ValueError(f"group size {group_size} is not a multiple of 8: use the gptq-layout kernel")
    p = launch_params(m, n, k, group_size, sms=sms, batch_invariant=batch_invariant, config=config, kind=kind,
                      split_k=split_k, fp32=x.dtype == torch.float32)
    block_m, block_n, block_k, split = p["block_m"], p["block_n"], p["block_k"], p["split"]
    m_blocks, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k8p = qweight.shape[1]
    np_ = qweight.shape[0] * TILE_N
    out = empty_output((m, n), x.dtype, x.device)
    if m == 0:
        return out
    if split > 1:
        ws = empty_output((split, m, n), torch.float32, x.device)
        cnt = _counters(x.device, m_blocks * n_tiles)
    else:
        ws, cnt = out, zeros
    grid = (m_blocks, n_tiles, split)
    args = (x, qweight, scales, zeros, bias if bias is not None else scales, out, ws, cnt,
            m, n, k, k8p, np_, x.stride(0), p["k_per_split"])
    common = dict(GROUP=p["group"], HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, EVEN_K=k % block_k == 0, EVEN_N=np_ % block_n == 0,
                  num_warps=p["num_warps"], num_stages=p["num_stages"])
    asm = use_asm(x.device)
    if p["kind"] == "gemv":
        _w4a16_gemv_kernel[grid](*args, ASM=asm, **common)
    else:
        _w4a16_dot_kernel[grid](*args, IEEE=x.dtype == torch.float32 or _INTERPRET, ASM=asm, **common)
    return out


def dequantize_tiled(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, n: int,
                     k: int, dtype: torch.dtype, out: torch.Tensor | None = None, block_k: int = 64,
                     block_n: int = 64) -> torch.Tensor:
    """Dense ``W.T [K, N]`` in ``dtype`` from the :func:`pack_tiled` weight."""
    from .kernels import empty_output

    if out is None:
        out = empty_output((k, n), dtype, qweight.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequant_tiled_kernel[grid](qweight, scales, zeros, out, n, k, qweight.shape[1], GROUP=kernel_group(group_size, k),
                                BLOCK_K=block_k, BLOCK_N=block_n)
    return out
