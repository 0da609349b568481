"""The Triton backend's fused MoE W4A16 kernels (backends/triton/moe.py) against float64 math on the dequantized
weights and against the per-expert reference of ``backends.base.Backend.experts``.

Fresh random experts per case (4-bit codes, asymmetric zero points, scales in the compute dtype so that the float64
reference sees the very weights the kernel does), random top-k routings with experts shared by many tokens and
experts no token picks, T = 1 (a decode: 8 experts), 5 and 33 tokens; ragged tiles (I and H not multiples of the
column tiles, K not a multiple of the K tile, up columns in another 128-column layout tile than their gate); the
routing's sort-and-pad; batch invariance; fallbacks and refused inputs. Outputs start as NaN (``kernels.POISON``),
so an element a kernel fails to write fails the comparison.

Without a GPU the kernels run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``; the magic-number int4
conversion is replaced by its shift-and-mask twin there, see tests/test_triton_w4a16.py). Sizes are small: the
interpreter is slow.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import QuantizedWeight, get_backend  # noqa: E402
from backends.base import Backend  # noqa: E402
from backends.types import ExpertsHandle  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}  # the per-expert reference
# the fused kernels round twice (h, the weighted products) where the reference rounds five times: tighter
FUSED_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2, torch.float16: 1.5e-3}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    from backends.triton import kernels

    monkeypatch.setattr(kernels, "POISON", True)


@pytest.fixture(scope="module")
def moe():
    from backends.triton import moe

    return moe


def _qweight(n, k, gs, g, dtype, sym=False, bias=False, g_idx=None):
    groups = 1 if gs == -1 else k // gs
    zeros = (torch.full((groups, n), 8, dtype=torch.uint8) if sym
             else torch.randint(0, 16, (groups, n), generator=g, dtype=torch.uint8))
    return QuantizedWeight(4, gs, sym, torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), zeros,
                           (torch.rand(groups, n, generator=g) * 0.04 + 0.004).to(dtype), g_idx,
                           (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None)


def _experts(e, hidden, inter, gs_gu, gs_dn, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return ([_qweight(2 * inter, hidden, gs_gu, g, dtype) for _ in range(e)],
            [_qweight(hidden, inter, gs_dn, g, dtype) for _ in range(e)])


def _routing(t, k, e, seed, unused=2):
    """``[t, k]`` distinct experts per token drawn from ``e - unused`` of the ``e`` experts (the others get no
    pair); token 0's choice repeated at token ``t // 2`` (in another order)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.randperm(e, generator=g)[: e - unused]
    ids = torch.stack([allowed[torch.randperm(e - unused, generator=g)[:k]] for _ in range(t)])
    if t > 2:
        ids[t // 2] = ids[0].flip(0)
    return ids, torch.rand(t, k, generator=g) + 0.05


def _ref(x, ids, w, gate_up, down):
    """float64 ``sum_j w[t, j] * down_e(silu(gate_e(x)) * up_e(x))`` on the dequantized weights."""
    inter = gate_up[0].out_features // 2
    wgu = torch.stack([q.dequantize(torch.float64) for q in gate_up])[ids]  # [T, k, 2I, H]
    wdn = torch.stack([q.dequantize(torch.float64) for q in down])[ids]  # [T, k, H, I]
    gu = torch.einsum("tkoh,th->tko", wgu, x.double().cpu())
    act = torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]
    return torch.einsum("tk,tkhi,tki->th", w.double().cpu(), wdn, act)


def _rel(got, ref):
    got = got.cpu()
    assert torch.isfinite(got).all(), "an output element was not written (poisoned NaN left)"
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


# (dtype, hidden, inter, group gate_up, group down, experts): float32 and groups of 32 (several K tiles per
# projection), bf16 and groups of 64 over hidden 128, fp16 with one group per output channel
CASES = {"f32-g32": (torch.float32, 64, 64, 32, 32, 10), "bf16-g64": (torch.bfloat16, 128, 64, 64, 64, 10),
         "f16-channel": (torch.float16, 64, 64, -1, -1, 10)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_experts_match_float64_and_the_reference(case):
    dtype, hidden, inter, gs_gu, gs_dn, e = CASES[case]
    gate_up, down = _experts(e, hidden, inter, gs_gu, gs_dn, seed=sorted(CASES).index(case), dtype=dtype)
    be = get_backend("triton", DEVICE)
    handle = be.prepare_experts(gate_up, down, dtype)
    from backends.triton.backend import TritonW4ExpertsHandle

    assert isinstance(handle, TritonW4ExpertsHandle)
    assert handle.num_experts == e and handle.intermediate_size == inter and handle.hidden_size == hidden
    assert handle.gate_up[0].shape == (e, -(-2 * inter // 128), -(-hidden // 128) * 16, 128)
    generic = Backend.prepare_experts(be, gate_up, down, dtype)
    assert isinstance(generic, ExpertsHandle)
    for t, k in ((1, 8), (5, 4), (33, 2)) if case != "f16-channel" else ((5, 4),):
        ids, w = _routing(t, k, e, seed=t)
        x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(t + 1)).to(dtype)
        w = w.to(dtype)
        got = be.experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), handle)
        assert got.shape == (t, hidden) and got.dtype == dtype
        ref = _ref(x, ids, w, gate_up, down)
        assert _rel(got, ref) < FUSED_TOL[dtype], (case, t, _rel(got, ref))
        if t != 33 or dtype == torch.float32:  # the per-expert reference (slow under the interpreter)
            base = Backend.experts(be, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), generic)
            assert _rel(base, ref) < TOL[dtype]
            assert _rel(got, base.cpu().double()) < 2 * TOL[dtype], (case, t)


