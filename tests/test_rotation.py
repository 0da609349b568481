"""The residual rotation (:mod:`lite.rotation`): the float model computes the same logits after it (float32, ≤ 1e-5
relative), and a rotated W4A16 checkpoint is a standard one: transformers' own Llama code, given its dequantized
weights, computes what turbo computes."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from backends import get_backend
from conftest import run_turbo_logits
from lite.formats import load_config, load_quantized_linears, load_state_dict, quantization_spec
from lite.pipeline import PipelineConfig, quantize_model
from lite.rotation import ResidualRotation, random_rotation
from turbo.core.model import LlamaModel

CASES = {
    "llama-tied-hadamard": (transformers.LlamaConfig, dict(hidden_size=64, num_key_value_heads=2,
                                                           tie_word_embeddings=True, attention_bias=True)),
    "llama-qr": (transformers.LlamaConfig, dict(hidden_size=48, num_key_value_heads=4)),
    "mistral": (transformers.MistralConfig, dict(hidden_size=64, num_key_value_heads=2)),
    "qwen2-bias": (transformers.Qwen2Config, dict(hidden_size=64, num_key_value_heads=2)),
    "qwen3-qk-norm": (transformers.Qwen3Config, dict(hidden_size=64, num_key_value_heads=2, head_dim=16,
                                                     tie_word_embeddings=True)),
}
BASE = dict(vocab_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, rms_norm_eps=1e-5)


@pytest.mark.parametrize("n", [8, 48, 64, 576])
def test_random_rotation_is_orthogonal_and_seeded(n):
    q = random_rotation(n, seed=3)
    torch.testing.assert_close(q @ q.t(), torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, random_rotation(n, seed=3)) and not torch.equal(q, random_rotation(n, seed=4))
    if n & (n - 1) == 0:  # randomized Hadamard: every entry ±1/sqrt(n)
        torch.testing.assert_close(q.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotation_leaves_the_float_model_unchanged(name):
    cls, extra = CASES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**BASE, **extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    e0 = hf.model.embed_tokens.weight.data.clone()
    rot = ResidualRotation(hf.config.hidden_size, hf.config.model_type, seed=5)
    for layer in hf.model.layers:
        rot.fold_layer(layer)
    embed, head, norm = rot.fold_outside(hf.model.embed_tokens.weight.data, hf.lm_head.weight.data,
                                         hf.model.norm.weight.data)
    hf.model.embed_tokens.weight = torch.nn.Parameter(embed)
    hf.lm_head.weight = torch.nn.Parameter(head)  # untied
    hf.model.norm.weight = torch.nn.Parameter(norm)
    for layer in hf.model.layers:
        assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    with torch.no_grad():
        out = hf(ids).logits
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-5, rel
    # and the rotation did change the weights (the residual's channels are mixed), norms alone would not
    assert float((embed - e0).abs().max()) > 0.1 * float(e0.abs().max())
    torch.testing.assert_close(embed.double().norm(dim=1), e0.double().norm(dim=1))  # rows keep their length


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_rotated_checkpoint_is_standard_llama_and_matches_turbo(method, tmp_path, smollm2_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    src = tmp_path / "src"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_path / name, src / name)
    out = quantize_model(str(src), PipelineConfig(method=method, rotate=True, w_group_size=32, calib_samples=4,
                                                  calib_seqlen=64, n_grid=4, loss_tokens=128, device="cpu"),
                         str(tmp_path / "rot"))
    config = load_config(out)
    assert config["tie_word_embeddings"] is False
    sd = load_state_dict(out)
    assert "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    # transformers' own Llama, built from the config without quantization_config, given the dequantized weights
    for p, qw in load_quantized_linears(sd, quantization_spec(config)).items():
        sd[f"{p}.weight"] = qw.dequantize(torch.float64)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**plain)).double().eval()
    hf.load_state_dict({k: v.double() for k, v in sd.items()}, strict=True)
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = run_turbo_logits(LlamaModel.from_pretrained(out, get_backend("torch"), torch.float32), [ids])
    assert float((got.double() - ref).abs().max() / ref.abs().max()) <= 1e-4
    # still (roughly) the source model: the rotation changed nothing but the rounding
    fp = run_turbo_logits(LlamaModel.from_pretrained(src, get_backend("torch"), torch.float32), [ids])
    assert float((got - fp).abs().max() / fp.abs().max()) < 0.5
    info = json.loads((out / "liteturbo_quantize.json").read_text())
    assert info["options"]["rotate"] is True
