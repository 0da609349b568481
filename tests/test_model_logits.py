"""turbo's float32 logits vs transformers' own forward (the independent reference)."""
from __future__ import annotations

import pytest
import torch
import transformers

from backends import get_backend
from turbo.core.model import LlamaModel

from conftest import run_turbo_logits

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

CASES = {
    "llama-gqa-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-untied-bias": (transformers.LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "llama3-rope-scaling": (transformers.LlamaConfig, dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2-qkv-bias-untied": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen2-tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3-qk-norm": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, tie_word_embeddings=False)),
}


def _tiny(tmp_path, name):
    cls, extra = CASES[name]
    torch.manual_seed(0)
    cfg = cls(**TINY, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every weight matters
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_models_match_transformers(tmp_path, name):
    hf = _tiny(tmp_path, name)
    model = LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # one full prefill, then the same tokens as chunked prefill + decode steps over the paged cache
    for chunks in ([ids], [ids[:17], ids[17:30], ids[30:31], ids[31:32], ids[32:]]):
        got = run_turbo_logits(model, chunks)
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, (name, rel)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path))
    model = LlamaModel.from_pretrained(smollm2_path, get_backend("torch"), torch.float32)
    prompts = ["The capital of France is", "def fibonacci(n):\n    return",
               "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
               "北京是中国的首都，"]
    for p in prompts:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        got = run_turbo_logits(model, [ids], block_size=16, num_blocks=32)
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, (p, rel)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_embedded_checkpoint_config_reads_in_transformers_4_and_5(smollm2_path):
    """The converted folder names its architecture and states rope_theta explicitly (transformers 4.x readers
    such as AutoAWQ do not read v5's rope_parameters), with a tokenizer class both majors know."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == 100000.0  # SmolLM2's theta, not the 10000 default
    tok_cfg = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "lm_head.weight" not in load_file(str(smollm2_path / "model.safetensors"))  # tied: kept tied
