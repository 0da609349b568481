"""Numerical tests of the backend kernels (TorchBackend; the paged attention tests over every backend usable here)
and RTN quantization against independent float64 references.

Every reference here is written out explicitly (no call into the library's own dequantize / attention code),
so a bug shared by the kernel and the helper it would otherwise be compared with cannot hide.
"""
from __future__ import annotations

import math

import pytest
import torch

from backends import get_backend
from backends.kv_cache import KVCacheSpec, KVQuantParams
from backends.torch_backend import (DequantHandle, Int4PackHandle, TorchBackend, W4TilesHandle, W8TilesHandle,
                                    _int8_tiled_mm)
from backends.types import AttentionMetadata, QuantizedWeight
from lite.rtn import quantize_rtn

PACKED = (Int4PackHandle, W4TilesHandle)  # a CPU kernel holds the weight (the C++ one on AVX-512 BF16 in bf16)

from conftest import kv_dequant_ref_f64, usable_backends

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _random_qweight(out_f: int, in_f: int, gs: int, seed: int, *, g_idx: torch.Tensor | None = None,
                    bias: bool = False, scale_dtype=torch.float16) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    n_groups = 1 if gs == -1 else in_f // gs
    qweight = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    qzeros = torch.randint(0, 16, (n_groups, out_f), generator=gen, dtype=torch.uint8)
    # scales of varied magnitude, strictly positive
    scales = (torch.rand(n_groups, out_f, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    b = (torch.randn(out_f, generator=gen) * 0.1).to(scale_dtype) if bias else None
    return QuantizedWeight(bits=4, group_size=gs, sym=False, qweight=qweight, qzeros=qzeros, scales=scales,
                           g_idx=g_idx, bias=b)


def _dense_ref_f64(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   groups: list[int]) -> torch.Tensor:
    """W[o, i] = (q[o, i] - z[g(i), o]) * s[g(i), o], written element-wise by input column in float64."""
    out_f, in_f = qweight.shape
    w = torch.empty(out_f, in_f, dtype=torch.float64)
    q64, z64, s64 = qweight.double(), qzeros.double(), scales.double()
    for i in range(in_f):
        g = groups[i]
        w[:, i] = (q64[:, i] - z64[g, :]) * s64[g, :]
    return w


def _assert_close_rel(y: torch.Tensor, y_ref: torch.Tensor, rel: float) -> None:
    assert y.shape == y_ref.shape
    denom = y_ref.abs().max().item()
    err = (y.double() - y_ref).abs().max().item()
    assert err <= rel * max(denom, 1e-12), f"max abs err {err:.3e} > {rel} * max|y_ref| ({denom:.3e})"


# ------------------------------------------------------------------------------------------------
# W4A16
# ------------------------------------------------------------------------------------------------
W4_SHAPES = [
    # (out, in, group_size)
    (64, 576, 64),
    (128, 1536, 64),
    (200, 256, 32),
    (200, 512, 128),
    (72, 384, 128),
    (40, 192, 32),
    (96, 256, 32),
    (208, 512, 128),   # out a multiple of 16 but not of 64
    (48, 128, -1),     # one group over all of in_features
]


def _w4_params():
    params = []
    for shape in W4_SHAPES:
        for int4_kernel in (True, False):
            params.append(pytest.param(shape, int4_kernel,
                                       id="o%d_i%d_g%d-" % shape + ("int4pack" if int4_kernel else "dequant")))
    return params


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape,int4_kernel", _w4_params())
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_w4a16_linear_matches_f64_reference(int4_kernel, dtype, shape, bias):
    out_f, in_f, gs = shape
    seed = out_f * 7 + in_f * 3 + gs + int(bias)
    qw = _random_qweight(out_f, in_f, gs, seed, bias=bias)
    be = TorchBackend("cpu", int4_kernel=int4_kernel)
    handle = be.prepare_w4a16(qw, dtype)
    if int4_kernel and out_f % 16 == 0:
        assert isinstance(handle, PACKED), "int4pack kernel should take this trivial layout"
    elif int4_kernel:  # the CPU packer tiles N by 16: other widths must fall back, not crash
        assert not isinstance(handle, PACKED)
    else:
        assert isinstance(handle, DequantHandle)

    eff_gs = in_f if gs == -1 else gs
    w_ref = _dense_ref_f64(qw.qweight, qw.qzeros, qw.scales, [i // eff_gs for i in range(in_f)])
    gen = torch.Generator().manual_seed(seed + 1)
    for batch in (1, 3, 17, be.dequant_min_rows + 5):  # the last takes the dequantize + GEMM path
        x = torch.randn(batch, in_f, generator=gen).to(dtype)
        y = be.w4a16_linear(x, handle)
        assert y.dtype == dtype
        assert y.shape == (batch, out_f)
        y_ref = x.double() @ w_ref.T
        if bias:
            y_ref = y_ref + qw.bias.double()
        _assert_close_rel(y, y_ref, TOL[dtype])


@pytest.mark.parametrize("int4_kernel", [True, False], ids=["int4pack", "dequant"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_w4a16_explicit_trivial_g_idx(int4_kernel, dtype):
    out_f, in_f, gs = 96, 256, 64
    g_idx = (torch.arange(in_f) // gs).to(torch.int32)
    qw = _random_qweight(out_f, in_f, gs, 11, g_idx=g_idx)
    assert qw.has_trivial_g_idx()
    be = TorchBackend("cpu", int4_kernel=int4_kernel)
    handle = be.prepare_w4a16(qw, dtype)
    assert isinstance(handle, PACKED if int4_kernel else DequantHandle)
    w_ref = _dense_ref_f64(qw.qweight, qw.qzeros, qw.scales, g_idx.tolist())
    x = torch.randn(3, in_f, generator=torch.Generator().manual_seed(12)).to(dtype)
    _assert_close_rel(be.w4a16_linear(x, handle), x.double() @ w_ref.T, TOL[dtype])


@pytest.mark.parametrize("int4_kernel", [True, False], ids=["int4pack", "dequant"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_w4a16_act_order_g_idx_matches(int4_kernel, dtype):
    out_f, in_f, gs = 112, 256, 32
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(5))
    g_idx = (perm // gs).to(torch.int32)  # each group still holds gs channels, scattered over the input
    qw = _random_qweight(out_f, in_f, gs, 21, g_idx=g_idx, bias=True)
    assert not qw.has_trivial_g_idx()
    be = TorchBackend("cpu", int4_kernel=int4_kernel)
    handle = be.prepare_w4a16(qw, dtype)
    # int4pack takes act-order through an input permutation (groups of equal size); else dequant fallback
    assert isinstance(handle, PACKED if int4_kernel else DequantHandle)
    w_ref = _dense_ref_f64(qw.qweight, qw.qzeros, qw.scales, g_idx.tolist())
    gen = torch.Generator().manual_seed(22)
    for batch in (1, 17, be.dequant_min_rows):
        x = torch.randn(batch, in_f, generator=gen).to(dtype)
        y_ref = x.double() @ w_ref.T + qw.bias.double()
        _assert_close_rel(be.w4a16_linear(x, handle), y_ref, TOL[dtype])


# ------------------------------------------------------------------------------------------------
# W8A16
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 11, 12, 17, 70], ids=lambda b: f"rows{b}")
def test_w8a16_linear_matches_f64_reference(batch):
    out_f, in_f = 136, 320
    gen = torch.Generator().manual_seed(31)
    weight = torch.randn(out_f, in_f, generator=gen) * 0.05
    be = TorchBackend("cpu")
    handle = be.prepare_w8a16(weight, torch.bfloat16)
    # VNNI CPUs hold it in the tiled layout of the C++ GEMV; its rows are the row-major codes
    q, scales = (handle.rows(0, out_f), handle.scales) if isinstance(handle, W8TilesHandle) else handle
    assert q.dtype == torch.int8 and q.shape == (out_f, in_f)
    assert scales.shape == (out_f,) and scales.dtype == torch.bfloat16

    # independent per-row symmetric absmax quantization
    s_ref = weight.double().abs().amax(1) / 127.0
    q_ref = torch.clamp(torch.round(weight.double() / s_ref[:, None]), -127, 127)
    assert (q.double() - q_ref).abs().max().item() <= 1  # same rounding up to float32 ties
    assert q.abs().max().item() <= 127

    # with the unrounded per-row scale, the int8 codes are within half a step of the weight
    assert torch.all((q.double() * s_ref[:, None] - weight.double()).abs() <= s_ref[:, None] * (0.5 + 1e-5))
    assert torch.allclose(scales.double(), s_ref, rtol=2 ** -8, atol=0)  # bf16 rounding of the scale
    w_deq = q.double() * scales.double()[:, None]  # the weight the kernel is meant to apply
    x = torch.randn(batch, in_f, generator=gen).to(torch.bfloat16)
    for h in (handle, (q, scales)):
        y = be.w8a16_linear(x, h)
        assert y.dtype == torch.bfloat16 and y.shape == (batch, out_f)
        _assert_close_rel(y, x.double() @ w_deq.T, 2e-2)
    # the many-rows path dequantizes tile by tile: tiles that do not divide out_features (136 = 3*40 + 16)
    y_tiled = _int8_tiled_mm(x, lambda i, j: q[i:j], scales, q.shape, tile=40)
    _assert_close_rel(y_tiled, x.double() @ w_deq.T, 2e-2)
    if isinstance(handle, W8TilesHandle):
        _assert_close_rel(_int8_tiled_mm(x, handle.rows, scales, handle.shape, tile=40), x.double() @ w_deq.T, 2e-2)


# ------------------------------------------------------------------------------------------------
# RMSNorm, rotary
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_f64(dtype):
    gen = torch.Generator().manual_seed(41)
    x = (torch.randn(7, 96, generator=gen) * 3.0).to(dtype)
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    eps = 1e-6
    y = TorchBackend("cpu").rms_norm(x, weight, eps)
    assert y.shape == x.shape and y.dtype == dtype
    x64 = x.double()
    ref = weight.double() * x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x64.shape[-1] + eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (y.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_rms_norm_eps_dominates_zero_row():
    x = torch.zeros(2, 16)
    x[1] = 1e-4
    y = TorchBackend("cpu").rms_norm(x, torch.ones(16), 1e-2)
    assert torch.equal(y[0], torch.zeros(16))
    expected = 1e-4 / math.sqrt(1e-8 + 1e-2)
    assert torch.allclose(y[1].double(), torch.full((16,), expected, dtype=torch.float64), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_matches_explicit_rotate_half(dtype):
    T, H, KVH, D = 6, 4, 2, 16
    gen = torch.Generator().manual_seed(51)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, KVH, D, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 30], dtype=torch.float64)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = positions[:, None] * inv_freq[None, :]  # [T, D/2]
    cos64 = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]  # [T, 1, D]
    sin64 = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    cos, sin = cos64.to(dtype), sin64.to(dtype)

    qo, ko = TorchBackend("cpu").rotary(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape

    def ref(x):
        x = x.double()
        half = D // 2
        c, s = cos.double(), sin.double()  # the same (rounded) tables the kernel received
        out = torch.empty_like(x)
        for j in range(half):
            out[..., j] = x[..., j] * c[..., j] - x[..., j + half] * s[..., j]
            out[..., j + half] = x[..., j + half] * c[..., j + half] + x[..., j] * s[..., j + half]
        return out

    tol = 1e-6 if dtype == torch.float32 else 3e-2
    assert (qo.double() - ref(q)).abs().max().item() <= tol * 4
    assert (ko.double() - ref(k)).abs().max().item() <= tol * 4
    # position 0 is the identity
    assert torch.equal(qo[0], q[0]) and torch.equal(ko[0], k[0])


# ------------------------------------------------------------------------------------------------
# paged KV cache + attention
# ------------------------------------------------------------------------------------------------
H, KVH, HD, BS, NUM_BLOCKS = 4, 2, 16, 4, 16


def _naive_attention_f64(q, keys, vals, ctx, scale):
    """q [t, H, D] at positions ctx-t .. ctx-1; keys/vals [ctx, KVH, D]; causal, GQA h -> h // (H/KVH)."""
    t = q.shape[0]
    rep = H // KVH
    out = torch.zeros(t, H, HD, dtype=torch.float64)
    for j in range(t):
        pos = ctx - t + j
        for h in range(H):
            kh = h // rep
            logits = torch.stack([(q[j, h].double() * keys[p, kh].double()).sum() * scale for p in range(pos + 1)])
            w = torch.softmax(logits, 0)
            out[j, h] = (w[:, None] * vals[: pos + 1, kh].double()).sum(0)
    return out


def _slots(table, start, end):
    return [table[i // BS] * BS + i % BS for i in range(start, end)]


def _new_cache(dtype, kv_dtype=None, layers=2, params=None, backend="torch"):
    """A 2-layer cache of ``backend`` (on its default device); 16-bit caches are poisoned with NaN so that an
    unread-slot gather shows up."""
    be = TorchBackend("cpu") if backend == "torch" else get_backend(backend, "cpu")
    kv_dtype = kv_dtype or str(dtype).removeprefix("torch.")
    cache = be.allocate_kv_cache(KVCacheSpec(kv_dtype, NUM_BLOCKS, BS, layers, KVH, HD), dtype, params)
    if not cache.spec.quantized:
        for t in cache.k + cache.v:
            t.fill_(float("nan"))
    return be, cache


def _build_step(seqs, dtype, seed, kv_dtype=None, params=None, backend="torch"):
    """seqs: list of (cached, new, block_table). Writes the cached part as an earlier step would have,
    then this step's K/V through the cache, and returns everything needed to check attention."""
    gen = torch.Generator().manual_seed(seed)
    be, cache = _new_cache(dtype, kv_dtype, params=params, backend=backend)
    full_k, full_v, qs_list = [], [], []
    # earlier step(s): the already-cached tokens
    for cached, new, table in seqs:
        ctx = cached + new
        assert len(table) * BS >= ctx
        kk = torch.randn(ctx, KVH, HD, generator=gen).to(dtype)
        vv = torch.randn(ctx, KVH, HD, generator=gen).to(dtype)
        full_k.append(kk)
        full_v.append(vv)
        if cached:
            cache.write(0, kk[:cached], vv[:cached], torch.tensor(_slots(table, 0, cached), dtype=torch.int64))
    # this step: all sequences' new tokens as one flat batch
    query_start, slot_mapping, k_new, v_new = [0], [], [], []
    for (cached, new, table), kk, vv in zip(seqs, full_k, full_v):
        query_start.append(query_start[-1] + new)
        slot_mapping += _slots(table, cached, cached + new)
        k_new.append(kk[cached:])
        v_new.append(vv[cached:])
        qs_list.append(torch.randn(new, H, HD, generator=gen).to(dtype))
    slot_mapping = torch.tensor(slot_mapping, dtype=torch.int64)
    cache.write(0, torch.cat(k_new), torch.cat(v_new), slot_mapping)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start=query_start,
        context_lens=[c + n for c, n, _ in seqs],
        block_tables=[list(t) for _, _, t in seqs],
        block_size=BS,
    )
    return be, cache, torch.cat(qs_list), meta, full_k, full_v


def test_kv_cache_layout_is_head_major_blocks():
    _, cache = _new_cache(torch.float32)
    assert tuple(cache.k[0].shape) == (KVH, NUM_BLOCKS * BS, HD)
    _, cache4 = _new_cache(torch.float32, "int4")
    assert tuple(cache4.k[0].shape) == (KVH, NUM_BLOCKS * BS, HD // 2) and cache4.k[0].dtype == torch.uint8
    assert tuple(cache4.k_scale[0].shape) == (KVH, NUM_BLOCKS * BS)


def test_write_kv_places_tokens_in_slots():
    _, cache = _new_cache(torch.float32)
    for t in cache.k + cache.v:
        t.zero_()
    k = torch.randn(5, KVH, HD)
    v = torch.randn(5, KVH, HD)
    table = [9, 2]
    slots = torch.tensor(_slots(table, 1, 6))  # tokens 1..5: block 9 offsets 1..3, block 2 offsets 0..1
    cache.write(1, k, v, slots)
    # head-major [KVH, block * BS + offset, D], indexed by hand
    for j, (blk, off) in enumerate([(9, 1), (9, 2), (9, 3), (2, 0), (2, 1)]):
        for h in range(KVH):
            assert torch.equal(cache.k[1][h, blk * BS + off], k[j, h]) and torch.equal(cache.v[1][h, blk * BS + off], v[j, h])
    rk, rv = cache.read(1, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    # nothing else was written (layer 0 untouched)
    assert torch.count_nonzero(cache.k[1]) == torch.count_nonzero(k) and torch.count_nonzero(cache.v[1]) == torch.count_nonzero(v)
    assert torch.count_nonzero(cache.k[0]) == 0


# block tables: non-contiguous and shuffled; unused blocks stay NaN so a wrong gather shows up
SEQ_DECODE = (6, 1, [11, 3])                 # 6 cached + 1 decode token, ctx 7
SEQ_CHUNK = (8, 5, [7, 0, 14, 5])            # chunked prefill: 5 new tokens over a context of 13
SEQ_PREFILL = (0, 6, [12, 1])                # full prefill of 6 tokens
SEQ_DECODE_FIRST = (0, 1, [4])               # a 1-token prompt: t == ctx == 1
SEQ_DECODE_LONG = (13, 1, [8, 10, 13, 15])   # a longer decode: shorter decode rows are padded to its 14
SEQ_CASES = [
    [SEQ_DECODE, SEQ_CHUNK],
    [SEQ_CHUNK, SEQ_DECODE, SEQ_PREFILL],
    [SEQ_PREFILL, SEQ_DECODE_FIRST],
    [SEQ_DECODE, SEQ_DECODE_LONG, SEQ_DECODE_FIRST],
    [SEQ_DECODE_FIRST, SEQ_CHUNK, SEQ_DECODE_LONG],
    [SEQ_DECODE],
    [SEQ_CHUNK],
    [SEQ_PREFILL],
]
SEQ_IDS = ["decode+chunk", "chunk+decode+prefill", "prefill+first", "three_decodes", "first+chunk+long",
           "decode_only", "chunk_only", "prefill_only"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqs", SEQ_CASES, ids=SEQ_IDS)
@pytest.mark.parametrize("backend_name", usable_backends("cpu"))
def test_paged_attention_matches_naive_f64(seqs, dtype, backend_name):
    be, cache, q, meta, full_k, full_v = _build_step(seqs, dtype, seed=len(seqs) * 100 + 7, backend=backend_name)
    scale = 1.0 / math.sqrt(HD)
    out = be.attention(q, cache, 0, meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for b, (cached, new, _) in enumerate(seqs):
        qs, qe = meta.query_start[b], meta.query_start[b + 1]
        ref = _naive_attention_f64(q[qs:qe], full_k[b], full_v[b], cached + new, scale)
        err = (out[qs:qe].double() - ref).abs().max().item()
        assert err <= tol, f"seq {b}: max err {err:.3e}"

    # a second layer reuses meta (and its scratch) with other K/V and queries and must still be right
    gen = torch.Generator().manual_seed(999)
    full_k2, full_v2 = [], []
    for cached, new, table in seqs:
        ctx = cached + new
        kk = torch.randn(ctx, KVH, HD, generator=gen).to(dtype)
        vv = torch.randn(ctx, KVH, HD, generator=gen).to(dtype)
        cache.write(1, kk, vv, torch.tensor(_slots(table, 0, ctx), dtype=torch.int64))
        full_k2.append(kk)
        full_v2.append(vv)
    q2 = torch.randn(q.shape, generator=gen).to(dtype)
    out2 = be.attention(q2, cache, 1, meta, scale)
    for b, (cached, new, _) in enumerate(seqs):
        qs, qe = meta.query_start[b], meta.query_start[b + 1]
        ref = _naive_attention_f64(q2[qs:qe], full_k2[b], full_v2[b], cached + new, scale)
        assert (out2[qs:qe].double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("seqs", SEQ_CASES[:5], ids=SEQ_IDS[:5])
@pytest.mark.parametrize("backend_name", usable_backends("cpu"))
def test_paged_attention_over_quantized_cache_matches_f64_of_dequantized_kv(seqs, kv_dtype, backend_name):
    """Attention over an int8/int4 cache equals float64 attention over the float64-dequantized K/V of the
    reference quantizer (what the cache must hold), to float32 rounding."""
    be, cache, q, meta, full_k, full_v = _build_step(seqs, torch.float32, seed=31, kv_dtype=kv_dtype,
                                                      backend=backend_name)
    bits = 8 if kv_dtype == "int8" else 4
    out = be.attention(q, cache, 0, meta, 1.0 / math.sqrt(HD))
    assert torch.isfinite(out).all()
    for b, (cached, new, _) in enumerate(seqs):
        qs, qe = meta.query_start[b], meta.query_start[b + 1]
        kq, vq = kv_dequant_ref_f64(full_k[b], bits), kv_dequant_ref_f64(full_v[b], bits)
        ref = _naive_attention_f64(q[qs:qe], kq, vq, cached + new, 1.0 / math.sqrt(HD))
        assert (out[qs:qe].double() - ref).abs().max().item() <= 1e-5


def _hadamard_f64(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(d)


@pytest.mark.parametrize("mode", ["scale+shift", "scale+shift+hadamard", "rotation-only"])
@pytest.mark.parametrize("seqs", SEQ_CASES[:5], ids=SEQ_IDS[:5])
@pytest.mark.parametrize("backend_name", usable_backends("cpu"))
def test_paged_attention_over_calibrated_cache_matches_f64(seqs, mode, backend_name):
    """Calibrated int4 cache and the uncalibrated rotated one (``KVQuantParams.rotation_only``, int4's default):
    attention (query transform, stored-space keys/values, output rotation) equals float64 attention over the
    keys/values the reference transform + quantizer + inverse gives (the shift is added back in the reference:
    attention must not depend on it)."""
    gen = torch.Generator().manual_seed(8)
    rotate = mode != "scale+shift"
    if mode == "rotation-only":
        params = KVQuantParams.rotation_only(2, KVH, HD)
        shift, scale = params.k_shift, params.k_scale
    else:
        shift = torch.randn(2, KVH, HD, generator=gen) * 5
        scale = torch.rand(2, KVH, HD, generator=gen) + 0.2
        flag = torch.tensor([rotate, False])
        params = KVQuantParams(shift, scale, flag, flag)
    be, cache, q, meta, full_k, full_v = _build_step(seqs, torch.float32, seed=32, kv_dtype="int4", params=params,
                                                      backend=backend_name)
    out = be.attention(q, cache, 0, meta, 1.0 / math.sqrt(HD))
    h = _hadamard_f64(HD) if rotate else torch.eye(HD, dtype=torch.float64)
    sh, sc = shift[0].double(), scale[0].double()
    for b, (cached, new, _) in enumerate(seqs):
        qs, qe = meta.query_start[b], meta.query_start[b + 1]
        kq = kv_dequant_ref_f64(((full_k[b].double() - sh) / sc) @ h, 4) @ h * sc + sh
        vq = kv_dequant_ref_f64(full_v[b].double() @ h, 4) @ h
        ref = _naive_attention_f64(q[qs:qe], kq, vq, cached + new, 1.0 / math.sqrt(HD))
        # the Triton kernel dots int4 codes as 128 + code (a magic-number conversion, the offset folded into the
        # zero point): about 3 bits of float32 lost against the other backends' direct conversion
        tol = 1e-4 if backend_name == "triton" else 2e-5
        assert (out[qs:qe].double() - ref).abs().max().item() <= tol


# ------------------------------------------------------------------------------------------------
# RTN quantization
# ------------------------------------------------------------------------------------------------
def _rtn_dequant_f64(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense weight, per-element scale), computed explicitly in float64."""
    out_f, in_f = qw.qweight.shape
    gs = in_f if qw.group_size == -1 else qw.group_size
    g = torch.arange(in_f) // gs
    s = qw.scales.double()[g].T  # [out, in]
    z = qw.qzeros.double()[g].T
    return (qw.qweight.double() - z) * s, s


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_quantize_rtn_error_within_half_step(sym, group_size):
    gen = torch.Generator().manual_seed(61)
    w = torch.randn(24, 256, generator=gen) * 0.1
    w[3, :64] += 0.1  # a shifted (mostly positive) region, still containing a sign change per group
    w[5, 40:50] *= 20  # outliers
    w[7, 100:110] = -w[7, 100:110].abs() - 0.3  # a strongly negative run inside a mixed-sign group
    qw = quantize_rtn(w, bits=4, group_size=group_size, sym=sym)
    assert qw.qweight.dtype == torch.uint8 and qw.qzeros.dtype == torch.uint8
    assert qw.scales.dtype == torch.float16
    assert int(qw.qweight.max()) <= 15 and int(qw.qzeros.max()) <= 15
    n_groups = 1 if group_size == -1 else 256 // group_size
    assert qw.qzeros.shape == (n_groups, 24) and qw.scales.shape == (n_groups, 24)
    if sym:
        assert torch.all(qw.qzeros == 8)
    deq, s = _rtn_dequant_f64(qw)
    err = (deq - w.double()).abs()
    # half a step; asym may exceed it by the fp16 rounding of the scale at the top of the range
    # (range/s can be up to 15 * (1 + 2**-11) so the max may clamp at code 15)
    slack = s * (15 * 2.0 ** -11 if not sym else 1e-6) + 1e-7
    assert torch.all(err <= s / 2 + slack), f"max excess {(err - s / 2 - slack).max().item():.3e}"


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["all_pos", "all_neg"])
def test_quantize_rtn_one_signed_group_within_half_step(sign):
    w = sign * torch.linspace(1.0, 2.0, 32)[None, :].repeat(2, 1)
    qw = quantize_rtn(w, bits=4, group_size=32, sym=False)
    deq, s = _rtn_dequant_f64(qw)
    assert torch.all((deq - w.double()).abs() <= s / 2 + s * 15 * 2.0 ** -11 + 1e-7)


def test_quantize_rtn_all_zero_group_exact():
    for sym in (False, True):
        w = torch.randn(4, 64, generator=torch.Generator().manual_seed(71))
        w[1, 32:] = 0.0
        w[2] = 0.0
        qw = quantize_rtn(w, bits=4, group_size=32, sym=sym)
        deq, _ = _rtn_dequant_f64(qw)
        assert torch.equal(deq[1, 32:], torch.zeros(32, dtype=torch.float64))
        assert torch.equal(deq[2], torch.zeros(64, dtype=torch.float64))
        assert torch.isfinite(deq).all()


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_quantize_rtn_constant_group_within_half_step(sym):
    w = torch.zeros(2, 64)
    w[0, :32] = 0.5
    w[1, 32:] = -0.25
    qw = quantize_rtn(w, bits=4, group_size=32, sym=sym)
    deq, s = _rtn_dequant_f64(qw)
    assert torch.all((deq - w.double()).abs() <= s / 2 + 1e-9)
    assert torch.equal(deq[0, 32:], torch.zeros(32, dtype=torch.float64))


def test_quantize_rtn_rejects_indivisible_group():
    with pytest.raises(ValueError):
        quantize_rtn(torch.randn(8, 100), bits=4, group_size=32)
    with pytest.raises(ValueError):
        quantize_rtn(torch.randn(8, 96), bits=4, group_size=64)


def test_w4a16_irregular_g_idx_falls_back():
    """A g_idx whose groups are not all group_size long cannot be permuted into int4pack: dequant path."""
    out_f, in_f, gs = 64, 128, 32
    g_idx = torch.zeros(in_f, dtype=torch.int32)
    g_idx[40:] = torch.arange(88, dtype=torch.int32) % 4  # group 0 has 40+22 members, others fewer
    qw = _random_qweight(out_f, in_f, gs, 23, g_idx=g_idx)
    be = TorchBackend("cpu")
    handle = be.prepare_w4a16(qw, torch.bfloat16)
    assert isinstance(handle, DequantHandle)
    w_ref = _dense_ref_f64(qw.qweight, qw.qzeros, qw.scales, g_idx.tolist())
    x = torch.randn(3, in_f).to(torch.bfloat16)
    _assert_close_rel(be.w4a16_linear(x, handle), x.double() @ w_ref.T, TOL[torch.bfloat16])
