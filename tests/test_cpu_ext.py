"""The C++ W4A16 CPU kernel (backends/csrc/w4a16_cpu.cpp) against the float64 dequantization, and the fallback.

Fresh random codes, zero points and scales; ragged row counts (M = 1, 3, 17, 64, 300), every group size the layout
takes, bfloat16 and float32 activations, act-order weights through the backend (input permutation), and the
torch backend with the extension turned off.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from backends import QuantizedWeight, TorchBackend, cpu_ext

ext = cpu_ext.load()
needs_ext = pytest.mark.skipif(ext is None, reason="the C++ CPU extension cannot be compiled here")


def _qw(n, k, gs, seed, act_order=False, sym=False):
    g = torch.Generator().manual_seed(seed)
    eff = k if gs == -1 else gs
    groups = k // eff
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // eff)[torch.randperm(k, generator=g)].to(torch.int32)
    zeros = torch.full((groups, n), 8, dtype=torch.uint8) if sym else torch.randint(0, 16, (groups, n), generator=g,
                                                                                       dtype=torch.uint8)
    return QuantizedWeight(bits=4, group_size=gs, sym=sym,
                           qweight=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), qzeros=zeros,
                           scales=(torch.rand(groups, n, generator=g) * 0.02 + 1e-3).to(torch.float16), g_idx=g_idx)


def _ref(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return x.double() @ qw.dequantize(torch.float64).t()


def _close(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    assert torch.isfinite(y).all()
    err = (y.double() - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item() + 1e-6, (err, ref.abs().max().item())


@needs_ext
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("gs", [32, 64, 128, 256, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_float64(m, gs, dtype):
    n, k = 80, 768 if gs != -1 else 576
    qw = _qw(n, k, gs, seed=m * 1000 + (gs % 997))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    h = TorchBackend("cpu", cpu_w4a16=True).prepare_w4a16(qw, dtype)
    assert type(h).__name__ == "CpuW4Handle"
    packed, scales, zoff = h.packed, h.scales, h.zoff
    y = ext.w4a16_mm(x, packed, scales, zoff, qw.effective_group_size)
    assert y.shape == (m, n) and y.dtype == torch.float32
    _close(y, _ref(x, qw), 2e-5)


@needs_ext
def test_rows_do_not_depend_on_the_batch():
    qw = _qw(64, 576, 64, seed=3)
    h = TorchBackend("cpu", cpu_w4a16=True).prepare_w4a16(qw, torch.bfloat16)
    x = torch.randn(33, 576).to(torch.bfloat16)
    full = ext.w4a16_mm(x, h.packed, h.scales, h.zoff, 64)
    for i in (0, 7, 32):
        assert torch.equal(ext.w4a16_mm(x[i:i + 1], h.packed, h.scales, h.zoff, 64)[0], full[i])


@needs_ext
@pytest.mark.parametrize("m", [1, 17, 300])
@pytest.mark.parametrize("act_order", [False, True])
def test_backend_linear_uses_the_kernel(m, act_order):
    qw = _qw(96, 640, 64, seed=m, act_order=act_order)
    qw.bias = torch.randn(96)
    be = TorchBackend("cpu", cpu_w4a16=True)
    for dtype in (torch.bfloat16, torch.float32):
        h = be.prepare_w4a16(qw, dtype)
        assert type(h).__name__ == "CpuW4Handle" and (h.in_perm is not None) == act_order
        x = torch.randn(m, 640).to(dtype)
        y = be.w4a16_linear(x, h)
        assert y.dtype == dtype
        tol = 2e-5 if dtype == torch.float32 else 1e-2  # the output is rounded to bfloat16
        _close(y.float(), _ref(x, qw) + qw.bias.double(), tol)


def test_fallback_without_the_extension(monkeypatch):
    """LITETURBO_CPU_EXT=0: the torch kernels (int4pack) hold the weight and give the same product."""
    monkeypatch.setenv("LITETURBO_CPU_EXT", "0")
    assert cpu_ext.load() is None
    qw = _qw(64, 576, 64, seed=11)
    be = TorchBackend("cpu", cpu_w4a16=True)
    assert be.ext is None
    h = be.prepare_w4a16(qw, torch.float32)
    assert type(h).__name__ == "Int4PackHandle"
    x = torch.randn(5, 576)
    _close(be.w4a16_linear(x, h), _ref(x, qw), 2e-5)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as ce

    def broken(*a, **k):
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(ce, "load", broken)
    monkeypatch.setattr(cpu_ext, "_state", {})
    with pytest.warns(RuntimeWarning, match="cannot compile the C.. CPU kernels .*Ninja is required.*pure-torch"):
        assert cpu_ext.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_ext.load() is None  # remembered: no second warning
    be = TorchBackend("cpu", cpu_w4a16=True)
    assert be.ext is None
    assert type(be.prepare_w4a16(_qw(64, 576, 64, seed=1), torch.bfloat16)).__name__ == "Int4PackHandle"


def test_a_stale_build_lock_is_removed(tmp_path):
    """An interrupted first build leaves torch's lock file; a later start must not wait on it forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_ext._clear_stale_lock(tmp_path)
    assert lock.exists()  # fresh: another process may be compiling right now
    old = time.time() - cpu_ext.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removing a stale build lock"):
        cpu_ext._clear_stale_lock(tmp_path)
    assert not lock.exists()


