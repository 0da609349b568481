"""The engine on tiny Mixture-of-Experts models: a batch equals each request alone, a session's cached turn equals a
fresh prefill of its whole history, a speculative request equals plain decoding, tensor parallelism at 2 ranks
equals 1 (experts split on their intermediate features), and the planner counts every expert exactly as the model
holds them (dense and W4A16) and the selected ones for a decode step."""
from __future__ import annotations

import pytest
import torch

from backends import TorchBackend
from lite.formats import load_config
from turbo import Engine, EngineConfig, GenerationConfig
from turbo.core import planner
from turbo.core.model import ModelConfig

from test_moe_model import build_tiny_moe, quantize_tiny
from tiny_models import save_word_tokenizer

OPTS = dict(dtype="float32", max_kv_tokens=1024, block_size=8, max_num_batched_tokens=24)
PROMPTS = [[5, 17, 9, 33, 2, 41, 7, 19, 23, 11, 3, 29, 31, 13, 37, 8, 12, 50, 60, 70, 80, 90, 100, 110, 120, 4],
           [44, 45, 46], [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name in ("qwen2_moe", "qwen3_moe"):
        p = root / name
        build_tiny_moe(p, name)
        save_word_tokenizer(p, 128, bos=True)
        out[name] = p
    src = root / "olmoe-src"
    build_tiny_moe(src, "olmoe")
    quantize_tiny(src, root / "olmoe-w4")
    save_word_tokenizer(root / "olmoe-w4", 128, bos=True)
    out["olmoe-w4"] = root / "olmoe-w4"
    return out


def _greedy(engine, prompts, n: int = 8) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, max_new_tokens=n, ignore_eos=True)]


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe-w4"])
def test_batch_equals_each_request_alone(moe_models, name):
    engine = Engine(moe_models[name], **OPTS)
    together = _greedy(engine, PROMPTS)
    alone = [_greedy(engine, [p])[0] for p in PROMPTS]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # not a degenerate model


def test_session_cached_turn_equals_fresh_prefill(moe_models):
    engine = Engine(moe_models["qwen3_moe"], **OPTS, enable_prefix_caching=False)
    cached, fresh = engine.session(), engine.session()
    first = cached.chat("the of and to", max_new_tokens=6)
    second = cached.chat("in a is that", max_new_tokens=6)
    assert cached.last.cached_tokens > 0  # the second turn prefilled only its new tokens
    assert fresh.chat("the of and to", max_new_tokens=6) == first
    assert engine.evict_idle(fresh.seq)  # its KV freed: the next turn prefills the whole history
    assert fresh.chat("in a is that", max_new_tokens=6) == second
    assert fresh.last.cached_tokens == 0


def test_speculative_request_equals_plain(moe_models):
    engine = Engine(moe_models["qwen2_moe"], **OPTS)
    prompt = [7, 8, 9, 10, 11, 12] * 6
    before = engine.counters.as_dict()["spec_steps"]
    spec = engine.generate(prompt, GenerationConfig(max_new_tokens=16, ignore_eos=True, speculative=4))
    assert engine.counters.as_dict()["spec_steps"] > before
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=16, ignore_eos=True))
    assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe-w4"])
def test_planner_counts_every_expert(moe_models, name):
    engine = Engine(moe_models[name], **OPTS)
    raw = load_config(engine.path)
    cfg = ModelConfig.from_dict(raw)
    wc = planner.weight_choice(engine.path, raw, engine.model.lm_head.quantized == "w8a16")
    want = planner.weight_breakdown(cfg, type(engine.backend), "cpu", engine.dtype, wc)
    got = engine.model.memory_breakdown()
    assert got == want
    assert got["experts"] > 0 and got["routers"] == sum(cfg.moe.sparse) * (  # float32 routers, float32 engine
        cfg.moe.num_experts + bool(cfg.moe.shared_intermediate_size)) * cfg.hidden_size * 4
    # one decode step reads the top-k experts of every sparse layer and the shared expert, not all of them
    read = planner.decode_weight_bytes(cfg, TorchBackend, "cpu", engine.dtype, wc)
    layers, moe = sum(cfg.moe.sparse), cfg.moe
    experts = [l.experts for l in engine.model.layers if l.sparse]
    one = sum(t.untyped_storage().nbytes() for h in (experts[0].gate_up[0], experts[0].down[0])
              for t in planner_tensors(h))
    shared = (got["experts"] - layers * moe.num_experts * one) // layers
    assert read["experts"] == layers * (moe.top_k * one + shared)


def planner_tensors(handle):
    from turbo.core.model import _tensors

    return list(_tensors(handle))


def test_tp2_equals_tp1(moe_models):
    for name in ("qwen2_moe", "olmoe-w4"):
        if name == "olmoe-w4":  # OLMoE's q/k norm over all heads does not split: refused before loading
            with pytest.raises(Exception, match="q/k norm"):
                Engine(moe_models[name], **OPTS, tensor_parallel_size=2)
            continue
        ref = _greedy(Engine(moe_models[name], **OPTS), PROMPTS)
        engine = Engine(moe_models[name], **OPTS, tensor_parallel_size=2)
        try:
            got = _greedy(engine, PROMPTS)
        finally:
            engine.close()
        assert got == ref, name


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False}


def test_plan_counts_qwen3_30b_a3b_as_its_model_card(tmp_path):
    """30.5 B parameters, 3.3 B active (the model card's figures); memory for every expert, decode reads top-8."""
    import json

    from turbo.plan import plan_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    p, _ = plan_checkpoint(str(tmp_path), gpu_mem="24GiB", device="cpu", dtype="bfloat16", w_bits=4, w_group_size=128,
                           session_len=4096)
    assert abs(p.moe["total_parameters"] / 30.5e9 - 1) < 0.01 and abs(p.moe["active_parameters"] / 3.3e9 - 1) < 0.03
    assert 14 * 2**30 < p.weights["experts"] < 15 * 2**30  # 4-bit codes + group scales of 128 x 48 experts
    read = sum(p.decode_weights.values())
    assert 1.4 * 2**30 < read < 1.9 * 2**30 and p.fits