def test_ragged_tiles_and_unweighted(moe):
    """I and H not multiples of the column tiles (masked columns), K not a multiple of the K tile (one group over
    K), up columns in another 128-column layout tile than their gate (I = 160), several N tiles and row blocks,
    an expert with more rows than one block; ``topk_weights=None`` (no weight in the epilogue)."""
    be = get_backend("triton", DEVICE)
    for hidden, inter, gs_gu, gs_dn, cfg in ((80, 48, -1, -1, dict(block_m=16, gate_up=dict(block_n=32),
                                                                    down=dict(block_n=32))),
                                             (64, 160, 32, 32, dict(block_m=16, gate_up=dict(block_n=64),
                                                                    down=dict(block_n=32, block_k=16)))):
        e, t, k = 4, 11, 2
        gate_up, down = _experts(e, hidden, inter, gs_gu, gs_dn, seed=hidden + inter, dtype=torch.float32)
        h = be.prepare_experts(gate_up, down, torch.float32)
        ids, w = _routing(t, k, e, seed=3, unused=1)
        ids[:, 0] = ids[0, 0]  # one expert takes every token: 11+ rows, two row blocks when padded to 16
        ids[:, 1] = torch.where(ids[:, 1] == ids[0, 0], (ids[0, 0] + 1) % e, ids[:, 1])
        x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(5))
        got = moe.fused_moe_w4a16(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), h.gate_up, h.down,
                                  h.group_size_gate_up, h.group_size_down, inter, config=cfg)
        assert _rel(got, _ref(x, ids, w, gate_up, down)) < 1e-5, (hidden, inter)
        got = moe.fused_moe_w4a16(x.to(DEVICE), ids.to(DEVICE), None, h.gate_up, h.down, h.group_size_gate_up,
                                  h.group_size_down, inter, config=dict(cfg, block_m=32))
        assert _rel(got, _ref(x, ids, torch.ones(t, k), gate_up, down)) < 1e-5, (hidden, inter)