@pytest.mark.parametrize("shape", [(64, 576, 32), (48, 96, 32)])
def test_layouts_the_kernel_cannot_take_use_the_torch_kernels(shape):
    """in_features not a multiple of 64 (96) stays on int4pack; 4-bit with K % 64 == 0 goes to the kernel."""
    n, k, gs = shape
    h = TorchBackend("cpu", cpu_w4a16=True).prepare_w4a16(_qw(n, k, gs, seed=2), torch.bfloat16)
    want = "CpuW4Handle" if (k % 64 == 0 and ext is not None) else "Int4PackHandle"
    assert type(h).__name__ == want


# --- fused per-token ops and decode attention ---------------------------------------------------------------------
def _torch_ref_backend():
    return TorchBackend("cpu", cpu_kernels=False)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's resolution at each element's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp(min=torch.finfo(a.dtype).tiny)
    return ((a.float() - b.float()).abs() / (scale * eps)).max().item()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_fused_elementwise_match_the_torch_ops(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    ref, fast = _torch_ref_backend(), TorchBackend("cpu")
    assert fast.ext is not None
    h = 576
    x, res = torch.randn(rows, h, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    tol = 0 if dtype == torch.float32 else 2.01  # 16-bit: a one-ulp difference before the last product, rounded again
    a, b = fast.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)
    assert a.dtype == dtype and a.shape == b.shape
    assert _ulps(a, b) <= max(tol, 8 if dtype == torch.float32 else 0)
    (na, ha), (nb, hb) = fast.add_rms_norm(x, res, w, 1e-5), ref.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(ha, hb) and _ulps(na, nb) <= max(tol, 8 if dtype == torch.float32 else 0)
    gu = torch.randn(rows, 2 * 1536, generator=g).to(dtype)
    assert _ulps(fast.silu_and_mul(gu), ref.silu_and_mul(gu)) <= max(tol, 4 if dtype == torch.float32 else 0)
    # rotary on views into a fused QKV output (row stride = the QKV width)
    nh, nkv, d = 9, 3, 64
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, generator=g).to(dtype)
    q, k = qkv[:, :nh * d].view(rows, nh, d), qkv[:, nh * d:(nh + nkv) * d].view(rows, nkv, d)
    ang = torch.rand(rows, 1, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    (qa, ka), (qb, kb) = fast.rotary(q, k, cos, sin), ref.rotary(q, k, cos, sin)
    assert torch.equal(qa, qb) and torch.equal(ka, kb)  # one product each, rounded as torch rounds


def _paged_ref(q, kc, vc, tables, bs, row_seq, row_len, scale):
    """float64 attention of each row over its sequence's first ``row_len`` tokens, read through the block table."""
    out = torch.empty(q.shape, dtype=torch.float64)
    kvh = kc.shape[0]
    g = q.shape[1] // kvh
    for r in range(q.shape[0]):
        t = torch.arange(int(row_len[r]))
        sl = tables[int(row_seq[r])][t // bs].long() * bs + t % bs
        k, v = kc[:, sl].double(), vc[:, sl].double()  # [KVH, n, D]
        qb = q[r].double().view(kvh, g, -1)
        p = torch.softmax(qb @ k.transpose(1, 2) * scale, -1)
        out[r] = (p @ v).reshape(q.shape[1], -1)
    return out


def _paged_case(seed, dtype, heads, kv_heads, d, seqs, bs=16, num_blocks=96):
    """Random cache, shuffled block tables and query rows for ``seqs`` = [(query rows, context length)]: the rows
    of a sequence are its last tokens (causal), as a step lays out prefill, chunked-prefill and decode rows."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(kv_heads, num_blocks * bs, d, generator=g).to(dtype)
    vc = torch.randn(kv_heads, num_blocks * bs, d, generator=g).to(dtype)
    width = max((ctx + bs - 1) // bs for _, ctx in seqs)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([perm[i * width:(i + 1) * width] for i in range(len(seqs))]).int()
    row_seq = torch.tensor([i for i, (t, _) in enumerate(seqs) for _ in range(t)], dtype=torch.int32)
    row_len = torch.tensor([p + 1 for t, ctx in seqs for p in range(ctx - t, ctx)], dtype=torch.int32)
    q = torch.randn(len(row_seq), heads, d, generator=g).to(dtype)
    return q, kc, vc, tables, bs, row_seq, row_len


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (6, 2, 48), (8, 1, 128), (2, 1, 20)])
@pytest.mark.parametrize("seqs", [[(1, 1)], [(1, 5), (1, 64), (1, 130)], [(17, 17)], [(3, 40), (1, 300), (64, 64)]])
def test_paged_attention_matches_float64(dtype, heads, kv_heads, d, seqs):
    """Decode rows of ragged contexts, a causal prefill, a chunk after cached context, mixed in one call; head dims
    on the AVX-512 path (multiples of 16) and off it (20); the output is fully written (poisoned beforehand)."""
    q, kc, vc, tables, bs, row_seq, row_len = _paged_case(len(seqs) * d + heads, dtype, heads, kv_heads, d, seqs)
    ext = TorchBackend("cpu").ext
    out = ext.paged_attention(q, kc, vc, tables, bs, row_seq, row_len, d ** -0.5)
    ref = _paged_ref(q, kc, vc, tables, bs, row_seq, row_len, d ** -0.5)
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


@needs_ext
def test_paged_attention_rows_do_not_depend_on_the_others():
    """A row's result is the same alone and among other rows (no cross-row reduction; threads split rows only)."""
    q, kc, vc, tables, bs, row_seq, row_len = _paged_case(7, torch.bfloat16, 9, 3, 64, [(5, 70), (1, 33), (1, 200)])
    ext = TorchBackend("cpu").ext
    full = ext.paged_attention(q, kc, vc, tables, bs, row_seq, row_len, 0.125)
    for r in (0, 4, 5, 6):
        one = ext.paged_attention(q[r:r + 1], kc, vc, tables, bs, row_seq[r:r + 1], row_len[r:r + 1], 0.125)
        assert torch.equal(one[0], full[r])


@needs_ext
def test_paged_attention_refuses_bad_tables():
    ext = TorchBackend("cpu").ext
    kc = torch.zeros(1, 32, 4)
    q = torch.zeros(1, 1, 4)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block 5 out of range"):
        ext.paged_attention(q, kc, kc, torch.tensor([[5]]), 16, torch.tensor([0]), one, 1.0)
    with pytest.raises(RuntimeError, match="context length 17 out of range"):
        ext.paged_attention(q, kc, kc, torch.tensor([[0]]), 16, torch.tensor([0]), torch.tensor([17]), 1.0)
    with pytest.raises(RuntimeError, match="sequence index 1 out of range"):
        ext.paged_attention(q, kc, kc, torch.tensor([[0]]), 16, torch.tensor([1]), one, 1.0)
    with pytest.raises(RuntimeError, match="cache dtype"):
        ext.paged_attention(q.bfloat16(), kc, kc, torch.tensor([[0]]), 16, torch.tensor([0]), one, 1.0)


@needs_ext
@pytest.mark.slow
def test_engine_greedy_unchanged_with_the_cpu_kernels(smollm2_path, smollm2_rtn_g64):
    """float32: the same greedy tokens with and without the extension. bf16 W4A16: the C++ attention keeps its
    softmax and sums in float32 where torch's SDPA rounds to bf16 in between, so long greedy runs part after a few
    tokens; the stated tolerance is on the numbers: the first greedy token of every prompt is the same and the mean
    next-token NLL of 384 tokens of WikiText-2 valid agrees within 1 %."""
    import calib_data
    from turbo import Engine, EngineConfig
    from turbo.perplexity import window_nll

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot",
               "List three colors:"]
    text = "".join(calib_data.load_rows("wikitext2", "valid"))[:4000]
    for path, dtype in ((smollm2_path, "float32"), (smollm2_rtn_g64, "bfloat16")):
        outs, nll = {}, {}
        for flag in ("1", "0"):
            import os

            old = os.environ.get("LITETURBO_CPU_EXT")
            os.environ["LITETURBO_CPU_EXT"] = flag
            try:
                e = Engine(path, EngineConfig(dtype=dtype, max_kv_tokens=2048))
            finally:
                if old is None:
                    os.environ.pop("LITETURBO_CPU_EXT")
                else:
                    os.environ["LITETURBO_CPU_EXT"] = old
            assert (e.backend.ext is not None) == (flag == "1")
            outs[flag] = [o.token_ids for o in e.generate(prompts, max_new_tokens=24, ignore_eos=True)]
            nll[flag] = window_nll(e, e.encode(text)[:384], chunk=128)
        if dtype == "float32":
            assert outs["1"] == outs["0"]
            assert nll["1"] == pytest.approx(nll["0"], rel=1e-5)
        else:
            assert [o[0] for o in outs["1"]] == [o[0] for o in outs["0"]]
            assert nll["1"] == pytest.approx(nll["0"], rel=0.01), nll
