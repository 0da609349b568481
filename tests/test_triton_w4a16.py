"""The Triton backend's W4A16 kernels (backends/triton/w4a16.py) against float64, on fresh random inputs, ragged
shapes and NaN-poisoned outputs; the split-K ticket reduction, batch invariance, the byte-level repack, the
magic-number int4 conversion's constants and the configuration table.

Without a GPU they run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``), where the inline-assembly
conversion is replaced by its shift-and-mask twin (``ASM=False``); :func:`test_magic_number_conversion_constants`
checks the assembly's arithmetic in numpy instead.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from backends import QuantizedWeight, get_backend  # noqa: E402
from backends.triton import w4a16 as W4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    from backends.triton import kernels

    monkeypatch.setattr(kernels, "POISON", True)
    return kernels


@pytest.fixture
def w4():
    return W4


def _qweight(n, k, gs, seed, dtype=torch.float32, bias=False, g_idx=None, sym=False):
    g = torch.Generator().manual_seed(seed)
    groups = (k + gs - 1) // gs if g_idx is None else int(g_idx.max()) + 1
    zeros = (torch.full((groups, n), 8, dtype=torch.uint8) if sym
             else torch.randint(0, 16, (groups, n), generator=g, dtype=torch.uint8))
    return QuantizedWeight(4, gs, sym, torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), zeros,
                           (torch.rand(groups, n, generator=g) * 0.05 + 0.005).to(dtype), g_idx,
                           (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None)


def _ref(x, qw):
    y = x.double().cpu() @ qw.dequantize(torch.float64).T
    return y if qw.bias is None else y + qw.bias.double()


def _rel(got, ref):
    got = got.cpu()
    assert torch.isfinite(got).all(), "an output element was not written (poisoned NaN left)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def _run(w4, x, qw, **kw):
    packed = w4.pack_tiled(qw.qweight).to(DEVICE)
    return w4.w4a16_matmul(x.to(DEVICE), packed, qw.scales.to(DEVICE), qw.qzeros.to(DEVICE), qw.group_size,
                           qw.out_features, qw.in_features, None if qw.bias is None else qw.bias.to(DEVICE), **kw)


# (N, K) per group size: N ragged (not a multiple of the 128-column layout tile, more than one tile), K several
# groups; per channel (-1) over a K that is not a multiple of 8
SHAPES = {32: (150, 96), 64: (72, 192), 128: (131, 256), -1: (40, 100)}


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gs", [32, 64, 128, -1])
@pytest.mark.parametrize("kind", ["gemv", "dot"])
def test_w4a16_matches_float64(w4, kind, gs, dtype):
    n, k = SHAPES[gs]
    ms = (1, 2, 3) if kind == "gemv" else (5, 17)
    for i, m in enumerate(ms):
        for bias, split in ((False, 1), (True, 3)):
            qw = _qweight(n, k, k if gs == -1 else gs, seed=100 * i + 10 * split + (gs % 7), dtype=dtype, bias=bias)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + split)).to(dtype)
            y = _run(w4, x, qw, kind=kind, split_k=split)
            assert y.shape == (m, n) and y.dtype == dtype
            assert _rel(y, _ref(x, qw)) < TOL[dtype], (kind, gs, m, bias, split)


def test_w4a16_block_shapes_and_symmetric(w4):
    # other tiles than the table's defaults: narrow and wide N blocks, K tiles down to one word row, several
    # rows per GEMV program; symmetric zero points; a split that does not divide the K tiles evenly
    qw = _qweight(200, 160, 32, seed=5, sym=True, bias=True)
    x = torch.randn(4, 160, generator=torch.Generator().manual_seed(1))
    ref = _ref(x, qw)
    for kind, cfg in (("gemv", dict(block_m=4, block_n=256, block_k=8, num_warps=2)),
                      ("gemv", dict(block_m=2, block_n=128, block_k=32, num_warps=4)),
                      ("dot", dict(block_m=16, block_n=32, block_k=16, num_warps=4)),
                      ("dot", dict(block_m=32, block_n=128, block_k=32, num_warps=4))):
        cfg = dict(cfg, num_stages=1, split_k=0, kind=kind)
        for split in (1, 4):
            y = _run(w4, x, qw, config=cfg, split_k=split)
            assert _rel(y, ref) < 1e-5, (cfg, split)


def test_split_k_ticket_reduction_is_deterministic_and_resets(w4):
    qw = _qweight(130, 256, 64, seed=7, bias=True, dtype=torch.bfloat16)
    x = torch.randn(3, 256).to(torch.bfloat16)
    a = _run(w4, x, qw, kind="gemv", split_k=4)
    b = _run(w4, x, qw, kind="gemv", split_k=4)
    assert torch.equal(a, b)
    for buf in w4._COUNTERS.values():  # every tile's last program put its counter back to 0
        assert int(buf.abs().sum()) == 0
    assert _rel(a, _ref(x, qw)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_rows_are_bit_identical_alone_or_batched(w4, dtype):
    qw = _qweight(96, 192, 64, seed=11, bias=True, dtype=dtype)
    x = torch.randn(21, 192, generator=torch.Generator().manual_seed(3)).to(dtype)
    for split in (None, 3):
        full = _run(w4, x, qw, batch_invariant=True, split_k=split)
        assert _rel(full, _ref(x, qw)) < TOL[dtype]
        for rows in ((0,), (5, 6), (19, 20, 0)):
            part = _run(w4, x[list(rows)], qw, batch_invariant=True, split_k=split)
            assert torch.equal(part.cpu(), full.cpu()[list(rows)]), (split, rows)


@pytest.mark.parametrize("case", ["plain", "act-order", "irregular-gidx", "bias", "dense-path", "batch-invariant",
                                  "gptq-layout", "group-24"])
def test_backend_w4a16_linear_layouts(case):
    n, k, gs = 48, 128, 32
    g_idx = None
    if case == "act-order":
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(1))
        g_idx = (torch.argsort(perm) // gs).to(torch.int32)
    elif case == "irregular-gidx":
        g_idx = torch.randint(0, k // gs, (k,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    if case == "group-24":
        n, k, gs = 40, 96, 24
    qw = _qweight(n, k, gs, seed=7, g_idx=g_idx, bias=case == "bias")
    opts = {"dequant-path": {}}.get(case, {})
    if case == "dense-path":
        opts = dict(dequant_min_rows=8)
    if case == "batch-invariant":
        opts = dict(batch_invariant=True)
    be = get_backend("triton", DEVICE, **opts)
    if case == "gptq-layout":
        be.w4a16_layout = "gptq"
    dtype = torch.float32
    h = be.prepare_w4a16(qw, dtype)
    want = "gptq" if case in ("irregular-gidx", "gptq-layout") else "tiled"
    assert h.layout == want, case
    assert (h.in_perm is not None) == (case == "act-order")
    for m in ((19,) if case == "dense-path" else (1, 3, 9)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        y = be.w4a16_linear(x, h)
        assert y.shape == (m, n) and y.dtype == dtype
        assert _rel(y, _ref(x, qw)) < 1e-5, (case, m)


def test_dequantize_tiled_matches_float64(w4):
    for gs, (n, k) in SHAPES.items():
        qw = _qweight(n, k, k if gs == -1 else gs, seed=gs % 13)
        w = w4.dequantize_tiled(w4.pack_tiled(qw.qweight).to(DEVICE), qw.scales.to(DEVICE), qw.qzeros.to(DEVICE),
                                qw.group_size, n, k, torch.float32)
        assert torch.isfinite(w.cpu()).all()
        assert (w.cpu().double() - qw.dequantize(torch.float64).T).abs().max().item() < 1e-7


def _pack_w4_int64(codes):
    """The pre-issue-22 pack_w4 (int64 widening): the bits the byte-level repack must reproduce."""
    n, k = codes.shape
    k8 = (k + 7) // 8
    c = torch.zeros(k8 * 8, n, dtype=torch.int64)
    c[:k] = codes.t().to(torch.int64)
    c = c.view(k8, 8, n)
    words = torch.zeros(k8, n, dtype=torch.int64)
    for j in range(8):
        words |= c[:, j] << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_byte_level_repack_gives_the_old_bits(poisoned, w4):
    for n, k in ((5, 21), (130, 256), (64, 8), (3, 1)):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
        codes[0, :min(k, 8)] = 15  # negative int32 words
        assert torch.equal(poisoned.pack_w4(codes), _pack_w4_int64(codes))
        assert torch.equal(poisoned.unpack_w4(poisoned.pack_w4(codes), k), codes)
        tiled = w4.pack_tiled(codes)
        assert tiled.shape == (-(-n // 128), -(-k // 128) * 16, 128) and tiled.dtype == torch.int32
        assert torch.equal(w4.unpack_tiled(tiled, n, k), codes)
        # the tiled words are the old words, moved: word [t, r, c] = old word [r, 128 t + c]
        old = _pack_w4_int64(codes)
        for r, col in ((0, 0), (old.shape[0] - 1, n - 1)):
            assert tiled[col // 128, r, col % 128] == old[r, col]


def _f16_bits(v):
    return int(np.array(v, dtype=np.float16).view(np.uint16))


def _f16(bits):
    return float(np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16))


@triton.jit
def _pairs(z_ptr, lo_ptr, hi_ptr):
    offs = tl.arange(0, 16)
    zlo, nzhi = W4._zero_pairs(tl.load(z_ptr + offs))
    tl.store(lo_ptr + offs, zlo)
    tl.store(hi_ptr + offs, nzhi)


def test_magic_number_conversion_constants(w4):
    """The inline assembly's arithmetic, emulated: lop3 ``(w & mask) | 0x64006400`` gives fp16 ``1024 + q`` (low
    nibble of a byte) or ``1024 + 16 q`` (high); ``sub.f16x2`` with ``zlo`` and ``fma.rn.f16x2(h, 1/16, nzhi)``
    (fp16 results rounded once) leave exactly ``q - z`` for every code and zero point, in both halves."""
    assert _f16(0x6400) == 1024.0 and _f16(0x2C00) == 1 / 16 and _f16(0x5400) == 64.0
    for z in range(16):
        zlo = (z * 0x00010001) | 0x64006400
        nzhi = ((z * 0x00100010) | 0xD400D400) & 0xFFFFFFFF
        for half in (0, 16):
            assert _f16(zlo >> half) == 1024 + z and _f16(nzhi >> half) == -(64 + z)
        for q in range(16):
            for pos in range(8):  # nibble position in the word
                w = q << (4 * pos)
                t = w >> 8
                src, half = (w, 0) if pos in (0, 1, 4, 5) else (t, 16)
                half = 16 if pos >= 4 else 0
                mask = 0x000F000F if pos % 2 == 0 else 0x00F000F0
                h = ((src & mask) | 0x64006400) >> half & 0xFFFF
                if pos % 2 == 0:
                    got = float(np.float16(_f16(h) - _f16(zlo >> half)))
                else:
                    got = float(np.float16(_f16(h) * _f16(0x2C00) + _f16(nzhi >> half)))
                assert got == q - z, (q, z, pos)
    # the kernel's own zero-point pairs (the operands the assembly receives) are those bits
    z = torch.arange(16, dtype=torch.uint8, device=DEVICE)
    lo = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    hi = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    _pairs[(1,)](z, lo, hi)
    want_lo = [(v * 0x00010001) | 0x64006400 for v in range(16)]
    want_hi = [int(np.array((v * 0x00100010) | 0xD400D400, dtype=np.uint32).view(np.int32)) for v in range(16)]
    assert lo.cpu().tolist() == want_lo and hi.cpu().tolist() == want_hi
    # and the pure-tl twin the interpreter runs gives the same numbers, through the kernel on one word per column
    codes = torch.arange(16, dtype=torch.uint8).repeat(16, 1)[:, :8].contiguous()
    qw = QuantizedWeight(4, -1, False, torch.cat([codes, codes.flip(1)], 1), torch.arange(16, dtype=torch.uint8)[None],
                         torch.ones(1, 16))
    x = torch.eye(16)
    y = _run(w4, x, qw, kind="gemv")
    assert torch.equal(y.cpu(), qw.dequantize(torch.float32).T.contiguous())


def test_config_table_defaults_and_overrides(w4, tmp_path):
    table = w4.load_configs()
    assert "gemv" in table["default"] and "dot" in table["default"]
    cfg = w4.get_config(12345, 678, 1)  # a shape the table does not list: the defaults
    assert cfg["kind"] == "gemv" and cfg["block_n"] == table["default"]["gemv"]["block_n"]
    assert w4.get_config(12345, 678, 64)["kind"] == "dot"
    custom = {"gemv_max_m": 8, "default": table["default"],
              "shapes": {"4096,4096": {"8": {"block_n": 256, "split_k": 5}}}}
    cfg = w4.get_config(4096, 4096, 7, custom)  # bucket 8
    assert cfg["kind"] == "gemv" and cfg["block_n"] == 256 and cfg["split_k"] == 5
    assert w4.m_bucket(3) == 4 and w4.m_bucket(1000) == 128
    assert w4.choose_split(32, 4096, 128, 132) == 16 and w4.choose_split(32, 4096, 128, 1) == 1
    assert w4.choose_split(4, 256, 128, 132, split=9) == 2  # never more splits than K tiles


def test_shipped_table_entries_are_launchable(w4):
    """Every entry of w4a16_configs.json (the GPU-tuned shapes) has known keys with values the kernels take, and the
    plan's built-in defaults are the table's (a missing or unreadable table changes nothing)."""
    from backends.triton import w4a16_plan

    table = w4.load_configs()
    assert w4a16_plan._DEFAULT_GEMV == table["default"]["gemv"] and w4a16_plan._DEFAULT_DOT == table["default"]["dot"]
    assert int(table["gemv_max_m"]) == 1
    allowed = {"kind", "block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k"}
    pow2 = {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert table["shapes"], "the table lists GPU-tuned shapes"
    for shape, buckets in table["shapes"].items():
        n, k = map(int, shape.split(","))
        for mb, cfg in buckets.items():
            assert int(mb) in w4.M_BUCKETS and set(cfg) <= allowed, (shape, mb, cfg)
            assert cfg.get("kind", "dot") in ("gemv", "dot") and cfg["block_n"] in pow2 and cfg["block_k"] in pow2
            assert cfg["num_warps"] in (1, 2, 4, 8) and 1 <= cfg["num_stages"] <= 4 and 0 <= cfg["split_k"] <= 64
            p = w4.launch_params(int(mb), n, k, 128, sms=132)
            assert p["kind"] == cfg["kind"] and p["block_n"] == cfg["block_n"]
            assert p["split"] * p["k_per_split"] >= k and p["block_k"] <= w4.TILE_K