def test_moe_align_sorts_and_pads_by_expert(moe):
    ids, _ = _routing(33, 3, 12, seed=9, unused=4)
    ids[5] = torch.tensor([0, 1, 2])  # expert 0..2 may be among the unused ones: now they have a pair
    n, e, bm = ids.numel(), 12, 16
    sorted_ids, block_expert, n_padded = moe.moe_align(ids, e, bm)
    assert sorted_ids.dtype == block_expert.dtype == n_padded.dtype == torch.int32
    assert sorted_ids.numel() == moe.max_padded_rows(n, e, bm) and sorted_ids.numel() % bm == 0
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    assert int(n_padded) == int(((counts + bm - 1) // bm * bm).sum()) <= sorted_ids.numel()
    pos = 0
    for ex in range(e):  # each expert's pairs, in ascending order, then padding up to the next block
        c = int(counts[ex])
        if not c:
            continue
        run = sorted_ids[pos:pos + c]
        assert torch.equal(run.long(), (flat == ex).nonzero().squeeze(1)), ex
        padded = -(-c // bm) * bm
        assert (sorted_ids[pos + c:pos + padded] == n).all()
        assert (block_expert[pos // bm:(pos + padded) // bm] == ex).all()
        pos += padded
    assert (sorted_ids[pos:] == n).all()  # the blocks past n_padded: programs that return at once
    assert sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))


def test_plan_decode_and_batch_invariance(moe):
    # Qwen3-30B-A3B's layer on an H200: a decode's 8 pairs in 16-row blocks, columns split until every
    # multiprocessor has a program
    p = moe.plan(8, 128, 2048, 768, 128, 128, sms=132)
    assert p["block_m"] == 16
    for name, n in (("gate_up", 768), ("down", 2048)):
        assert 8 * -(-n // p[name]["block_n"]) >= 132 and p[name]["block_k"] == 128, (name, p)
    assert moe.plan(128 * 64, 128, 2048, 768, 128, 128, sms=132)["block_m"] == 64
    assert moe.plan(32, 8, 64, 64, 32, 32)["gate_up"]["block_k"] == 32  # K tiles inside the group
    inv = [moe.plan(m, 128, 2048, 768, 128, 128, sms=132, batch_invariant=True) for m in (1, 8, 4096)]
    assert inv[0] == inv[1] == inv[2] and inv[0]["block_m"] == 16


def test_batch_invariant_rows_are_bit_identical_alone_or_batched():
    gate_up, down = _experts(6, 64, 32, 32, 32, seed=4, dtype=torch.bfloat16)
    be = get_backend("triton", DEVICE, batch_invariant=True)
    h = be.prepare_experts(gate_up, down, torch.bfloat16)
    ids, w = _routing(9, 2, 6, seed=2, unused=0)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    w = w.to(torch.bfloat16)
    full = be.experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), h)
    for rows in ([0], [4, 7]):
        part = be.experts(x[rows].to(DEVICE), ids[rows].to(DEVICE), w[rows].to(DEVICE), h)
        assert torch.equal(part.cpu(), full.cpu()[rows]), rows


def test_prepare_experts_falls_back_and_refuses():
    from backends.triton.backend import TritonW4ExpertsHandle

    be = get_backend("triton", DEVICE)
    g = torch.Generator().manual_seed(0)
    ok_gu, ok_dn = _experts(3, 64, 32, 32, 32, seed=1, dtype=torch.float32)
    assert isinstance(be.prepare_experts(ok_gu, ok_dn, torch.float32), TritonW4ExpertsHandle)
    perm = torch.randperm(64, generator=g)
    act_order = _qweight(64, 64, 32, g, torch.float32, g_idx=(torch.argsort(perm) // 32).to(torch.int32))
    fallbacks = {
        "dense": ([torch.randn(64, 64) for _ in range(3)], [torch.randn(64, 32) for _ in range(3)]),
        "group 8": _experts(3, 64, 32, 8, 32, seed=2, dtype=torch.float32),  # tl.dot K tiles need 16
        "act-order": ([act_order, *ok_gu[1:]], ok_dn),
        "bias": ([_qweight(64, 64, 32, g, torch.float32, bias=True), *ok_gu[1:]], ok_dn),
        "two group sizes": ([_qweight(64, 64, 64, g, torch.float32), *ok_gu[1:]], ok_dn),
    }
    for name, (gu, dn) in fallbacks.items():
        h = be.prepare_experts(gu, dn, torch.float32)
        assert type(h) is ExpertsHandle, name
    with pytest.raises(ValueError, match="down projection"):
        be.prepare_experts(ok_gu, [_qweight(64, 16, 16, g, torch.float32), *ok_dn[1:]], torch.float32)
    with pytest.raises(ValueError, match="gate_up projection"):
        be.prepare_experts([ok_gu[0], _qweight(48, 64, 32, g, torch.float32), ok_gu[2]], ok_dn, torch.float32)
    with pytest.raises(ValueError, match="all quantized or all dense"):
        be.prepare_experts([torch.randn(64, 64), *ok_gu[1:]], ok_dn, torch.float32)
    # the fallback still computes the experts (the per-expert reference)
    gu, dn = fallbacks["group 8"]
    h = be.prepare_experts(gu, dn, torch.float32)
    ids, w = _routing(2, 2, 3, seed=1, unused=0)
    x = torch.randn(2, 64, generator=g)
    assert _rel(be.experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), h), _ref(x, ids, w, gu, dn)) < 1e-5


def test_experts_refuse_bad_inputs_and_take_zero_tokens():
    gate_up, down = _experts(4, 64, 32, 32, 32, seed=6, dtype=torch.float32)
    be = get_backend("triton", DEVICE)
    h = be.prepare_experts(gate_up, down, torch.float32)
    x = torch.randn(3, 64).to(DEVICE)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], device=DEVICE)
    w = torch.ones(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_size=64"):
        be.experts(torch.randn(3, 48, device=DEVICE), ids, w, h)
    with pytest.raises(ValueError, match="topk_weights"):
        be.experts(x, ids, w[:, :1], h)
    with pytest.raises(ValueError, match=r"x \[T, hidden\] and topk_ids \[T, k\]"):
        be.experts(x, ids[:2], w[:2], h)
    with pytest.raises(ValueError, match="integer"):
        be.experts(x, ids.float(), w, h)
    if DEVICE != "cuda":
        with pytest.raises(ValueError, match=r"in \[0, 4\)"):
            be.experts(x, ids + 2, w, h)
    out = be.experts(x[:0], ids[:0], w[:0], h)
    assert out.shape == (0, 64)
    assert "experts" in type(be).op_coverage(None) and "fused MoE" in type(be).op_coverage(None)["experts"]
