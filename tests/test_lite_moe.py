"""``lite`` on Mixture-of-Experts checkpoints (Qwen3-MoE with a dense layer, Qwen2-MoE with a shared expert, OLMoE,
Mixtral): the per-expert block reproduces transformers, rtn/gptq/auto-awq write per-expert checkpoints with 16-bit
routers that transformers loads, the expert rule (experts without calibration tokens) is counted and finite, resume is
exact, a compressed-tensors MoE checkpoint loads in transformers as our own dequantization reads it, and turbo serves
what lite writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from backends import get_backend
from conftest import run_turbo_logits
from lite.formats import KV_CONFIG_FIELD, load_quantized_linears, quantization_spec, quantized_prefixes
from lite.formats.arch import moe_config, unquantized_modules
from lite.formats.registry import weight_format
from lite.layerwise import LazyCheckpoint
from lite.pipeline import PipelineConfig, quantize_model
from lite.rtn import quantize_rtn
from tiny_models import save_word_tokenizer
from turbo.core.model import LlamaModel

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=1, pad_token_id=0,
              tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=32,
                                                     intermediate_size=96, head_dim=16, mlp_only_layers=[1]),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=32,
                                                     intermediate_size=96, shared_expert_intermediate_size=48),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=8, intermediate_size=32),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=8, intermediate_size=32),
}
# group 16: the shared expert's down_proj reads 48 channels
OPTS = dict(calib_samples=8, calib_seqlen=64, w_group_size=16, device="cpu", n_grid=2, loss_tokens=256,
            calib_dataset="c4")
DEAD = 7  # the expert the biased routers never pick


def _build(path: Path, family: str, dead_expert: bool = False, seed: int = 0) -> Path:
    """A random float32 checkpoint of ``family`` with the word tokenizer. ``dead_expert``: every sparse layer's router
    gives expert :data:`DEAD` logit 0 and experts 0/1 and 2/3 opposite rows, so two logits are positive for every
    token and expert 7 is never among the top 2."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        if dead_expert:
            for layer in hf.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is None:
                    continue
                w = gate.weight
                w[1], w[3], w[DEAD] = -w[0], -w[2], 0.0
    hf.save_pretrained(path)
    save_word_tokenizer(path, 128)
    return Path(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-src")
    cache = {}

    def get(family: str, dead_expert: bool = False) -> Path:
        key = (family, dead_expert)
        if key not in cache:
            cache[key] = _build(root / f"{family}{'-dead' if dead_expert else ''}", family, dead_expert)
        return cache[key]
    return get


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _dequantized_checkpoint(ckpt: Path, dest: Path) -> Path:
    """Our quantized checkpoint read back with lite.formats (unpack + dequantize) and written as a float32 per-expert
    checkpoint with the source's config (what transformers loads as a plain model)."""
    config = _config(ckpt)
    sd = load_file(str(ckpt / "model.safetensors"))
    for p, qw in load_quantized_linears(sd, quantization_spec(config)).items():
        sd[f"{p}.weight"] = qw.dequantize(torch.float32)
        if qw.bias is not None:
            sd[f"{p}.bias"] = qw.bias
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in sd.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    return dest


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits[0]


IDS = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))


