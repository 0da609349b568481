"""Triton kernels against float64 references, on fresh random inputs with ragged shapes and poisoned outputs.

Without a GPU they run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``); tests marked ``gpu`` need
CUDA. Every kernel is also checked through the backend API parametrized over the backends usable here.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import KVCacheSpec, QuantizedWeight, get_backend  # noqa: E402
from backends.kv_cache import pack_int4, quantize_per_token  # noqa: E402
from backends.types import AttentionMetadata  # noqa: E402

from conftest import usable_backends  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _d(t):
    """On the kernels' device (the GPU, or the CPU for Triton's interpreter)."""
    return None if t is None else t.to(DEVICE)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    from backends.triton import kernels

    monkeypatch.setattr(kernels, "POISON", True)
    return kernels


def _qweight(n, k, gs, sym=False, g_idx=None, seed=0, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    groups = (k + gs - 1) // gs if g_idx is None else int(g_idx.max()) + 1
    zeros = torch.full((groups, n), 8, dtype=torch.uint8) if sym else torch.randint(0, 16, (groups, n), generator=g,
                                                                                      dtype=torch.uint8)
    return QuantizedWeight(4, gs, sym, torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), zeros,
                           (torch.rand(groups, n, generator=g) * 0.05 + 0.005).to(dtype), g_idx,
                           (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None)


def _rel(got, ref):
    assert torch.isfinite(got).all(), "an output element was not written (poisoned NaN left)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


# --- W4A16 GEMM -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gs", [32, 64, 128, 256])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_w4a16_gemm_matches_float64(poisoned, m, gs, dtype):
    n, k = 72 + gs // 32, 2 * gs + (gs if gs < 128 else 0)  # N not a multiple of the tile; K several groups
    qw = _qweight(n, k, gs, seed=m + gs)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.double() @ qw.dequantize(torch.float64).T
    packed = poisoned.pack_w4(qw.qweight)
    for split in (1, 3):
        y = poisoned.w4a16_gemm(x.to(DEVICE), packed.to(DEVICE), qw.scales.to(DEVICE, dtype), qw.qzeros.to(DEVICE), gs,
                                n, k, split_k=split)
        assert y.shape == (m, n) and y.dtype == dtype
        assert _rel(y.cpu(), ref) < TOL[dtype], (m, gs, split)


def test_pack_w4_round_trip_and_bit_order(poisoned):
    codes = torch.randint(0, 16, (5, 21), dtype=torch.uint8)
    words = poisoned.pack_w4(codes)
    assert words.shape == (3, 5) and words.dtype == torch.int32
    assert torch.equal(poisoned.unpack_w4(words, 21), codes)
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 7] = 15  # channel 7 sits in the top nibble: the word is negative as int32
    assert poisoned.pack_w4(one).item() == -(1 << 28)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_gemm_symmetric_bias_ragged_k_and_gidx(poisoned, dtype):
    # group_size -1 over a K that is not a multiple of 8; symmetric; bias; split-K
    qw = _qweight(37, 52, 52, sym=True, bias=True, seed=3, dtype=dtype)
    x = torch.randn(5, 52).to(dtype)
    ref = x.double() @ qw.dequantize(torch.float64).T + qw.bias.double()
    for split in (1, 2):
        y = poisoned.w4a16_gemm(_d(x), _d(poisoned.pack_w4(qw.qweight)), _d(qw.scales), _d(qw.qzeros), 52, 37, 52,
                                bias=_d(qw.bias), split_k=split)
        assert _rel(y.cpu(), ref) < TOL[dtype]
    # an explicit, irregular g_idx (groups of unequal size) is read per input channel
    g_idx = torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    qw = _qweight(40, 96, 32, g_idx=g_idx, seed=5)
    x = torch.randn(3, 96).to(dtype)
    y = poisoned.w4a16_gemm(_d(x), _d(poisoned.pack_w4(qw.qweight)), _d(qw.scales.to(dtype)), _d(qw.qzeros), 32, 40,
                            96, g_idx=_d(g_idx))
    assert _rel(y.cpu(), x.double() @ qw.dequantize(torch.float64).T) < TOL[dtype]
    w = poisoned.dequantize_w4(_d(poisoned.pack_w4(qw.qweight)), _d(qw.scales), _d(qw.qzeros), 32, 40, 96,
                               torch.float32, _d(g_idx))
    assert _rel(w.cpu(), qw.dequantize(torch.float64).T) < 1e-7


def _act_order_gidx(k, gs, seed):
    """A GPTQ act-order g_idx: channel i belongs to group perm[i] // gs."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    return (torch.argsort(perm) // gs).to(torch.int32)


