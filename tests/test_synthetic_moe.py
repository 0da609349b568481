"""The Mixture-of-Experts sizes of bench/synthetic.py on its tiny sizes, in seconds.

The published-size table is checked against the model cards' parameter counts; the tiny MoE checkpoint's tensor names
and shapes against those transformers' own model of the same config writes (``save_pretrained``), and it runs in
transformers; the directly written W4A16 checkpoint dequantizes to ``lite.rtn``'s round-to-nearest of the seeded bf16
weights (within the RTN step); the vectorised Q4_0 / Q8_0 packers give the bytes of ``gguf.quants`` (and of ggml's own
quantizer when llama-cpp-python is here); the directly written Q4_0 GGUF has llama.cpp's MoE names, types and metadata
(and, in the e2e tier, runs in llama.cpp).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load_bench_module(name: str):
    """bench/<name>.py as a module, without putting bench/ on sys.path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


synthetic = _load_bench_module("synthetic")

# total parameters (model cards / the GGUF pages) and active parameters as published (embedding table included)
PUBLISHED = {"olmoe": (6.92e9, 1.3e9), "qwen3-30b-a3b": (30.5e9, 3.3e9)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder of synthetic checkpoints (never $LITETURBO_HOME)."""
    from lite.formats import LiteturboError

    try:
        synthetic.smollm2_tokenizer_dir()
    except LiteturboError as e:
        pytest.skip(str(e))
    return tmp_path_factory.mktemp("synthetic_moe")


@pytest.mark.parametrize("size", sorted(PUBLISHED))
def test_published_moe_parameter_counts(size):
    cfg = synthetic.SIZES[size]
    total, active = PUBLISHED[size]
    assert abs(cfg.num_parameters("native") - total) / total < 0.01
    # the published "active" figures count the whole embedding table; active_parameters counts one row
    table = cfg.vocab_size * cfg.hidden_size - cfg.hidden_size
    assert abs(cfg.active_parameters("native") + table - active) / active < 0.03


def test_published_moe_shapes():
    s = synthetic.SIZES
    olmoe, qwen = s["olmoe"], s["qwen3-30b-a3b"]
    assert (olmoe.num_experts, olmoe.num_experts_per_tok, olmoe.moe_intermediate_size, olmoe.norm_topk_prob) == \
        (64, 8, 1024, False)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob) == \
        (128, 8, 768, True)
    o, q = olmoe.tensor_shapes(), qwen.tensor_shapes()
    assert o["model.layers.0.self_attn.q_norm.weight"] == (2048,) and o["model.layers.0.self_attn.k_norm.weight"] == (2048,)
    assert q["model.layers.0.self_attn.q_norm.weight"] == (128,) and q["model.layers.47.self_attn.k_norm.weight"] == (128,)
    assert o["model.layers.15.mlp.gate.weight"] == (64, 2048) and q["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert q["model.layers.3.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert o["model.layers.3.mlp.experts.63.up_proj.weight"] == (1024, 2048)
    assert "lm_head.weight" in o and "lm_head.weight" in q
    c = qwen.hf_config("native", 1, 2)
    assert (c["num_experts"], c["moe_intermediate_size"], c["intermediate_size"], c["decoder_sparse_step"],
            c["mlp_only_layers"], c["vocab_size"], c["rope_theta"]) == (128, 768, 6144, 1, [], 151936, 1e6)
    c = olmoe.hf_config("native", 1, 2)
    assert (c["model_type"], c["intermediate_size"], c["vocab_size"], c["rms_norm_eps"]) == ("olmoe", 1024, 50304, 1e-5)
    # the truncated variant keeps the per-layer shapes
    cut = qwen.truncated(2)
    assert cut.num_hidden_layers == 2 and cut.layer_shapes(1) == qwen.layer_shapes(1)


def test_bf16_of_the_30b_is_refused_without_allow_large(tmp_path):
    with pytest.raises(SystemExit, match="allow-large"):
        synthetic.write_checkpoint("qwen3-30b-a3b", tmp_path / "x")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("size", ["tiny-moe", "tiny-olmoe"])
def test_names_and_shapes_are_those_transformers_saves(tmp_path, size):
    """transformers' own model of the same config, saved with save_pretrained: the same tensor names and shapes."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = synthetic.SIZES[size]
    hf = cfg.hf_config("smollm2", 1, 2)
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            saved.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    assert saved == cfg.tensor_shapes("smollm2")


def test_tiny_moe_checkpoint_runs_in_transformers(cache):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckpt = synthetic.ensure_checkpoint("tiny-moe", "smollm2", 0, cache, quiet=True)
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 16, 4)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(synthetic.SIZES["tiny-moe"].tensor_shapes("smollm2"))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    with safe_open(str(ckpt / index[name]), "pt") as f:
        ref = f.get_tensor(name).float()
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[5], ref)  # per-expert names read (and fused)
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 200, 3000, 49151]])).logits
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()


