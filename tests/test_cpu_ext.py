"""liteturbo's C++ CPU kernels (backends/csrc/) against float64 references and the torch ops, and the fallback.

The W4A16 kernels over one packed weight (tiled GEMM for many rows, GEMV reading the codes in place for a few): fresh
random codes, zero points and scales; ragged row counts (M = 1, 3, 17, 64, 300; 1-5 for the GEMV), every group size
the layout takes, act-order weights through the backend (input permutation), bias; outputs compared with the float64
product of the weights as each kernel forms them (the GEMM rounds them once to bfloat16, the GEMV never). The fused norms, rotary,
SiLU-and-mul against the torch ops; paged attention against float64; the torch backend with the extension turned
off or failing to build; the engine's greedy outputs with the kernels on and off.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from backends import QuantizedWeight, TorchBackend, cpu_ext
from backends.torch_backend import Int4PackHandle, W4TilesHandle

ext = cpu_ext.load()
_HOME_BUILD = cpu_ext.build_dir()  # where this process's extension was built (LITETURBO_HOME at import)
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


def _ref_bf16_weights(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float64 product with the weights as the tiled kernel forms them: (q - z) * s (s in bf16), rounded to bf16."""
    w = qw.dequantize(torch.float64) if qw.scales.dtype == torch.bfloat16 else QuantizedWeight(
        bits=qw.bits, group_size=qw.group_size, sym=qw.sym, qweight=qw.qweight, qzeros=qw.qzeros,
        scales=qw.scales.to(torch.bfloat16), g_idx=qw.g_idx).dequantize(torch.float64)
    return x.double() @ w.to(torch.bfloat16).double().t()


needs_tiles = pytest.mark.skipif(ext is None or not ext.has_w4_tiles(), reason="needs the extension on AVX-512 BF16")


@needs_tiles
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("gs", [32, 64, 128, 256, -1])
def test_tiled_kernel_matches_float64(m, gs):
    n, k = 96, 768 if gs != -1 else 256  # per-channel (-1): int4pack, which holds the weight too, takes K = 256
    qw = _qw(n, k, gs, seed=m * 1000 + (gs % 997))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    h = TorchBackend("cpu").prepare_w4a16(qw, torch.bfloat16)
    assert isinstance(h, W4TilesHandle)  # one copy of the codes, not two
    y = ext.w4a16_tiles_mm(x, *h.tiles, qw.effective_group_size)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close(y, _ref_bf16_weights(x, qw), 8e-3)  # float32 sums; the output rounded to bf16