@pytest.mark.parametrize("backend_name", usable_backends(DEVICE))
@pytest.mark.parametrize("case", ["plain", "act-order", "irregular-gidx", "bias", "dense-path", "bits3"])
def test_backend_w4a16_linear(backend_name, case):
    dtype = torch.bfloat16 if backend_name != "triton" or DEVICE == "cuda" else torch.float32
    n, k, gs = 48, 128, 32
    g_idx = None
    if case == "act-order":
        g_idx = _act_order_gidx(k, gs, 1)
    elif case == "irregular-gidx":
        g_idx = torch.randint(0, k // gs, (k,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    qw = _qweight(n, k, gs, g_idx=g_idx, bias=case == "bias", seed=7)
    if case == "bits3":
        qw = QuantizedWeight(3, gs, False, qw.qweight % 8, qw.qzeros % 8, qw.scales)
    be = get_backend(backend_name, DEVICE, dequant_min_rows=8) if case == "dense-path" else get_backend(backend_name,
                                                                                                      DEVICE)
    h = be.prepare_w4a16(qw, dtype)
    m = 19 if case == "dense-path" else 3
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    ref = x.double().cpu() @ qw.dequantize(torch.float64).T + (0 if qw.bias is None else qw.bias.double())
    y = be.w4a16_linear(x, h)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y.cpu(), ref) < TOL[dtype] * 2, case


# --- paged attention --------------------------------------------------------------------------------------------
def _fill_cache(cache, layer, n_tokens_total, seed):
    """Write random K/V for every slot of ``layer`` through the cache's own write."""
    spec = cache.spec
    g = torch.Generator().manual_seed(seed)
    n = spec.num_blocks * spec.block_size
    k = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g) * 2
    v = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=g)
    cache.write(layer, k.to(cache.device), v.to(cache.device), torch.arange(n, device=cache.device))
    return k, v


def _ref_attention(q, keys, vals, scale):
    """float64 softmax attention of q [H, D] over keys/vals [ctx, KVH, D] (grouped heads)."""
    h, kvh = q.shape[0], keys.shape[1]
    kk = keys.double().repeat_interleave(h // kvh, 1)  # [ctx, H, D]
    vv = vals.double().repeat_interleave(h // kvh, 1)
    s = torch.einsum("hd,thd->ht", q.double(), kk) * scale
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), vv)