# --- (a) the per-expert block is transformers' sparse block --------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_expert_block_matches_transformers(family, sources):
    src = sources(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    outs = []
    hooks = [layer.register_forward_hook(lambda _m, _a, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in hf.model.layers]
    with torch.no_grad():
        hf(IDS)
    for h in hooks:
        h.remove()

    lazy = LazyCheckpoint(src, torch.device("cpu"))
    lazy.check_shapes()  # every parameter name is the checkpoint's per-expert name
    moe = moe_config(_config(src))
    names = {n for n, _ in lazy.model.named_parameters()}
    for i, sparse in enumerate(moe.sparse):
        layer = lazy.layers[i]
        if sparse:
            assert layer.mlp is layer.get_submodule(moe.spec.block)
            g, u, d = moe.expert(5)
            assert {f"model.layers.{i}.{n}.weight" for n in (g, u, d, moe.router)} <= names
        else:
            assert f"model.layers.{i}.mlp.gate_proj.weight" in names
    assert len(names) == len(list(lazy.model.named_parameters()))  # the Mixtral alias adds no second copy
    inps, kws = lazy.capture_inputs([IDS])
    h = inps[0]
    for i, layer in enumerate(lazy.layers):
        lazy.materialize(layer, f"model.layers.{i}")
        with torch.no_grad():
            h = layer(h, **kws[0])
        torch.testing.assert_close(h, outs[i], rtol=1e-5, atol=1e-6)
        lazy.release(layer)


def test_router_weights_dtype_follows_the_family():
    """Mixtral multiplies the experts' outputs by float32 routing weights; the others cast them to the logits'
    dtype first (transformers' routers)."""
    from lite.moe import SparseMoeBlock

    for family, fp32 in (("mixtral", True), ("qwen3_moe", False)):
        cfg = FAMILIES[family]().to_dict()
        block = SparseMoeBlock(moe_config(dict(cfg, model_type=family)), 64).to(torch.bfloat16)
        w, ids = block.route(torch.randn(5, 64, dtype=torch.bfloat16))
        assert w.dtype == (torch.float32 if fp32 else torch.bfloat16) and ids.shape == (5, 2)


# --- (b) every method writes a per-expert checkpoint that transformers loads -----------------------------------------
@pytest.fixture(scope="module")
def outputs(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-out")
    cache = {}

    def get(family: str, method: str) -> Path:
        if (family, method) not in cache:
            cache[family, method] = quantize_model(str(sources(family)), PipelineConfig(method=method, **OPTS),
                                                   str(root / f"{family}-{method}"))
        return cache[family, method]
    return get


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_methods_write_per_expert_checkpoints(family, method, sources, outputs, tmp_path):
    src = sources(family)
    out = outputs(family, method)
    config = _config(out)
    qc = config["quantization_config"]
    spec = quantization_spec(config)
    fmt = weight_format(PipelineConfig(method=method, **OPTS).out_format)
    tensors = load_file(str(out / "model.safetensors"))
    moe = moe_config(config)
    prefixes = set(quantized_prefixes(tensors, spec))
    for i, sparse in enumerate(moe.sparse):
        p = f"model.layers.{i}"
        mlps = ([moe.expert(e) for e in range(moe.num_experts)] + ([moe.shared] if moe.shared else [])
                if sparse else [("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")])
        for n in [x for t in mlps for x in t] + ["self_attn.q_proj", "self_attn.o_proj"]:
            assert f"{p}.{n}" in prefixes and f"{p}.{n}.weight" not in tensors, n
        for n in moe.unquantized(i):  # routers and the shared-expert gate: 16-bit, as stored
            assert tensors[f"{p}.{n}.weight"].dtype == torch.float32 and f"{p}.{n}" not in prefixes, n
            assert not any(k.startswith(f"{p}.{n}.") and k != f"{p}.{n}.weight" for k in tensors)
    assert len(prefixes) == sum(4 + (3 * (moe.num_experts + bool(moe.shared)) if s else 3) for s in moe.sparse)
    assert all(torch.isfinite(v).all() for v in tensors.values() if v.is_floating_point())
    # the routers are marked as not quantized where each format says so
    routers = unquantized_modules(config)
    if fmt.name == "awq":
        assert qc["modules_to_not_convert"] == list(routers) and routers
    elif fmt.name == "compressed-tensors":
        names = {r.split(".", 3)[3] for r in routers}
        assert qc["ignore"][0] == "lm_head"
        assert set(qc["ignore"][1:]) == {r"re:.*\." + n.replace(".", r"\.") + "$" for n in names}
    report = json.loads((out / "liteturbo_quantize.json").read_text())
    assert report["experts_total"] == moe.num_experts * sum(moe.sparse)
    if method == "rtn":
        assert report["experts_rtn_fallback"] is None
    else:
        assert 0 <= report["experts_without_tokens"] <= report["experts_rtn_fallback"] < report["experts_total"]
    # read back with lite.formats, the checkpoint is the source model within 4-bit error
    ref = _logits(src, IDS)
    got = _logits(_dequantized_checkpoint(out, tmp_path / "deq"), IDS)
    assert torch.isfinite(got).all()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.3, rel
    # and turbo reads the checkpoint itself as lite.formats does
    model = LlamaModel.from_pretrained(out, get_backend("torch"), torch.float32)
    ids = IDS[0].tolist()
    served = run_turbo_logits(model, [ids[:24], ids[24:]])
    assert float((served - got).abs().max() / got.abs().max()) <= 1e-4


def test_awq_scales_routers_with_the_norm_they_read(sources):
    """Folding the post-attention norm's scales leaves a sparse layer's float output unchanged: the router and the
    shared-expert gate (never quantized) are scaled with every expert's gate/up."""
    from lite.methods import AWQ, LayerBatch

    src = sources("qwen2_moe")
    lazy = LazyCheckpoint(src, torch.device("cpu"))
    inps, kws = lazy.capture_inputs([IDS])
    layer = lazy.layers[0]
    lazy.materialize(layer, "model.layers.0")
    batch = LayerBatch(inps, kws, torch.float32)
    before = batch.run(layer)[0]
    method = AWQ(PipelineConfig(method="awq", **OPTS), _config(src))
    method._round = lambda *a, **k: {}  # keep the scaled float weights
    method.quantize_layer(layer, batch)
    norm = layer.post_attention_layernorm.weight
    assert not torch.allclose(norm, lazy.tensor("model.layers.0.post_attention_layernorm.weight"))  # it did scale
    torch.testing.assert_close(batch.run(layer)[0], before, rtol=1e-4, atol=1e-5)


def test_gptq_hessians_in_chunks_give_the_same_checkpoint(sources, outputs, tmp_path, monkeypatch):
    """Gathering the experts' Hessians a few experts per forward (a memory bound) changes nothing: an expert's
    inputs depend on the router and its own linears only."""
    import lite.methods

    monkeypatch.setattr(lite.methods, "HESSIAN_BYTES", 3 * 4 * 64 * 64)  # three experts' gate Hessians per forward
    out = quantize_model(str(sources("qwen2_moe")), PipelineConfig(method="gptq", **OPTS), str(tmp_path / "chunked"))
    a = load_file(str(outputs("qwen2_moe", "gptq") / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- (c) the expert rule ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,method", [("mixtral", "gptq"), ("qwen2_moe", "awq")])
def test_expert_without_tokens_takes_the_rtn_rule(family, method, sources, tmp_path):
    src = sources(family, dead_expert=True)
    cfg = PipelineConfig(method=method, **OPTS)
    out = quantize_model(str(src), cfg, str(tmp_path / "q"))
    report = json.loads((out / "liteturbo_quantize.json").read_text())
    moe = moe_config(_config(out))
    n_sparse = sum(moe.sparse)
    assert report["experts_without_tokens"] == n_sparse  # expert 7 of each sparse layer, and no other
    assert n_sparse <= report["experts_rtn_fallback"] < report["experts_total"]
    rule = [n for n in report["notes"] if "experts_rtn_fallback" in n]
    assert [n["layer"] for n in rule] == [i for i, s in enumerate(moe.sparse) if s]
    for n in rule:
        assert n["experts_without_tokens"] == [DEAD] and DEAD in n["experts_rtn_fallback"]
        assert n["routed_tokens"][str(DEAD)] == 0 and n["threshold"] == report["expert_token_threshold"] >= 1
    fmt = weight_format(cfg.out_format)
    tensors = load_file(str(out / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    spec = quantization_spec(_config(out))
    for i in [i for i, s in enumerate(moe.sparse) if s]:
        gate, up, down = (f"model.layers.{i}.{n}" for n in moe.expert(DEAD))
        qws = load_quantized_linears({k: v for k, v in tensors.items() if k.startswith(f"model.layers.{i}.")}, spec)
        for p in (gate, up, down):
            assert torch.isfinite(qws[p].scales.float()).all() and float(qws[p].scales.float().abs().min()) > 0
        # no scaling of its up -> down pair, no clipping, no GPTQ: its down_proj is RTN of its own weight (with GPTQ,
        # which scales no norm group, its gate/up too)
        for p in (down,) if method == "awq" else (gate, up, down):
            rtn = quantize_rtn(source[f"{p}.weight"], 4, OPTS["w_group_size"], bool(cfg.w_sym),
                               min_zero=fmt.min_zero(bool(cfg.w_sym)))
            torch.testing.assert_close(qws[p].dequantize(torch.float32), rtn.dequantize(torch.float32), rtol=0, atol=0)


# --- (d) resume -------------------------------------------------------------------------------------------------------
def test_resume_after_interrupt_is_identical(sources, outputs, tmp_path):
    src = sources("qwen2_moe")
    cfg = PipelineConfig(method="gptq", **OPTS)
    work = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(src), cfg, str(work), stop_after_layers=1)
    assert (tmp_path / "resumed.partial" / "layer_0000.safetensors").is_file()
    out = quantize_model(str(src), cfg, str(work), resume=True)
    full, resumed = outputs("qwen2_moe", "gptq"), out
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ra, rb = (json.loads((d / "liteturbo_quantize.json").read_text()) for d in (full, resumed))
    assert rb["reused_layers"] == 1
    for key in ("experts_without_tokens", "experts_rtn_fallback", "expert_token_threshold", "notes"):
        assert ra[key] == rb[key], key


# --- (e) compressed-tensors: transformers reads our MoE checkpoint as we do -----------------------------------------
def test_compressed_tensors_moe_checkpoint_loads_in_transformers(sources, tmp_path):
    pytest.importorskip("compressed_tensors")
    src = sources("qwen2_moe")
    # symmetric: transformers 5.25 passes no zero points to its per-expert decompression (asymmetric experts fail
    # there, and it sizes dense asymmetric zero points unpacked), so only symmetric MoE checkpoints load in it
    cfg = PipelineConfig(method="gptq", out_format="compressed-tensors", w_sym=True, **OPTS)
    out = quantize_model(str(src), cfg, str(tmp_path / "ct"))
    ours = _logits(_dequantized_checkpoint(out, tmp_path / "deq"), IDS)
    theirs = _logits(out, IDS)
    torch.testing.assert_close(theirs, ours, rtol=1e-3, atol=1e-4)


# --- the rest of the run kit on MoE layers: rotation, calibrate-kv --------------------------------------------------
def test_rotation_of_a_sparse_layer_keeps_its_function(sources):
    """A residual rotation folded into a sparse layer (every expert, the shared expert, the router and its gate read
    the rotated norm output) maps rotated inputs to rotated outputs: routing is unchanged."""
    from lite.methods import LayerBatch
    from lite.rotation import ResidualRotation

    src = sources("qwen2_moe")
    lazy = LazyCheckpoint(src, torch.device("cpu"))
    inps, kws = lazy.capture_inputs([IDS])
    layer = lazy.layers[0]
    lazy.materialize(layer, "model.layers.0")
    before = LayerBatch(inps, kws).run(layer)[0]
    rot = ResidualRotation(64, _config(src), seed=3)
    rot.fold_layer(layer, 0)
    after = LayerBatch([rot.rotate_inputs(inps[0])], kws).run(layer)[0]
    torch.testing.assert_close(after, rot.rotate_inputs(before), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_kv_calibration_reads_moe_attention(family, sources):
    """layer_qkv's q/k/v (OLMoE: q/k norm over all heads; Qwen3-MoE: per head) give the layer's own attention."""
    from lite.formats.arch import arch_spec
    from lite.kv_calibration import _attend, layer_qkv

    src = sources(family)
    spec = arch_spec(_config(src))
    lazy = LazyCheckpoint(src, torch.device("cpu"))
    inps, kws = lazy.capture_inputs([IDS])
    layer = lazy.layers[0]
    lazy.materialize(layer, "model.layers.0")
    with torch.no_grad():
        q, k, v = layer_qkv(layer, inps[0], kws[0], spec.qk_norm, spec.qk_norm_per_head)
        ours = layer.self_attn.o_proj(_attend(q, k, v).transpose(0, 1).reshape(1, q.shape[0], -1))
        theirs = layer.self_attn(layer.input_layernorm(inps[0]), **kws[0])[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_calibrate_kv_on_a_w4a16_moe_checkpoint(outputs, tmp_path):
    from lite.kv_calibration import KVCalibConfig, calibrate_kv

    out = calibrate_kv(str(outputs("qwen2_moe", "awq")), KVCalibConfig(calib_samples=4, calib_seqlen=32,
                                                                        search_windows=2, device="cpu",
                                                                        calib_dataset="c4"), str(tmp_path / "kv"))
    assert KV_CONFIG_FIELD in _config(out)