def test_w4a16_round_trip(cache):
    """Every decoder linear (attention and each expert) quantized and packed as `lite rtn` does; dequantized, it is
    lite.rtn's quantize-dequantize of the seeded bf16 weight, within the RTN step; routers/norms/embeddings bf16."""
    from safetensors import safe_open

    from lite.formats import awq_quantization_config, unpack_awq
    from lite.rtn import fake_quantize

    cfg = synthetic.SIZES["tiny-moe"]
    w4 = synthetic.ensure_w4a16("tiny-moe", "smollm2", 0, cache, 128, quiet=True)
    config = json.loads((w4 / "config.json").read_text())
    qc = dict(config["quantization_config"])
    routers = qc.pop("modules_to_not_convert", None)  # named by lite versions whose AWQ config lists them
    assert qc == awq_quantization_config(4, 128, True)
    assert routers in (None, ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"])
    assert (w4 / "tokenizer.json").is_file() and (w4 / "liteturbo_quantize.json").is_file()
    shapes = cfg.tensor_shapes("smollm2")
    linears = [m for i in range(cfg.num_hidden_layers) for m in cfg.quantized_linears(i)]
    assert len(linears) == 2 * (4 + 16 * 3)
    with safe_open(str(w4 / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for m in linears:
            assert f"{m}.weight" not in keys and {f"{m}.qweight", f"{m}.qzeros", f"{m}.scales"} <= keys
        for n in ("model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.q_norm.weight",
                  "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            t = f.get_tensor(n)
            assert t.dtype == torch.bfloat16 and torch.equal(t, synthetic._random(n, shapes[n], 0)), n
        for m in linears[:4] + linears[4::13]:  # attention and a spread of expert projections
            qw = unpack_awq(f.get_tensor(f"{m}.qweight"), f.get_tensor(f"{m}.qzeros"), f.get_tensor(f"{m}.scales"),
                            4, 128, True)
            w = synthetic._random(f"{m}.weight", shapes[f"{m}.weight"], 0).float()
            deq = qw.dequantize(torch.float32)
            assert torch.equal(deq, fake_quantize(w, 4, 128)), m
            step = qw.scales.float().t().repeat_interleave(128, 1)
            err = (deq - w).abs() / step
            assert err.max() <= 1.0 and err.mean() < 0.3, (m, err.max(), err.mean())


def test_truncated_w4a16_keeps_the_first_layers(cache):
    from safetensors import safe_open

    full = synthetic.ensure_w4a16("tiny-moe", "smollm2", 0, cache, 128, quiet=True)
    cut = synthetic.ensure_w4a16("tiny-moe", "smollm2", 0, cache, 128, layers=1, quiet=True)
    assert cut.name == "tiny-moe-L1-smollm2-s0-w4a16-g128"
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 1
    with safe_open(str(full / "model.safetensors"), "pt") as a, safe_open(str(cut / "model.safetensors"), "pt") as b:
        assert not any(k.startswith("model.layers.1.") for k in b.keys())
        for k in b.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def _q4_0_case() -> torch.Tensor:
    torch.manual_seed(0)
    x = (torch.randn(8, 256) * 0.02).to(torch.bfloat16).float()
    x[0, :32] = 0.0  # an all-zero block
    x[1, 3], x[1, 9] = 0.05, -0.05  # equal magnitudes of both signs: the first wins
    x[2, 1], x[2, 20] = -0.06, 0.06
    x[3, 40] = 1.0  # an outlier
    return x


def test_q4_0_packer_matches_gguf_quants():
    gguf = pytest.importorskip("gguf")
    import numpy as np

    x = _q4_0_case()
    try:
        ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q4_0)
    except NotImplementedError:
        pytest.skip("this gguf package has no Q4_0 quantizer")
    got = synthetic.quantize_q4_0(x)
    assert got.shape == (8, 256 // 32 * 18) and np.array_equal(got.numpy(), ref)
    deq = synthetic.dequantize_q4_0(got, 256)
    assert np.allclose(deq.numpy(), gguf.quants.dequantize(ref, gguf.GGMLQuantizationType.Q4_0))
    q8 = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(synthetic.quantize_q8_0(x).numpy(), q8)
    # stacked [experts, out, in] tensors quantize row by row
    st = x.reshape(2, 4, 256)
    assert torch.equal(synthetic.quantize_q4_0(st).reshape(8, -1), got)


def test_q4_0_packer_matches_ggml():
    """ggml's own C quantizer (llama-cpp-python's library), when installed."""
    import gguf
    import numpy as np

    if synthetic._ggml_library() is None:
        pytest.skip("llama-cpp-python (its ggml library) is not installed")
    x = _q4_0_case()
    for qtype, fn in ((gguf.GGMLQuantizationType.Q4_0, synthetic.quantize_q4_0),
                      (gguf.GGMLQuantizationType.Q8_0, synthetic.quantize_q8_0)):
        assert np.array_equal(fn(x).numpy(), synthetic.ggml_quantize(x.numpy(), qtype)), qtype.name


def test_q4_0_gguf_direct_has_llama_cpp_moe_layout(cache):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = synthetic.ensure_q4_0_direct("tiny-moe", "smollm2", 0, cache, quiet=True)
    assert path == synthetic.gguf_path(cache / "tiny-moe-smollm2-s0", "q4_0")  # where ensure_q4_0 looks
    reader = gguf.GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe"
    assert (field("qwen3moe.expert_count"), field("qwen3moe.expert_used_count"),
            field("qwen3moe.expert_feed_forward_length"), field("qwen3moe.block_count")) == (16, 4, 128, 2)
    assert field("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert len(field("tokenizer.ggml.tokens")) == 49152
    t = {x.name: x for x in reader.tensors}
    T = gguf.GGMLQuantizationType
    shape = lambda n: tuple(int(d) for d in reversed(t[n].shape))  # noqa: E731 - torch order
    assert set(t) == {g for g, _, _ in synthetic.gguf_plan(synthetic.SIZES["tiny-moe"].tensor_shapes("smollm2"),
                                                           "qwen3_moe", 2)}
    for i in range(2):
        for p in ("gate", "up", "down"):
            assert t[f"blk.{i}.ffn_{p}_exps.weight"].tensor_type == T.Q4_0
        assert shape(f"blk.{i}.ffn_gate_exps.weight") == (16, 128, 128)
        assert shape(f"blk.{i}.ffn_gate_inp.weight") == (16, 128) and t[f"blk.{i}.ffn_gate_inp.weight"].tensor_type == T.F32
        for n in ("attn_q_norm", "attn_k_norm", "attn_norm", "ffn_norm"):
            assert t[f"blk.{i}.{n}.weight"].tensor_type == T.F32
        assert shape(f"blk.{i}.attn_q_norm.weight") == (32,)
        assert t[f"blk.{i}.attn_q.weight"].tensor_type == T.Q4_0
    assert t["token_embd.weight"].tensor_type == T.Q4_0
    assert t["output.weight"].tensor_type == T.Q8_0  # hidden 128: Q6_K's 256-value blocks do not fit, as llama.cpp
    # expert 7's down projection of layer 1: the Q4_0 of the seeded bf16 weight, in the stack's slot 7
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    ref = synthetic.quantize_q4_0(synthetic._random(name, (128, 128), 0))
    assert np.array_equal(np.asarray(t["blk.1.ffn_down_exps.weight"].data)[7], ref.numpy())


@pytest.mark.e2e
def test_q4_0_gguf_direct_runs_in_llama_cpp(cache):
    pytest.importorskip("llama_cpp")
    import numpy as np
    from llama_cpp import Llama

    path = synthetic.ensure_q4_0_direct("tiny-moe", "smollm2", 0, cache, quiet=True)
    llm = Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval([1, 200, 3000, 49151])
    logits = np.array(llm.scores[:4])
    assert logits.shape == (4, 49152) and np.isfinite(logits).all() and logits.std() > 0