@pytest.mark.e2e
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_paged_attention_matches_float64(poisoned, kv_dtype, head_dim):
    bs, nb, kvh, h = 8, 24, 2, 6
    spec = KVCacheSpec(kv_dtype, nb, bs, 1, kvh, head_dim)
    be = get_backend("triton", DEVICE)
    cache = be.allocate_kv_cache(spec, torch.float32)
    _fill_cache(cache, 0, nb * bs, seed=head_dim)
    # the stored values, dequantized exactly ((code - zero) * float16 scale is exact in float32): the kernel's
    # dequantization and attention are checked here, its quantization bit for bit in the KV write test
    k_all, v_all = (t.double().cpu() for t in cache.read(0, torch.arange(nb * bs, device=cache.device)))
    # three sequences with ragged contexts over scrambled, non-adjacent blocks
    ctxs = [1, 13, 37]
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).tolist()
    tables, used = [], 0
    for c in ctxs:
        nblk = -(-c // bs)
        tables.append(perm[used:used + nblk])
        used += nblk
    t_rows = 7  # rows 0, 3, 5 are queries; the others must stay untouched (NaN)
    rows = [0, 3, 5]
    q = torch.randn(t_rows, h, head_dim, generator=torch.Generator().manual_seed(2))
    out = torch.full_like(q, float("nan"))
    bt = torch.zeros(3, max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    quant = (cache.k_scale[0], cache.k_zero[0], cache.v_scale[0], cache.v_zero[0]) if spec.quantized else (None,) * 4
    outd = out.to(DEVICE)
    for partition in (None, 16):  # one program per (row, KV head); and the context split in partitions of 16
        outd = out.to(DEVICE)
        poisoned.paged_attention(q.to(DEVICE), outd, cache.k[0], cache.v[0], *quant, i32(rows), i32([0, 1, 2]),
                                 i32(ctxs), bt.to(DEVICE), bs, 0.125, spec.bits if spec.quantized else 16,
                                 max_ctx=max(ctxs), partition=partition)
        got = outd.cpu()
        for r, c, table in zip(rows, ctxs, tables):
            slots = (torch.tensor(table).unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:c]
            ref = _ref_attention(q[r], k_all[slots], v_all[slots], 0.125)
            assert _rel(got[r], ref) < 1e-5, (kv_dtype, r, partition)
        assert torch.isnan(got[[1, 2, 4, 6]]).all()


# --- KV write ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_is_bit_identical_to_reference(poisoned, bits, dtype):
    t, kvh, d = 9, 3, 48
    x = (torch.randn(t, kvh, d, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    x[0] = 0  # all zero
    x[1, 0] = 2.5  # constant
    x[2, 1] = 1e6 if dtype != torch.float16 else 6e4  # beyond float16's largest scale
    x[3, 2] = torch.arange(d, dtype=dtype) * 0.5 - 7.5  # exact half-way codes: round half to even
    x[4, 0] = 1e-9 if dtype != torch.float16 else 0  # below float16's smallest normal scale
    n = 20
    w = d if bits == 8 else d // 2
    store = torch.full((kvh, n, w), 0xA5, dtype=torch.uint8)
    scale = torch.full((kvh, n), float("nan"), dtype=torch.float16)
    zero = torch.full((kvh, n), 0xA5, dtype=torch.uint8)
    slots = torch.tensor([17, 2, 9, 0, 4, 11, 19, 6, 13])
    store, scale, zero = _d(store), _d(scale), _d(zero)
    poisoned.kv_write_quantized(_d(x), _d(slots), store, scale, zero, bits)
    store, scale, zero = store.cpu(), scale.cpu(), zero.cpu()
    codes, s, z = quantize_per_token(x, bits)
    if bits == 4:
        codes = pack_int4(codes)
    assert torch.equal(store[:, slots], codes.transpose(0, 1))
    assert torch.equal(scale[:, slots], s.T) and torch.equal(zero[:, slots], z.T)
    rest = torch.tensor(sorted(set(range(n)) - set(slots.tolist())))
    assert (store[:, rest] == 0xA5).all() and torch.isnan(scale[:, rest]).all()


# --- elementwise ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_and_fused_residual(poisoned, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, res = torch.randn(5, hidden, generator=g).to(dtype), torch.randn(5, hidden, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)

    def ref(h):
        hd = h.double()
        return hd / torch.sqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()

    assert _rel(poisoned.rms_norm(_d(x), _d(w), 1e-5).cpu(), ref(x)) < TOL[dtype]
    normed, h = (t.cpu() for t in poisoned.rms_norm(_d(x), _d(w), 1e-5, residual=_d(res)))
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # Triton's interpreter truncates float32 -> bfloat16 (GPUs round to nearest even): one bf16 ulp apart
        assert torch.allclose(h.float(), (x + res).float(), rtol=2.0 ** -7, atol=0)
    else:
        assert torch.equal(h, x + res)  # the residual stream is rounded as the unfused add rounds it
    assert _rel(normed, ref(x + res)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [96, 1500])
def test_silu_and_mul(poisoned, dtype, inter):
    gu = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype) * 3
    gd = gu.double()
    ref = torch.nn.functional.silu(gd[:, :inter]) * gd[:, inter:]
    assert _rel(poisoned.silu_and_mul(_d(gu)).cpu(), ref) < TOL[dtype]


@pytest.mark.parametrize("backend_name", usable_backends(DEVICE))
def test_backend_fused_ops_agree_with_reference(backend_name):
    be = get_backend(backend_name, DEVICE)
    ref = get_backend("torch", "cpu")
    x, r = torch.randn(4, 80), torch.randn(4, 80)
    w = 1 + 0.1 * torch.randn(80)
    got_n, got_h = be.add_rms_norm(x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-6)
    want_n, want_h = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.allclose(got_n.cpu(), want_n, atol=1e-5) and torch.equal(got_h.cpu(), want_h)
    gu = torch.randn(4, 160)
    assert torch.allclose(be.silu_and_mul(gu.to(DEVICE)).cpu(), ref.silu_and_mul(gu), atol=1e-6)


# --- the backend's attention over a step: decode rows, chunked prefill, batch_invariant --------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "int4"])
@pytest.mark.parametrize("batch_invariant,partition", [(False, None), (True, None), (False, 4)])
def test_triton_attention_step_equals_torch(kv_dtype, batch_invariant, partition):
    bs, nb, kvh, h, d = 4, 32, 2, 4, 16
    spec = KVCacheSpec(kv_dtype, nb, bs, 1, kvh, d)
    tri = get_backend("triton", DEVICE, batch_invariant=batch_invariant, attention_partition=partition)
    ref = get_backend("torch", "cpu")
    c_tri, c_ref = tri.allocate_kv_cache(spec, torch.float32), ref.allocate_kv_cache(spec, torch.float32)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(nb * bs, kvh, d, generator=g), torch.randn(nb * bs, kvh, d, generator=g)
    slots_all = torch.arange(nb * bs)
    c_tri.write(0, k.to(DEVICE), v.to(DEVICE), slots_all.to(DEVICE))
    c_ref.write(0, k, v, slots_all)
    # seq 0: full prefill of 6; seq 1: chunk of 3 after 5 cached; seqs 2, 3: decode at contexts 9 and 1
    tables = [[3, 7], [0, 9, 11], [12, 5, 20], [30]]
    qlens, ctxs = [6, 3, 1, 1], [6, 8, 9, 1]
    qs = [0]
    for n in qlens:
        qs.append(qs[-1] + n)
    slot_map = []
    for t, n, c in zip(tables, qlens, ctxs):
        slot_map += [t[p // bs] * bs + p % bs for p in range(c - n, c)]
    q = torch.randn(qs[-1], h, d, generator=g)

    def meta(dev):
        return AttentionMetadata(torch.tensor(slot_map, device=dev), qs, ctxs, tables, bs)

    got = tri.attention(q.to(DEVICE), c_tri, 0, meta(DEVICE), 0.25).cpu()
    want = ref.attention(q, c_ref, 0, meta("cpu"), 0.25)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-5


# --- compiled on a GPU: the tensor-core path and the split heuristics the interpreter never takes -------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 14336), (14336, 4096)])
def test_gpu_w4a16_llama3_shapes_match_float64(dtype, k, n):
    be = get_backend("triton", "cuda")
    qw = _qweight(n, k, 128, seed=k + n)
    h = be.prepare_w4a16(qw, dtype)
    w64 = qw.dequantize(torch.float64).cuda()
    for m in (1, 4, 16, 64, 256):  # split-K, tiles, and the dequantize + cuBLAS path from 128 rows
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(dtype)
        y = be.w4a16_linear(x, h)
        ref = x.double() @ w64.T
        assert _rel(y, ref) < TOL[dtype], (m, k, n)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "int4"])
def test_gpu_paged_attention_long_context_split_matches_torch(kv_dtype):
    """4k-token contexts with few rows: the automatic flash-decoding split against the torch backend on the GPU."""
    bs, kvh, h, d, ctx, b = 64, 8, 32, 128, 4096, 2
    nb = b * ctx // bs + 1
    spec = KVCacheSpec(kv_dtype, nb, bs, 1, kvh, d)
    tri, ref = get_backend("triton", "cuda"), get_backend("torch", "cuda")
    c_tri, c_ref = tri.allocate_kv_cache(spec, torch.float16), ref.allocate_kv_cache(spec, torch.float16)
    g = torch.Generator("cuda").manual_seed(0)
    k = torch.randn(nb * bs, kvh, d, device="cuda", generator=g).half()
    v = torch.randn(nb * bs, kvh, d, device="cuda", generator=g).half()
    slots = torch.arange(nb * bs, device="cuda")
    c_tri.write(0, k, v, slots)
    c_ref.write(0, k, v, slots)
    tables = [list(range(i * ctx // bs + 1, (i + 1) * ctx // bs + 1)) for i in range(b)]
    q = torch.randn(b, h, d, device="cuda", generator=g).half()
    meta = AttentionMetadata(slots[:b], list(range(b + 1)), [ctx, ctx - 37], tables, bs)
    got = tri.attention(q, c_tri, 0, meta, d ** -0.5)
    want = ref.attention(q, c_ref, 0, AttentionMetadata(slots[:b], list(range(b + 1)), [ctx, ctx - 37], tables, bs),
                         d ** -0.5)
    assert meta.scratch["triton_attn"][5] > 0  # the split was taken
    assert (got.float() - want.float()).abs().max().item() < 2e-2
