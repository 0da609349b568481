"""The C++ Mixture-of-Experts W4A16 kernel (``w4a16_experts_mm``, backends/csrc/moe_cpu.cpp) against float64.

Fresh random codes, zero points and scales per expert, packed per expert by ``cpu_ext.pack_w4_tiles`` and stacked on
a leading expert dim; random routings (repeated experts, experts with no rows, one or many rows per run); outputs
compared with float64 products of the weights as each path forms them (runs of at most ``max_gemv_rows`` rows: the
exact ``(q - z) * s``; longer runs: rounded once to bfloat16), and bit for bit with the dense kernels of one expert
(``w4a16_tiles_mm``); the fused gate/up SiLU (``act=True``) against float64 ``silu(g) * u`` and against
``silu(g_bf16) * u_bf16`` of the unfused kernel's output; bad inputs refused.
"""
from __future__ import annotations

import pytest
import torch

from backends import cpu_ext
from backends.torch_backend import W4TilesHandle, dequantize_tiles

ext = cpu_ext.load()
needs_experts = pytest.mark.skipif(
    ext is None or not hasattr(ext, "has_w4_experts") or not ext.has_w4_tiles() or not ext.has_w4_experts(),
    reason="needs the C++ extension on AVX-512 BF16")


class Experts:
    """``e`` random experts ``[n, k]`` (group ``gs``): the stacked tiled layout and the float64 weights."""

    def __init__(self, e: int, n: int, k: int, gs: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.gs, self.e, self.n, self.k = gs, e, n, k
        self.codes = torch.randint(0, 16, (e, n, k), dtype=torch.uint8, generator=g)
        self.zeros = torch.randint(0, 16, (e, n, k // gs), dtype=torch.uint8, generator=g)
        self.scales = (torch.rand(e, n, k // gs, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
        per = [cpu_ext.pack_w4_tiles(self.codes[i], self.zeros[i], self.scales[i]) for i in range(e)]
        self.tiles = tuple(torch.stack([p[j] for p in per]) for j in range(3))
        # (q - z) * s in float64, straight from the codes (not through the packed layout)
        rep = lambda t: t.double().repeat_interleave(gs, dim=-1)  # noqa: E731
        self.w = (self.codes.double() - rep(self.zeros)) * rep(self.scales)

    def ref(self, x: torch.Tensor, ids: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        """float64 ``x[p] @ W[ids[p]].T``; rows where ``rounded`` use the weights rounded to bfloat16 (the many-row
        path), the others the exact weights (the few-row path)."""
        w = torch.where(rounded[:, None, None], self.w[ids.long()].to(torch.bfloat16).double(), self.w[ids.long()])
        return torch.einsum("pk,pnk->pn", x.double(), w)

    def __call__(self, x, ids, act=False, **kw):
        return ext.w4a16_experts_mm(x, ids, *self.tiles, self.gs, act, **kw)


def long_rows(ids: torch.Tensor, max_gemv_rows: int = 5) -> torch.Tensor:
    """Whether each row's run (consecutive equal ids) is longer than ``max_gemv_rows``."""
    _, inverse, counts = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
    return counts[inverse] > max_gemv_rows


def routing(p: int, e: int, seed: int) -> torch.Tensor:
    """``p`` rows' expert ids sorted, drawn from ``e - 2`` of the ``e`` experts (two get no rows), repeats allowed."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.randperm(e, generator=g)[: e - 2]
    return allowed[torch.randint(0, e - 2, (p,), generator=g)].sort().values.to(torch.int32)


def close(y: torch.Tensor, ref: torch.Tensor, rtol: float = 8e-3) -> float:
    """Max abs error over max |ref| (at most ``rtol``): bf16 output rounding is up to 2^-8 of a value."""
    assert torch.isfinite(y).all()
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= rtol, err
    return err


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each value of ``t`` (float64)."""
    return 2.0 ** (torch.floor(torch.log2(t.double().abs().clamp_min(1e-30))) - 7)


def matches_rounded_silu(y: torch.Tensor, gate_up: torch.Tensor) -> None:
    """The fused y = bf16(silu(g) * u) from the float32 sums g, u against silu(g_bf16) * u_bf16 from the same sums
    rounded to bf16 (``gate_up``, as the plain kernel returns them): element by element, within the change that
    rounding g and u makes (half an ulp of each, through the derivatives) plus one ulp of the result."""
    i = gate_up.shape[1] // 2
    g, u = gate_up[:, :i].double(), gate_up[:, i:].double()
    want = torch.nn.functional.silu(g) * u
    sig = torch.sigmoid(g)
    bound = (sig * (1 + g * (1 - sig)) * u).abs() * ulp(g) / 2 + (g * sig).abs() * ulp(u) / 2 + ulp(want)
    bad = (y.double() - want).abs() > bound
    assert not bad.any(), (y[bad][:5], want[bad][:5])


SHAPES = [(96, 256, 64), (64, 320, 32), (96, 320, 64), (64, 256, 32)]  # (N, K, group size)


@needs_experts
def test_reference_matches_the_packed_layout():
    """The float64 reference of these tests is the weight the layout holds (dequantize_tiles of each expert)."""
    ex = Experts(3, 64, 320, 32, seed=1)
    for i in range(3):
        h = W4TilesHandle(tuple(t[i] for t in ex.tiles), 32, 64, None, torch.bfloat16)
        assert torch.equal(dequantize_tiles(h, torch.float64), ex.w[i])


@needs_experts
@pytest.mark.parametrize("p", [1, 3, 8, 37, 100])
@pytest.mark.parametrize("shape", SHAPES)
def test_experts_match_float64(p, shape):
    n, k, gs = shape
    ex = Experts(8, n, k, gs, seed=p * 31 + k + gs)
    ids = routing(p, 8, seed=p)
    x = torch.randn(p, k, generator=torch.Generator().manual_seed(p)).to(torch.bfloat16)
    for mg in (5, 0, 10**6):  # default split; every row the many-row path; every row the few-row path
        y = ex(x, ids, max_gemv_rows=mg)
        assert y.shape == (p, n) and y.dtype == torch.bfloat16
        rounded = long_rows(ids, mg)
        ref = ex.ref(x, ids, rounded)
        close(y, ref)
        if mg == 5:
            # the tolerance can fail: the same rows against another routing are far off
            wrong = ex.ref(x, (ids + 1) % 8, rounded)
            assert (y.double() - wrong).abs().max().item() > 0.2 * ref.abs().max().item()


@needs_experts
@pytest.mark.parametrize("p", [1, 3, 8, 37, 100])
@pytest.mark.parametrize("shape", [(64, 256, 64), (128, 320, 32)])
def test_fused_silu_matches_float64(p, shape):
    """act=True: [P, N/2] = silu(gate) * up with gate the first N/2 output channels, against float64 and against
    silu(g_bf16) * u_bf16 of the plain output (act=False) of the same rows."""
    n, k, gs = shape
    ex = Experts(8, n, k, gs, seed=p * 17 + n)
    ids = routing(p, 8, seed=p + 100)
    x = torch.randn(p, k, generator=torch.Generator().manual_seed(p + 1)).to(torch.bfloat16)
    for mg in (5, 0, 10**6):
        y = ex(x, ids, act=True, max_gemv_rows=mg)
        assert y.shape == (p, n // 2) and y.dtype == torch.bfloat16
        gu = ex.ref(x, ids, long_rows(ids, mg))
        ref = torch.nn.functional.silu(gu[:, : n // 2]) * gu[:, n // 2:]
        close(y, ref)
        # unfused: the plain kernel's bf16 [P, N], then silu_and_mul
        matches_rounded_silu(y, ex(x, ids, max_gemv_rows=mg))


@needs_experts
@pytest.mark.parametrize("act", [False, True])
def test_long_runs_are_bit_identical_to_the_dense_kernel(act):
    """Rows of long runs (max_gemv_rows=0: all rows) are exactly w4a16_tiles_mm of their expert alone, however the
    run is chunked (300 rows of one expert at K = 2048: chunks of 128 rows) or shared with other experts."""
    ex = Experts(4, 64, 2048, 128, seed=5)
    ids = torch.tensor([2] * 300 + [0] * 7 + [3] * 1, dtype=torch.int32)
    x = torch.randn(len(ids), 2048, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y = ex(x, ids, act=act, max_gemv_rows=0)
    for e in (2, 0, 3):
        rows = ids == e
        dense = ext.w4a16_tiles_mm(x[rows], *(t[e] for t in ex.tiles), 128)
        if act:  # the same float32 sums, there rounded to bf16
            matches_rounded_silu(y[rows], dense)
        else:
            assert torch.equal(y[rows], dense)


@needs_experts
def test_a_row_does_not_depend_on_the_other_rows_or_threads():
    """The same row gives the same bits with other rows beside it (in a run of the same kind: short or long) and at
    any thread count; rows of one expert need not be consecutive (a second run of it reads the weight again)."""
    ex = Experts(6, 96, 256, 64, seed=9)
    ids = torch.tensor([1, 1, 4, 4, 4, 4, 4, 4, 4, 5, 1, 0, 0], dtype=torch.int32)  # expert 1 twice
    x = torch.randn(len(ids), 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    full = ex(x, ids)
    close(full, ex.ref(x, ids, long_rows(ids)))
    assert torch.equal(ex(x[2:9], ids[2:9]), full[2:9])  # the long run alone
    assert torch.equal(ex(x[9:10], ids[9:10]), full[9:10])  # a one-row run alone
    assert torch.equal(ex(x[10:], ids[10:]), full[10:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ex(x, ids), full)
        assert torch.equal(ex(x, ids, act=False, max_gemv_rows=0), ex(x, ids, max_gemv_rows=0))
    finally:
        torch.set_num_threads(threads)


@needs_experts
def test_empty_input():
    ex = Experts(2, 64, 256, 64, seed=2)
    assert ex(torch.empty(0, 256, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int32)).shape == (0, 64)
    assert ex(torch.empty(0, 256, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int32), act=True).shape == (0, 32)


@needs_experts
def test_refuses_bad_inputs():
    ex = Experts(4, 96, 256, 64, seed=3)
    x = torch.randn(3, 256).to(torch.bfloat16)
    ids = torch.tensor([0, 1, 3], dtype=torch.int32)
    call = lambda *a, **kw: ext.w4a16_experts_mm(*a, **kw)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"expert_ids\[2\] = 4 is outside \[0, 4\)"):
        ex(x, torch.tensor([0, 1, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"expert_ids\[0\] = -1"):
        ex(x, torch.tensor([-1, 1, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        ex(x, ids.long())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ex(x.float(), ids)
    with pytest.raises(RuntimeError, match="expert_ids has 2 entries, x 3 rows"):
        ex(x, ids[:2])
    with pytest.raises(RuntimeError, match="the input has 320 channels, the weight 256"):
        ex(torch.randn(3, 320).to(torch.bfloat16), ids)
    with pytest.raises(RuntimeError, match="zeros must be"):
        call(x, ids, ex.tiles[0], ex.tiles[1][:3], ex.tiles[2], 64, False)
    with pytest.raises(RuntimeError, match="scales must be"):
        call(x, ids, ex.tiles[0], ex.tiles[1], ex.tiles[2].float(), 64, False)
    with pytest.raises(RuntimeError, match="zeros must be"):  # group size 32: G = 8, the tensors hold 4 groups
        call(x, ids, *ex.tiles, 32, False)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        call(x, ids, *ex.tiles, 36, False)
    with pytest.raises(RuntimeError, match="packed must be"):
        call(x, ids, ex.tiles[0][0], *ex.tiles[1:], 64, False)
    with pytest.raises(RuntimeError, match="multiple of 64"):  # act: N = 96 is not two halves of 32-multiples
        ex(x, ids, act=True)


# --- w4a16_moe: the whole routed-experts op in one call --------------------------------------------------------------


def topk_routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` tokens' ``k`` distinct experts of ``e`` (int64, as torch.topk gives them) and bf16 weights summing to ~1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


@needs_experts
@pytest.mark.parametrize("t", [1, 2, 8, 61])
def test_moe_equals_the_two_passes_and_a_float64_weighted_sum(t):
    """``w4a16_moe`` = ``w4a16_experts_mm`` gate_up (act) then down over the rows sorted by expert, each token's k
    products weighted and summed: against those two calls and a float64 sum (one bf16 ulp), and against float64
    end to end (the bf16 roundings of h and y between: a few ulps of the output's scale)."""
    e, k, hdim, inter, gs = 8, 3, 256, 64, 64
    gu = Experts(e, 2 * inter, hdim, gs, seed=t + 1)
    down = Experts(e, hdim, inter, 32, seed=t + 2)
    ids, w = topk_routing(t, e, k, seed=t)
    x = torch.randn(t, hdim, generator=torch.Generator().manual_seed(t + 3)).to(torch.bfloat16)
    for ids_dtype in (torch.int64, torch.int32):
        y = ext.w4a16_moe(x, ids.to(ids_dtype), w, *gu.tiles, gs, *down.tiles, 32)
        assert y.shape == (t, hdim) and y.dtype == torch.bfloat16
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sid = flat[order].to(torch.int32)
        h = gu(x.index_select(0, order // k), sid, act=True)
        yy = down(h, sid).index_select(0, torch.argsort(order)).view(t, k, hdim)
        want = (w.double().unsqueeze(-1) * yy.double()).sum(1)
        assert ((y.double() - want).abs() <= ulp(want)).all()
        # end to end in float64 (silu(gate) * up, down), the same routing
        wf = (gu.w[ids], down.w[ids])  # [t, k, 2I, H], [t, k, H, I]
        g_u = torch.einsum("th,tkoh->tko", x.double(), wf[0])
        hh = torch.nn.functional.silu(g_u[..., :inter]) * g_u[..., inter:]
        ref = (w.double().unsqueeze(-1) * torch.einsum("tki,tkhi->tkh", hh, wf[1])).sum(1)
        close(y, ref, rtol=2e-2)
    wrong = ext.w4a16_moe(x, (ids + 1) % e, w, *gu.tiles, gs, *down.tiles, 32)
    assert (wrong.double() - y.double()).abs().max() > 0.1 * y.double().abs().max()


@needs_experts
def test_moe_refuses_bad_inputs():
    e, hdim, inter = 4, 256, 64
    gu, down = Experts(e, 2 * inter, hdim, 64, seed=1), Experts(e, hdim, inter, 32, seed=2)
    ids, w = topk_routing(3, e, 2, seed=0)
    x = torch.randn(3, hdim).to(torch.bfloat16)
    call = lambda x, i, w, **kw: ext.w4a16_moe(x, i, w, *gu.tiles, 64, *down.tiles, 32, **kw)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"topk_ids holds 4, outside \[0, 4\)"):
        call(x, torch.full_like(ids, 4), w)
    with pytest.raises(RuntimeError, match="topk_weights must be bfloat16"):
        call(x, ids, w.float())
    with pytest.raises(RuntimeError, match="topk_weights must be bfloat16 of topk_ids' shape"):
        call(x, ids, w[:, :1])
    with pytest.raises(RuntimeError, match="topk_ids must be int32 or int64"):
        call(x, ids.float(), w)
    with pytest.raises(RuntimeError, match="T = x's rows"):
        call(x[:2], ids, w)
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        call(x.float(), ids, w)
    with pytest.raises(RuntimeError, match="gate_up: the input has 320 channels"):
        call(torch.randn(3, 320).to(torch.bfloat16), ids, w)
    with pytest.raises(RuntimeError, match="down must be"):  # another expert count for down
        ext.w4a16_moe(x, ids, w, *gu.tiles, 64, *(t[:3] for t in down.tiles), 32)


# --- moe_route: logits, softmax, top-k -------------------------------------------------------------------------------


def torch_route(x: torch.Tensor, router: torch.Tensor, k: int, norm: bool):
    """transformers' routing in bf16 (the Backend default): float32 GEMM rounded to bf16, softmax, top-k."""
    from backends.base import Backend

    return Backend.moe_route(None, x, router, k, norm)


@pytest.mark.skipif(ext is None, reason="needs the C++ extension")
@pytest.mark.parametrize("t", [1, 5, 16, 40])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_the_torch_routing(t, norm):
    """Same experts in the same order and weights within one bf16 ulp as the torch routing, for the dot products
    computed in C++ and for float32 logits passed in; rows whose bf16 logits tie at the k-th place are excluded from
    the id comparison (torch.topk orders ties arbitrarily) and checked by the tie rule instead."""
    e, hdim, k = 64, 512, 6
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, hdim, generator=g).to(torch.bfloat16)
    router = (torch.randn(e, hdim, generator=g) * 0.05).to(torch.bfloat16).float()
    want_w, want_ids = torch_route(x, router, k, norm)
    logits = torch.nn.functional.linear(x.float(), router)
    for given in (None, logits):
        w, ids = ext.moe_route(x, router, k, norm, given)
        assert ids.dtype == torch.int32 and w.dtype == torch.bfloat16 and ids.shape == w.shape == (t, k)
        lb = logits.to(torch.bfloat16).float()
        top = lb.sort(-1, descending=True).values
        clean = (top[:, :k] != top[:, 1:k + 1]).all(-1)  # no equal values among the k + 1 largest
        assert clean.sum() >= t // 2
        for r in range(t):
            if clean[r]:
                assert torch.equal(ids[r].long(), want_ids[r]), r
            assert (w[r].double() - want_w[r].double()).abs().max() <= ulp(want_w[r]).max()
            # the tie rule: largest first, equal logits by lower id
            sel = lb[r, ids[r].long()]
            assert (sel[:-1] >= sel[1:]).all()
            for j in range(k - 1):
                if sel[j] == sel[j + 1]:
                    assert ids[r, j] < ids[r, j + 1]
        if norm:
            assert torch.allclose(w.float().sum(-1), torch.ones(t), atol=2e-2)


@pytest.mark.skipif(ext is None, reason="needs the C++ extension")
def test_route_breaks_ties_by_expert_id_and_refuses_bad_inputs():
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    router = torch.zeros(8, 32)
    router[[6, 2, 5]] = 1.0  # three equal best logits
    w, ids = ext.moe_route(x, router, 2, True, None)
    assert ids.tolist() == [[2, 5]] and w.float().tolist() == [[0.5, 0.5]]
    w, ids = ext.moe_route(x, router, 4, False, None)
    assert ids.tolist() == [[2, 5, 6, 0]]
    with pytest.raises(RuntimeError, match=r"top_k must be in \[1, 8\]"):
        ext.moe_route(x, router, 9, True, None)
    with pytest.raises(RuntimeError, match="router must be float32"):
        ext.moe_route(x, router.bfloat16(), 2, True, None)
    with pytest.raises(RuntimeError, match="x must be a CPU bfloat16"):
        ext.moe_route(x.float(), router, 2, True, None)
    with pytest.raises(RuntimeError, match=r"logits must be \[T=1, E=8\]"):
        ext.moe_route(x, router, 2, True, torch.zeros(1, 7))