@needs_tiles
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("gs", [32, 64, 128, 256, -1])
def test_gemv_matches_float64(m, gs):
    """The few-rows kernel never rounds the weight: float64 product of the exact dequantized weight (bf16 scales),
    to the bf16 rounding of the output; also a wide K (14,336: Llama-3.1-8B's down projection, 112 groups)."""
    n, k = 96, 768 if gs != -1 else 256
    qw = _qw(n, k, gs, seed=7 * m + (gs % 991))
    qw.scales = qw.scales.to(torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    h = TorchBackend("cpu").prepare_w4a16(qw, torch.bfloat16)
    y = ext.w4a16_tiles_gemv(x, *h.tiles, qw.effective_group_size)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close(y, _ref(x, qw), 5e-3)
    if m == 1 and gs == 128:
        qw = _qw(64, 14336, 128, seed=5)
        qw.scales = qw.scales.to(torch.bfloat16)
        x = torch.randn(2, 14336).bfloat16()
        h = TorchBackend("cpu").prepare_w4a16(qw, torch.bfloat16)
        _close(ext.w4a16_tiles_gemv(x, *h.tiles, 128), _ref(x, qw), 5e-3)


@needs_tiles
def test_gemv_refuses_bad_inputs():
    h = TorchBackend("cpu").prepare_w4a16(_qw(64, 576, 64, seed=1), torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.w4a16_tiles_gemv(torch.randn(1, 576), *h.tiles, 64)
    with pytest.raises(RuntimeError, match="x has 512 input channels, the weight 576"):
        ext.w4a16_tiles_gemv(torch.randn(1, 512).bfloat16(), *h.tiles, 64)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext.w4a16_tiles_gemv(torch.randn(1, 576).bfloat16(), *h.tiles, 36)


@needs_tiles
def test_tiled_rows_do_not_depend_on_the_batch():
    qw = _qw(64, 576, 64, seed=3)
    h = TorchBackend("cpu").prepare_w4a16(qw, torch.bfloat16)
    x = torch.randn(33, 576).to(torch.bfloat16)
    full = ext.w4a16_tiles_mm(x, *h.tiles, 64)
    for i in (0, 7, 8, 32):
        assert torch.equal(ext.w4a16_tiles_mm(x[i:i + 1], *h.tiles, 64)[0], full[i])


@needs_tiles
def test_tiled_kernel_refuses_bad_inputs():
    h = TorchBackend("cpu").prepare_w4a16(_qw(64, 576, 64, seed=1), torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.w4a16_tiles_mm(torch.randn(2, 576), *h.tiles, 64)
    with pytest.raises(RuntimeError, match="x has 512 input channels, the weight 576"):
        ext.w4a16_tiles_mm(torch.randn(2, 512).bfloat16(), *h.tiles, 64)
    with pytest.raises(RuntimeError, match="zeros must be"):
        ext.w4a16_tiles_mm(torch.randn(2, 576).bfloat16(), h.tiles[0], h.tiles[1][:1], h.tiles[2], 64)


@needs_tiles
@pytest.mark.parametrize("m", [1, 5, 6, 17, 300])
@pytest.mark.parametrize("act_order", [False, True])
def test_backend_linear_picks_the_kernel_by_rows(m, act_order):
    """From ``tiles_min_rows`` (6) rows the tiled kernel, below it the GEMV on the same copy; act-order through the
    input permutation, bias added; float32 engines keep int4pack and the nibble copy (the kernels are bf16 only);
    ``batch_invariant`` runs the tiled kernel for every row count."""
    qw = _qw(96, 640, 64, seed=m, act_order=act_order)
    qw.bias = torch.randn(96)
    be = TorchBackend("cpu")
    h = be.prepare_w4a16(qw, torch.bfloat16)
    assert isinstance(h, W4TilesHandle) and (h.in_perm is not None) == act_order
    x = torch.randn(m, 640).to(torch.bfloat16)
    for b, want in ((be, "mm" if m >= be.tiles_min_rows else "gemv"), (TorchBackend("cpu", batch_invariant=True), "mm")):
        calls = []
        real = b.ext
        b.ext = type("Spy", (), {
            "w4a16_tiles_mm": lambda self, *a: calls.append("mm") or real.w4a16_tiles_mm(*a),
            "w4a16_tiles_gemv": lambda self, *a: calls.append("gemv") or real.w4a16_tiles_gemv(*a)})()
        y = b.w4a16_linear(x, h)
        b.ext = real
        assert calls == [want] and y.dtype == torch.bfloat16
        _close(y.float(), _ref(x, qw) + qw.bias.double(), 1e-2)
    assert isinstance(be.prepare_w4a16(qw, torch.float32), Int4PackHandle)


def test_fallback_without_the_extension(monkeypatch):
    """LITETURBO_CPU_EXT=0: the torch kernels (int4pack) hold the weight and give the same product."""
    monkeypatch.setenv("LITETURBO_CPU_EXT", "0")
    assert cpu_ext.load() is None
    qw = _qw(64, 576, 64, seed=11)
    be = TorchBackend("cpu")
    assert be.ext is None
    h = be.prepare_w4a16(qw, torch.bfloat16)
    assert isinstance(h, Int4PackHandle) and h.nibbles is not None
    for m in (5, 300):  # int4pack, then dequantize + matmul
        x = torch.randn(m, 576).bfloat16()
        _close(be.w4a16_linear(x, h).float(), _ref(x, qw), 1e-2)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as ce

    def broken(*a, **k):
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(ce, "load", broken)
    monkeypatch.setattr(cpu_ext, "_state", {})
    with pytest.warns(RuntimeWarning, match="cannot build or load the C.. CPU kernels .*Ninja is required.*pure-torch"):
        assert cpu_ext.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_ext.load() is None  # remembered: no second warning
    be = TorchBackend("cpu")
    assert be.ext is None
    assert isinstance(be.prepare_w4a16(_qw(64, 576, 64, seed=1), torch.bfloat16), Int4PackHandle)


def test_a_stale_build_lock_is_removed(tmp_path, monkeypatch, capsys):
    """An interrupted first build leaves torch's lock file: a later start waits on a young lock (saying so) and
    removes it once it is STALE_LOCK_SECONDS old, instead of waiting forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    monkeypatch.setattr(cpu_ext, "STALE_LOCK_SECONDS", 0.3)
    with pytest.warns(RuntimeWarning, match="removing a stale build lock"):
        cpu_ext._clear_stale_lock(tmp_path, poll_seconds=0.05)
    assert not lock.exists()
    assert "waiting for another process's build" in capsys.readouterr().err
    lock.write_text("")  # released by its owner while we wait: no warning, nothing removed by us
    old = time.time() - 0.2
    os.utime(lock, (old, old))
    import threading

    threading.Timer(0.05, lambda: lock.unlink()).start()
    cpu_ext._clear_stale_lock(tmp_path, poll_seconds=0.01)
    assert not lock.exists()


@needs_ext
def test_a_damaged_cached_build_is_rebuilt(tmp_path):
    """A truncated .so in the cache (a fresh process, as a user's next start) is deleted and relinked, saying so,
    instead of a fallback on every start; status() reports what an engine would get without building."""
    import os
    import shutil
    import subprocess
    import sys

    home = tmp_path / "home"
    d = home / "torch_ext" / _HOME_BUILD.name
    shutil.copytree(_HOME_BUILD, d)
    so = d / f"{cpu_ext._module_name(d)}.so"
    so.write_bytes(b"")
    code = ("from backends import cpu_ext; print(cpu_ext.status()); m = cpu_ext.load(); "
            "print(m is not None, cpu_ext.status())")
    env = dict(os.environ, LITETURBO_HOME=str(home), LITETURBO_CPU_EXT="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["built", "True", "loaded"], r.stdout
    assert "are damaged (0 bytes" in r.stderr and "rebuilding" in r.stderr and so.read_bytes()[:4] == b"\x7fELF"
    env["LITETURBO_CPU_EXT"] = "0"
    r = subprocess.run([sys.executable, "-c", "from backends import cpu_ext; print(cpu_ext.status())"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.strip() == "off"


@pytest.mark.parametrize("shape", [(64, 576, 32), (48, 96, 32)])
def test_layouts_the_kernel_cannot_take_keep_the_nibbles(shape):
    """out_features not a multiple of 32 (48) keeps int4pack and the nibble copy; 64 x 576 takes the tiles; the
    planner's bytes (``linear_nbytes``) are those of the layout the backend picks."""
    from backends.types import LinearSpec

    n, k, gs = shape
    h = TorchBackend("cpu").prepare_w4a16(_qw(n, k, gs, seed=2), torch.bfloat16)
    tiles = n % 32 == 0 and ext is not None and ext.has_w4_tiles()
    assert isinstance(h, W4TilesHandle if tiles else Int4PackHandle)
    held = (sum(t.nbytes for t in h.tiles) if tiles else
            sum(t.nbytes for t in (h.packed, h.scale_zeros, h.nibbles, h.scales, h.scaled_zeros)))
    spec = LinearSpec(out_features=n, in_features=k, bits=4, group_size=gs)
    assert TorchBackend.linear_nbytes(spec, torch.bfloat16, "cpu") == held


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


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_rotary_kv_write_equals_rotary_then_write(dtype, rows):
    """The fused call gives the rotary op's q and stores exactly what rotary + PagedKVCache.write store, into the
    given slots only (the rest of the cache keeps its poison)."""
    from backends import KVCacheSpec
    from backends.kv_cache import PagedKVCache

    g = torch.Generator().manual_seed(rows)
    nh, nkv, d = 9, 3, 64
    qkv = torch.randn(rows, (nh + 2 * nkv) * d, generator=g).to(dtype)
    q = qkv[:, :nh * d].view(rows, nh, d)
    k = qkv[:, nh * d:(nh + nkv) * d].view(rows, nkv, d)
    v = qkv[:, (nh + nkv) * d:].view(rows, nkv, d)
    ang = torch.rand(rows, 1, d // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(32 * 16, generator=g)[:rows]
    caches = []
    for be in (TorchBackend("cpu"), _torch_ref_backend()):
        cache = PagedKVCache(KVCacheSpec("float32" if dtype == torch.float32 else str(dtype).split(".")[1], 32, 16,
                                         2, nkv, d), "cpu", dtype)
        for t in (cache.k[1], cache.v[1]):
            t.fill_(float("nan"))
        caches.append((be.rotary_write(q, k, v, cos, sin, cache, 1, slots), cache))
    (qa, ca), (qb, cb) = caches
    assert torch.equal(qa, qb)
    for a, b in ((ca.k[1], cb.k[1]), (ca.v[1], cb.v[1])):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        assert torch.isfinite(a[:, slots]).all() and torch.isnan(a).sum() == a.numel() - a[:, slots].numel()


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
    """A decode row's result is the same alone and among other rows (threads split rows, no cross-row sums); prefill
    rows computed in a block (shared key tiles, probabilities normalized before P x V) agree with the same row alone
    within bf16 rounding."""
    q, kc, vc, tables, bs, row_seq, row_len = _paged_case(7, torch.bfloat16, 9, 3, 64, [(5, 70), (1, 33), (1, 200)])
    ext = TorchBackend("cpu").ext
    full = ext.paged_attention(q, kc, vc, tables, bs, row_seq, row_len, 0.125)
    for r in (0, 4, 5, 6):
        one = ext.paged_attention(q[r:r + 1], kc, vc, tables, bs, row_seq[r:r + 1], row_len[r:r + 1], 0.125)
        if r >= 5:
            assert torch.equal(one[0], full[r])
        else:
            assert (one[0].float() - full[r].float()).abs().max().item() <= 1e-2 * full[r].float().abs().max().item()


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


@pytest.mark.e2e
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


@pytest.mark.slow
def test_tied_int8_lm_head_uses_the_embedding_table_for_many_rows(smollm2_rtn_g64, monkeypatch):
    """SmolLM2 ties lm_head to the embeddings: the int8 head (few rows) and the table itself (16 rows and more, no
    copy) both match the float64 product; the step picks by row count, never in batch_invariant mode."""
    from turbo import Engine, EngineConfig

    e = Engine(smollm2_rtn_g64, EngineConfig(dtype="bfloat16", max_kv_tokens=1024))
    m = e.model
    assert m.lm_head.quantized == "w8a16" and m.lm_head_dense.handle[0].data_ptr() == m.embed.data_ptr()
    h = torch.randn(20, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = h.double() @ m.embed.double().T
    for head, tol in ((m.lm_head_dense, 0.01), (m.lm_head, 0.03)):
        assert (head(h).double() - ref).abs().max().item() <= tol * ref.abs().max().item()
    calls = []
    dense = m.lm_head_dense
    monkeypatch.setattr(m, "lm_head_dense", lambda x: calls.append(x.shape[0]) or dense(x))
    assert e.backend.dense_lm_head_min_rows == 16
    e.generate([list(range(100, 140))] * 16, max_new_tokens=2, ignore_eos=True)
    assert calls and all(n >= 16 for n in calls)  # the step of 16 sequences; a lone prompt's row stays int8
    assert TorchBackend("cpu", batch_invariant=True).dense_lm_head_min_rows > 1 << 40


def test_env_and_op_coverage_follow_the_extension_switch(monkeypatch):
    """`liteturbo env` names the C++ kernels only when an engine would use them (not with LITETURBO_CPU_EXT=0, not
    after a failed build)."""
    from backends.platform import current_platform
    from turbo.cli import env_report

    plat = current_platform("cpu")
    monkeypatch.setenv("LITETURBO_CPU_EXT", "0")
    assert env_report("cpu")["software"]["cpu_kernels"] == "off"
    cov = TorchBackend.op_coverage(plat)
    assert cov["rms_norm"] == "torch reference" and "C++" not in cov["w4a16_linear"] + cov["attention"]
    monkeypatch.setenv("LITETURBO_CPU_EXT", "1")
    monkeypatch.setattr(cpu_ext, "_state", {"module": None})  # a failed build in this process
    assert cpu_ext.status() == "failed" and TorchBackend.op_coverage(plat)["rotary"] == "torch reference"
    if ext is not None:
        monkeypatch.setattr(cpu_ext, "_state", {"module": ext})
        assert cpu_ext.status() == "loaded" and "C++" in TorchBackend.op_coverage(plat)["attention"]


def test_float32_w4a16_dequantizes_instead_of_int4pack(monkeypatch):
    """float32 4-bit linears skip torch's int4pack (35x slower in float32 than in bf16 here) at every row count,
    except in batch_invariant mode; the product still matches float64."""
    import backends.torch_backend as tb

    qw = _qw(64, 576, 64, seed=5)
    calls = []
    real = tb._int4pack_mm
    monkeypatch.setattr(tb, "_int4pack_mm", lambda *a: calls.append(1) or real(*a))
    for invariant in (False, True):
        be = TorchBackend("cpu", batch_invariant=invariant)
        h = be.prepare_w4a16(qw, torch.float32)
        x = torch.randn(1, 576)
        _close(be.w4a16_linear(x, h), _ref(x, qw), 2e-5)
        assert bool(calls) == invariant


@needs_tiles
def test_tiles_dequantize_back_to_the_weight():
    """dequantize_tiles inverts pack_w4_tiles: the exact (q - z) * s of the checkpoint (bf16 scales)."""
    from backends.torch_backend import dequantize_tiles

    qw = _qw(64, 256, 32, seed=9)
    qw.scales = qw.scales.to(torch.bfloat16)
    h = TorchBackend("cpu").prepare_w4a16(qw, torch.bfloat16)
    assert torch.equal(dequantize_tiles(h, torch.float64), qw.dequantize(torch.float64))


# --- load-time repacking (csrc/w4_pack_cpu.cpp) ------------------------------------------------------------------
def _torch_pack_codes(c: torch.Tensor) -> torch.Tensor:
    """The tiled layout's packed codes with torch ops (the definition, written out independently of cpu_ext)."""
    n, k = c.shape
    out = torch.empty(n // 32, k // 4, 64, dtype=torch.uint8)
    for nb in range(n // 32):
        for i in range(32):  # sub-block * 16 + channel
            row = c[nb * 32 + i].view(k // 4, 4)
            out[nb, :, 2 * i] = row[:, 0] | (row[:, 2] << 4)
            out[nb, :, 2 * i + 1] = row[:, 1] | (row[:, 3] << 4)
    return out


@needs_ext
@pytest.mark.parametrize("shape", [(32, 4), (64, 12), (96, 260)])
def test_pack_w4_tiles_codes_matches_the_definition(shape):
    c = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(ext.pack_w4_tiles_codes(c), _torch_pack_codes(c))
    assert torch.equal(ext.pack_w4_tiles_codes(c.t().contiguous().t()), _torch_pack_codes(c))  # strided input
    with pytest.raises(RuntimeError, match="N % 32 == 0 and K % 4 == 0"):
        ext.pack_w4_tiles_codes(c[:, :shape[1] - 1])
    with pytest.raises(RuntimeError, match="uint8"):
        ext.pack_w4_tiles_codes(c.to(torch.int32))


@needs_ext
@pytest.mark.parametrize("rc", [(1, 1), (5, 3), (64, 16), (130, 37)])
def test_unpack_nibbles_t_matches_the_awq_reference(rc):
    """AWQ GEMM qweight [K, N/8] -> codes [N, K] in one pass equals the torch path (unpack, reorder, transpose),
    words with the sign bit set included."""
    from lite.formats.awq import AWQ_REVERSE_ORDER, unpack_awq_int32

    p = torch.randint(-2**31, 2**31 - 1, rc, dtype=torch.int32, generator=torch.Generator().manual_seed(rc[0]))
    got = cpu_ext.unpack_nibbles_t(p, AWQ_REVERSE_ORDER)
    assert torch.equal(got, unpack_awq_int32(p, 4).t().contiguous())
    nib = [(int(p[0, 0]) >> (4 * j)) & 15 for j in range(8)]  # word (0, 0) by hand: column j from nibble order[j]
    assert [int(got[j, 0]) for j in range(8)] == [nib[o] for o in AWQ_REVERSE_ORDER]
    with pytest.raises(RuntimeError, match="outside 0..7"):
        ext.unpack_nibbles_t(p, torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))


@needs_ext
def test_pack_w4_tiles_is_the_same_with_and_without_the_extension(monkeypatch):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 256), dtype=torch.uint8, generator=g)
    zeros = torch.randint(0, 16, (64, 2), dtype=torch.uint8, generator=g)
    scales = torch.rand(64, 2, generator=g)
    fast = cpu_ext.pack_w4_tiles(codes, zeros, scales)
    monkeypatch.setattr(cpu_ext, "ready", lambda: None)
    slow = cpu_ext.pack_w4_tiles(codes, zeros, scales)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert cpu_ext.unpack_nibbles_t(torch.zeros(2, 2, dtype=torch.int32), range(8)) is None  # not ready: torch path


# --- int8 GEMV (csrc/w8a16_gemv_cpu.cpp) ------------------------------------------------------------------------
needs_w8 = pytest.mark.skipif(ext is None or not ext.has_w8_gemv(), reason="the C++ int8 GEMV needs AVX-512 here")


@needs_w8
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(7, 16), (130, 64), (1000, 576)])
def test_w8a16_gemv_matches_float64(m, n, k):
    """Against float64 of the bf16 inputs: within the float32 sum's error and one bf16 rounding of the output."""
    g = torch.Generator().manual_seed(n + m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    s = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    y = ext.w8a16_gemv(x, q, s)
    ref = (x.double() @ q.double().T) * s.double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -8 + 1e-4 * ref.abs().max()).all(), float(err.max())
    # rows are independent of how many share the call
    assert torch.equal(ext.w8a16_gemv(x[:1], q, s)[0], y[0])


@needs_w8
@pytest.mark.parametrize("code", [127, -128])
def test_w8a16_gemv_long_rows_of_extreme_codes(code):
    """K = 8,320 (past the int32 flush of the tiled VNNI kernel) with every code and every input at its extreme: the
    int32 sums would overflow without the flush; one input 1e-3 of the largest still counts."""
    k = 8320
    x = torch.full((2, k), 3.0).to(torch.bfloat16)
    x[1, ::2] = -3.0
    x[0, 5] = 3e-3
    q = torch.full((4, k), code, dtype=torch.int8)
    s = torch.tensor([1e-3, 2e-3, 5e-4, 1.0]).to(torch.bfloat16)
    ref = (x.double() @ q.double().T) * s.double()
    ys = [ext.w8a16_gemv(x, q, s)]
    if ext.has_w8_tiles():  # the VNNI kernel's int32 sums are flushed every 4,096 inputs
        ys.append(ext.w8a16_tiles_gemv(x, q.view(1, 4, k // 32, 32).transpose(1, 2).contiguous(), s))
    for y in ys:
        assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all(), (y, ref)


@needs_w8
def test_w8a16_gemv_refuses_bad_inputs():
    x = torch.randn(1, 32).to(torch.bfloat16)
    q = torch.zeros(8, 32, dtype=torch.int8)
    s = torch.ones(8)
    for bad, msg in (((x.float(), q, s), "bfloat16"), ((torch.randn(5, 32).bfloat16(), q, s), "1-4 rows"),
                     ((x, q.to(torch.int32), s), "int8"), ((x[:, :16], q, s), "columns"),
                     ((torch.randn(1, 24).bfloat16(), torch.zeros(8, 24, dtype=torch.int8), s), "multiple of 16"),
                     ((x, q, torch.ones(7)), "one value per output channel")):
        with pytest.raises(RuntimeError, match=msg):
            ext.w8a16_gemv(*bad)


@needs_w8
def test_backend_int8_lm_head_kernels(monkeypatch):
    """TorchBackend's int8 lm_head: on VNNI CPUs a bf16 head whose rows are a multiple of 4 (and columns of 32) is
    held in the tiled layout (the same codes and scales as the row-major one) and every row count runs the tiled
    GEMV; other shapes keep the row-major codes: 1-4 rows on the float GEMV, more on int8pack; batch-invariant mode
    is row-major and int8pack throughout. All agree within a bf16 rounding."""
    from backends.torch_backend import W8TilesHandle

    be, inv = TorchBackend("cpu"), TorchBackend("cpu", batch_invariant=True)
    g = torch.Generator().manual_seed(5)
    calls = []
    real = be.ext
    monkeypatch.setattr(be, "ext", type("Spy", (), {
        "w8a16_gemv": lambda self, *a: calls.append("gemv") or real.w8a16_gemv(*a),
        "w8a16_tiles_gemv": lambda self, *a: calls.append("tiles") or real.w8a16_tiles_gemv(*a),
        "__getattr__": lambda self, name: getattr(real, name)})())
    for out, tiled in ((200, bool(real.has_w8_tiles())), (202, False)):
        w = torch.randn(out, 64, generator=g)
        h, h_inv = be.prepare_w8a16(w, torch.bfloat16), inv.prepare_w8a16(w, torch.bfloat16)
        assert isinstance(h, W8TilesHandle) == tiled and isinstance(h_inv, tuple)
        if tiled:
            assert torch.equal(h.rows(0, out), h_inv[0]) and torch.equal(h.scales, h_inv[1])
            assert torch.equal(h.rows(8, 16), h_inv[0][8:16])
        calls.clear()
        for m in (1, 4, 5, 12):
            x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
            y, y_inv = be.w8a16_linear(x, h), inv.w8a16_linear(x, h_inv)
            torch.testing.assert_close(y.float(), y_inv.float(), rtol=2 ** -7, atol=1e-3)
        assert calls == (["tiles"] * 4 if tiled else ["gemv", "gemv"]), (out, calls)


needs_w8_tiles = pytest.mark.skipif(ext is None or not ext.has_w8_tiles(),
                                    reason="the tiled int8 GEMV needs AVX-512 VNNI here")


@needs_w8_tiles
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("n, k", [(4, 32), (200, 576), (64, 8224)])
def test_w8a16_tiles_gemv_matches_float64(m, n, k):
    """Against float64 of the bf16 inputs: the int16 fixed point of x and one bf16 rounding of the output; a row's
    result is bitwise the same alone or with others."""
    g = torch.Generator().manual_seed(n + m + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x[0, :7] = torch.tensor([0.0, 1e-6, -3e-4, 80.0, -2.0, 0.5, 1e-2])  # a wide range within one row
    q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    s = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    tiles = q.view(n // 4, 4, k // 32, 32).transpose(1, 2).contiguous()
    y = ext.w8a16_tiles_gemv(x, tiles, s)
    ref = (x.double() @ q.double().T) * s.double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # the fixed point's error in a row: at most sum_k |q| s x (max |x| / 65534)
    fp = (q.double().abs().sum(1) * s.double())[None, :] * (x.double().abs().amax(1, keepdim=True) / 65534)
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -8 + fp).all(), float((err - ref.abs() * 2 ** -8 - fp).max())
    for r in range(m):
        assert torch.equal(ext.w8a16_tiles_gemv(x[r:r + 1], tiles, s)[0], y[r])


@needs_w8_tiles
def test_w8a16_tiles_gemv_refuses_bad_inputs():
    x = torch.randn(1, 64).to(torch.bfloat16)
    q = torch.zeros(2, 2, 4, 32, dtype=torch.int8)
    s = torch.ones(8)
    for bad, msg in (((x.float(), q, s), "bfloat16"), ((x, q.view(8, 64), s), r"\[N/4, K/32, 4, 32\]"),
                     ((x, q.to(torch.int16), s), "int8"), ((x[:, :32], q, s), "columns"),
                     ((x, q, torch.ones(7)), "one value per output channel"),
                     ((x, q.transpose(0, 1), s), "contiguous")):
        with pytest.raises(RuntimeError, match=msg):
            ext.w8a16_tiles_gemv(*bad)
