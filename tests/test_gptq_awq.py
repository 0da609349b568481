"""GPTQ solver (reconstruction vs RTN, act-order g_idx, degenerate Hessians) and AWQ (scale folding is an
identity of the fp model, scale/clip searches on toy linears). Everything is tiny and CPU-only."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers

import lite.awq
from backends.types import QuantizedWeight
from lite.awq import activation_scale, apply_clip, search_clip, search_scales, weight_scale
from lite.formats.arch import NO_CLIP, SCALING_GROUPS
from lite.gptq import HessianAccumulator, gptq_quantize
from lite.rtn import fake_quantize, quantize_rtn


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is fastest (and robust when the cores are busy)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _correlated_problem(out_f=64, in_f=256, n=2048, seed=0):
    """Random W and correlated inputs X = Z A (+ a few large-magnitude channels), with their Hessian."""
    W, X, H = _correlated_problem_cached(out_f, in_f, n, seed)
    return W.clone(), X.clone(), H.clone()


@functools.lru_cache(maxsize=None)
def _correlated_problem_cached(out_f, in_f, n, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_f, in_f, generator=g)
    Z = torch.randn(n, in_f, generator=g)
    A = torch.randn(in_f, in_f, generator=g) / in_f ** 0.5
    X = Z @ A
    X[:, [c % in_f for c in (3, 77, 150, 201)]] *= 20.0  # outlier channels
    acc = HessianAccumulator(in_f)
    for chunk in X.split(500):  # several adds exercise the running average
        acc.add(chunk)
    return W, X, acc.H


def _out_err(W, X, qw: QuantizedWeight) -> float:
    return float((X @ W.t() - X @ qw.dequantize(torch.float32).t()).pow(2).sum())


def _by_hand(qw: QuantizedWeight, c: int) -> torch.Tensor:
    """Column ``c`` of the dequantized weight from the canonical formula, float64."""
    g = int(qw.g_idx[c]) if qw.g_idx is not None else c // qw.effective_group_size
    return (qw.qweight[:, c].double() - qw.qzeros[g].double()) * qw.scales[g].double()


# ------------------------------------------------------------------------------------------------
# 1. GPTQ beats RTN on the layer-output objective
# ------------------------------------------------------------------------------------------------
def test_hessian_accumulator_is_running_2_over_n_xtx_and_skips_nonfinite_rows():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 16, generator=g, dtype=torch.float64)
    acc = HessianAccumulator(16)
    acc.add(X[:100].float())
    acc.add(X[100:250].float().view(3, 50, 16))  # any leading shape
    bad = X[250:].float().clone()
    bad[7, 3] = float("nan")
    bad[9, 0] = float("inf")
    with pytest.warns(UserWarning, match="skipped 2"):
        acc.add(bad)
    keep = torch.ones(300, dtype=torch.bool)
    keep[250 + 7] = keep[250 + 9] = False
    Xk = X[keep]
    ref = 2.0 / Xk.shape[0] * Xk.t() @ Xk
    assert acc.n == 298
    torch.testing.assert_close(acc.H.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("act_order,static_groups", [(False, False), (True, False), (True, True)],
                         ids=["plain", "act_order", "act_order_static"])
def test_gptq_output_error_clearly_below_rtn(sym, act_order, static_groups):
    W, X, H = _correlated_problem()
    rtn = quantize_rtn(W, 4, 64, sym)
    qw = gptq_quantize(W, H, bits=4, group_size=64, sym=sym, act_order=act_order, static_groups=static_groups)
    assert qw.qweight.dtype == torch.uint8 and int(qw.qweight.max()) <= 15
    assert qw.scales.dtype == torch.float16 and tuple(qw.scales.shape) == (4, 64)
    if sym:
        assert bool((qw.qzeros == 8).all())
    ratio = _out_err(W, X, qw) / _out_err(W, X, rtn)
    assert ratio < 0.9, ratio


def test_gptq_min_zero_keeps_zero_points_in_1_15():
    W, X, H = _correlated_problem(out_f=32, in_f=128, n=512)
    W[:, :64] = W[:, :64].abs()  # groups of one sign would want zero point 0
    qw = gptq_quantize(W, H, bits=4, group_size=64, sym=False, min_zero=1)
    assert int(qw.qzeros.min()) >= 1 and int(qw.qzeros.max()) <= 15
    assert _out_err(W, X, qw) < _out_err(W, X, quantize_rtn(W, 4, 64))


# ------------------------------------------------------------------------------------------------
# 2. act-order g_idx semantics are exact
# ------------------------------------------------------------------------------------------------
def test_act_order_g_idx_follows_descending_hessian_diagonal():
    W, X, H = _correlated_problem(out_f=48, in_f=128, n=1024, seed=3)
    gs = 32
    qw = gptq_quantize(W, H, bits=4, group_size=gs, sym=False, act_order=True)
    perm = torch.argsort(torch.diag(H), descending=True)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(len(perm))
    assert qw.g_idx is not None and qw.g_idx.dtype == torch.int32
    assert torch.equal(qw.g_idx.long(), pos // gs)
    assert torch.equal(torch.bincount(qw.g_idx.long()), torch.full((128 // gs,), gs))
    assert not qw.has_trivial_g_idx()
    # the canonical dequantization uses exactly these g_idx
    deq = qw.dequantize(torch.float64)
    for c in (0, int(perm[0]), int(perm[-1]), 77):
        assert torch.equal(deq[:, c], _by_hand(qw, c))
        g = int(qw.g_idx[c])
        assert g == int(pos[c]) // gs


def test_act_order_with_diagonal_hessian_is_rtn_in_permuted_order():
    # diagonal H -> no error propagation, so GPTQ act-order == RTN of W[:, perm] grouped in perm order
    g = torch.Generator().manual_seed(4)
    W = torch.randn(16, 64, generator=g)
    d = torch.rand(64, generator=g) + 0.5  # distinct diagonal
    H = torch.diag(d)
    perm = torch.argsort(d, descending=True)
    for sym in (False, True):
        qw = gptq_quantize(W, H, bits=4, group_size=16, sym=sym, act_order=True)
        ref = quantize_rtn(W[:, perm], 4, 16, sym)
        assert torch.equal(qw.qweight[:, perm], ref.qweight)
        assert torch.equal(qw.qzeros, ref.qzeros)
        assert torch.equal(qw.scales, ref.scales)
        torch.testing.assert_close(qw.dequantize()[:, perm], ref.dequantize(), rtol=0, atol=0)


def test_static_groups_g_idx_is_natural_and_params_from_original_groups():
    W, X, H = _correlated_problem(out_f=32, in_f=128, n=1024, seed=5)
    gs = 32
    qw = gptq_quantize(W, H, bits=4, group_size=gs, sym=False, act_order=True, static_groups=True)
    assert qw.g_idx is None  # contiguous groups: storable without g_idx (AWQ GEMM too)
    assert torch.equal(qw.group_index().long(), torch.arange(128) // gs)
    assert qw.has_trivial_g_idx()
    # static groups take their scale/zero from the unmodified weight: those of RTN
    ref = quantize_rtn(W, 4, gs, False)
    assert torch.equal(qw.scales, ref.scales) and torch.equal(qw.qzeros, ref.qzeros)
    deq = qw.dequantize(torch.float64)
    for c in (0, 31, 32, 127):
        assert torch.equal(deq[:, c], _by_hand(qw, c))


def test_static_groups_with_diagonal_hessian_equals_rtn():
    g = torch.Generator().manual_seed(6)
    W = torch.randn(16, 64, generator=g)
    H = torch.diag(torch.rand(64, generator=g) + 0.5)
    qw = gptq_quantize(W, H, bits=4, group_size=16, act_order=True, static_groups=True)
    ref = quantize_rtn(W, 4, 16)
    assert torch.equal(qw.qweight, ref.qweight) and torch.equal(qw.scales, ref.scales)
    assert torch.equal(qw.qzeros, ref.qzeros)


def test_no_act_order_has_no_g_idx_and_rejects_bad_group_size():
    W, X, H = _correlated_problem(out_f=16, in_f=128, n=256)
    qw = gptq_quantize(W, H, bits=4, group_size=32)
    assert qw.g_idx is None
    qw = gptq_quantize(W, H, bits=4, group_size=-1)
    assert tuple(qw.scales.shape) == (1, 16)
    with pytest.raises(ValueError):
        gptq_quantize(W, H, bits=4, group_size=48)


def test_gptq_nonpositive_block_size_is_rejected_not_silently_zero():
    W, X, H = _correlated_problem(out_f=16, in_f=64, n=256)
    with pytest.raises(ValueError, match="block"):
        gptq_quantize(W, H, bits=4, group_size=32, block_size=-1)


# ------------------------------------------------------------------------------------------------
# 3. degenerate Hessians
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_dead_columns_do_not_crash_and_keep_their_weight(act_order):
    W, X, _ = _correlated_problem(out_f=32, in_f=128, n=1024, seed=7)
    dead = [5, 64, 100]
    X[:, dead] = 0.0
    acc = HessianAccumulator(128)
    acc.add(X)
    assert bool((torch.diag(acc.H)[dead] == 0).all())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning expected
        qw = gptq_quantize(W, acc.H, bits=4, group_size=32, sym=False, act_order=act_order)
    deq = qw.dequantize()
    assert torch.isfinite(deq).all() and torch.isfinite(qw.scales.float()).all()
    # a dead column receives no error feedback: it is the original weight to within half a step
    g = qw.group_index()
    for c in dead:
        s = qw.scales[g[c]].float()
        assert bool(((deq[:, c] - W[:, c]).abs() <= 0.55 * s + 1e-6).all()), c
    # and it still helps on the live channels
    assert _out_err(W, X, qw) < 0.9 * _out_err(W, X, quantize_rtn(W, 4, 32))


@pytest.mark.parametrize("act_order", [False, True])
def test_rank_deficient_hessian_with_tiny_damp_is_finite(act_order):
    g = torch.Generator().manual_seed(8)
    W = torch.randn(32, 128, generator=g)
    X = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g)  # rank 16
    acc = HessianAccumulator(128)
    acc.add(X)
    for damp in (1e-12, 1e-8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # may fall back to RTN with a warning; must not crash
            qw = gptq_quantize(W, acc.H, bits=4, group_size=32, act_order=act_order, damp_percent=damp)
        assert torch.isfinite(qw.scales.float()).all() and bool((qw.scales.float() > 0).all())
        assert torch.isfinite(qw.dequantize()).all()
        assert int(qw.qweight.max()) <= 15


def test_indefinite_hessian_warns_and_equals_rtn():
    g = torch.Generator().manual_seed(9)
    W = torch.randn(16, 64, generator=g)
    H = -torch.eye(64)
    with pytest.warns(UserWarning, match="not positive definite"):
        qw = gptq_quantize(W, H, bits=4, group_size=16)
    ref = quantize_rtn(W, 4, 16)
    assert torch.equal(qw.qweight, ref.qweight) and torch.equal(qw.qzeros, ref.qzeros)
    assert torch.equal(qw.scales, ref.scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_hessian_warns_and_falls_back_to_rtn(bad):
    W, X, H = _correlated_problem(out_f=16, in_f=64, n=256, seed=10)
    H = H.clone()
    H[3, 5] = bad
    with pytest.warns(UserWarning, match="non-finite Hessian"):
        qw = gptq_quantize(W, H, bits=4, group_size=16)
    # identity Hessian: no error propagation -> exactly RTN
    ref = quantize_rtn(W, 4, 16)
    assert torch.equal(qw.qweight, ref.qweight) and torch.equal(qw.qzeros, ref.qzeros)
    assert torch.equal(qw.scales, ref.scales)
    with pytest.warns(UserWarning, match="non-finite Hessian"):
        qw = gptq_quantize(W, H, bits=4, group_size=16, act_order=True)
    assert torch.isfinite(qw.dequantize()).all()
    assert torch.equal(torch.bincount(qw.g_idx.long()), torch.full((4,), 16))


# ------------------------------------------------------------------------------------------------
# 4. AWQ
# ------------------------------------------------------------------------------------------------
AWQ_TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
AWQ_CASES = {
    "llama-mha": (transformers.LlamaConfig, dict(num_key_value_heads=4)),  # v->o folds
    "llama-gqa": (transformers.LlamaConfig, dict(num_key_value_heads=2)),  # v->o skipped
    "qwen2-mha-bias": (transformers.Qwen2Config, dict(num_key_value_heads=4)),  # v bias folds too
    "qwen2-gqa": (transformers.Qwen2Config, dict(num_key_value_heads=2)),
}


def _tiny_hf(name):
    cls, extra = AWQ_CASES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**AWQ_TINY, **extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return hf


def _ids():
    return torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", sorted(AWQ_CASES))
def test_awq_scale_folding_by_the_table_keeps_logits(name):
    hf = _tiny_hf(name)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
    mt = hf.config.model_type
    folded = []
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers:
            for grp in SCALING_GROUPS[mt]:
                prev = layer.get_submodule(grp.prev)
                lins = [layer.get_submodule(n) for n in grp.linears]
                width = lins[0].weight.shape[1]
                if grp.needs_same_width and prev.weight.shape[0] != width:
                    continue
                assert prev.weight.shape[0] == width
                s = torch.exp(0.5 * torch.randn(width, generator=g))  # random positive, spread ~[0.2, 5]
                for m in lins:
                    m.weight.mul_(s)  # columns
                prev.weight.div_(s.view(-1, *([1] * (prev.weight.dim() - 1))))  # norm weight or linear rows
                if getattr(prev, "bias", None) is not None:
                    prev.bias.div_(s)
                folded.append(grp.prev)
        out = hf(ids).logits
    kv, heads = hf.config.num_key_value_heads, hf.config.num_attention_heads
    assert ("self_attn.v_proj" in folded) == (kv == heads)
    assert folded.count("mlp.up_proj") == 2 and folded.count("input_layernorm") == 2
    assert _rel(out, ref) <= 1e-5, _rel(out, ref)


@pytest.mark.parametrize("name", ["llama-mha", "qwen2-mha-bias", "qwen2-gqa"])
def test_awq_pipeline_fold_keeps_fp_layer_function(name, monkeypatch):
    """``lite.methods.AWQ`` folds the searched scales into the fp layer: with random scales forced in,
    the (unquantized) model computes the same logits."""
    from lite.methods import AWQ, LayerBatch
    from lite.pipeline import PipelineConfig

    hf = _tiny_hf(name)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
    g = torch.Generator().manual_seed(3)
    calls = []

    def fake_search(weights, x_mean, w_mean, forward, reference, bits, group_size, sym, n_grid=20,
                    duo_scaling=True):
        s = torch.exp(0.5 * torch.randn(weights[0].shape[1], generator=g))
        out = forward([w.float() for w in weights])  # the inspected module still runs
        assert out.shape == reference.shape
        calls.append(weights[0].shape[1])
        return s, 0.5, 0.0

    monkeypatch.setattr(lite.awq, "search_scales", fake_search)
    mt = hf.config.model_type
    cfg = PipelineConfig(method="awq", w_group_size=32, clip=False, device="cpu", n_grid=2)
    method = AWQ(cfg, mt)
    for i, layer in enumerate(hf.model.layers):
        store = []

        def hook(_m, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            store.append((h.detach().clone(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))

        hd = layer.register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            hf(ids, use_cache=False)
        hd.remove()
        qws = method.quantize_layer(layer, LayerBatch([store[0][0]], [store[0][1]], torch.float32))
        assert set(qws) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    kv, heads = hf.config.num_key_value_heads, hf.config.num_attention_heads
    assert len(calls) == 2 * (4 if kv == heads else 3)
    with torch.no_grad():
        out = hf(ids).logits
    assert _rel(out, ref) <= 1e-5, _rel(out, ref)


def _toy_awq(seed=11, out_f=32, in_f=128, n=256):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_f, in_f, generator=g) * 0.05
    x = torch.randn(n, in_f, generator=g)
    x[:, [1, 40, 90]] *= 60.0  # a few channels with huge activations
    return W, x


def _loss_of(W, x, s, gs=32):
    wq = fake_quantize(W * s, 4, gs, False) / s
    return float((x @ wq.t() - x @ W.t()).pow(2).mean())


@pytest.mark.parametrize("duo", [False, True])
def test_search_scales_finite_and_no_worse_than_unscaled(duo):
    W, x = _toy_awq()
    x_mean = activation_scale([x[:100], x[100:]])
    torch.testing.assert_close(x_mean, x.abs().mean(0))
    w_mean = weight_scale([W], 32)
    assert w_mean.shape == (128,) and torch.isfinite(w_mean).all()
    ref = x @ W.t()
    s, alpha, loss = search_scales([W], x_mean, w_mean, lambda ws: x @ ws[0].t(), ref, 4, 32, False, n_grid=20,
                                   duo_scaling=duo)
    assert s.shape == (128,) and torch.isfinite(s).all() and bool((s > 0).all())
    assert 0.0 <= alpha < 1.0
    ones_loss = _loss_of(W, x, torch.ones(128))
    assert loss <= ones_loss
    assert alpha > 0 and loss < 0.9 * ones_loss  # the outlier channels make scaling pay off
    # the reported loss is the loss of the returned scales
    assert loss == pytest.approx(_loss_of(W, x, s), rel=1e-5)


def test_search_scales_all_nonfinite_losses_give_ones_and_warn():
    W, x = _toy_awq()
    ref = x @ W.t()
    with pytest.warns(UserWarning, match="non-finite"):
        s, alpha, loss = search_scales([W], activation_scale([x]), weight_scale([W], 32),
                                       lambda ws: torch.full_like(ref, float("nan")), ref, 4, 32, False, n_grid=5)
    assert torch.equal(s, torch.ones(128))
    assert alpha == -1.0 and loss == float("inf")


def test_search_scales_tolerates_nonfinite_statistics():
    W, x = _toy_awq()
    x_mean = activation_scale([x])
    x_mean[5] = float("nan")
    x_mean[6] = float("inf")
    w_mean = weight_scale([W], 32)
    w_mean[7] = float("nan")
    ref = x @ W.t()
    s, alpha, loss = search_scales([W], x_mean, w_mean, lambda ws: x @ ws[0].t(), ref, 4, 32, False, n_grid=10)
    assert torch.isfinite(s).all() and bool((s > 0).all()) and loss < float("inf")


def test_activation_scale_skips_nonfinite_rows_and_rejects_empty():
    x = torch.ones(4, 8)
    x[1, 2] = float("nan")
    torch.testing.assert_close(activation_scale([x]), torch.ones(8))
    with pytest.raises(ValueError):
        activation_scale([torch.full((3, 8), float("inf"))])


@pytest.mark.parametrize("batch", [64, 256])
def test_search_clip_out_not_divisible_by_batch(batch):
    g = torch.Generator().manual_seed(12)
    W = torch.randn(200, 128, generator=g)
    x = torch.randn(300, 128, generator=g)
    mx = search_clip(W, x, 4, 64, False, n_grid=10, n_tokens=128, batch=batch)
    org = W.abs().view(200, 2, 64).amax(-1)
    assert mx.shape == (200, 2) and torch.isfinite(mx).all()
    assert bool((mx <= org + 1e-6).all()) and bool((mx >= 0.5 * org - 1e-6).all())
    # batching does not change the answer
    other = search_clip(W, x, 4, 64, False, n_grid=10, n_tokens=128, batch=7)
    torch.testing.assert_close(mx, other, rtol=0, atol=0)
    clipped = apply_clip(W, mx, 64)
    assert clipped.shape == W.shape and torch.isfinite(clipped).all()
    assert bool((clipped.abs().view(200, 2, 64).amax(-1) <= mx + 1e-6).all())


def test_search_clip_zero_and_constant_groups_no_nan():
    g = torch.Generator().manual_seed(13)
    W = torch.randn(72, 128, generator=g)
    W[:8] = 0.0  # all-zero rows
    W[10, :64] = 0.0  # one all-zero group
    W[20, 64:] = 0.3  # constant group
    W[21, :64] = -0.7  # constant negative group
    x = torch.randn(200, 128, generator=g)
    x[5] = float("nan")  # a non-finite token is ignored
    for sym in (False, True):
        mx = search_clip(W, x, 4, 64, sym, n_grid=10, batch=64)
        assert mx.shape == (72, 2) and torch.isfinite(mx).all()
        assert bool((mx[:8] == 0).all()) and float(mx[10, 0]) == 0.0
        cw = apply_clip(W, mx, 64)
        assert torch.isfinite(cw).all()
        assert bool((cw[:8] == 0).all()) and bool((cw[10, :64] == 0).all())
        q = fake_quantize(cw, 4, 64, sym)
        assert torch.isfinite(q).all()
    # no finite token at all: the unclipped maxima come back
    mx = search_clip(W, torch.full((10, 128), float("nan")), 4, 64, False)
    torch.testing.assert_close(mx, W.abs().view(72, 2, 64).amax(-1))


def test_search_clip_reduces_error_vs_no_clip():
    g = torch.Generator().manual_seed(14)
    W = torch.randn(64, 128, generator=g)
    W[:, 7] *= 8  # one outlier weight per row makes clipping worthwhile
    x = torch.randn(512, 128, generator=g)
    mx = search_clip(W, x, 4, 32, False, n_grid=20)
    err_clip = float((x @ fake_quantize(apply_clip(W, mx, 32), 4, 32).t() - x @ W.t()).pow(2).mean())
    err_none = float((x @ fake_quantize(W, 4, 32).t() - x @ W.t()).pow(2).mean())
    assert err_clip <= err_none
