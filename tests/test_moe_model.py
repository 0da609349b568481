"""Mixture-of-Experts models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): turbo's logits against transformers' own forward
on tiny random configs (float32), dense and W4A16 (against transformers run on the dequantized weights), one prefill
and chunked prefill + decode over the paged cache, and a batch of sequences together."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from backends import get_backend
from backends.types import QuantizedWeight
from lite.formats.arch import layer_linears, moe_config
from lite.formats.awq import awq_quantization_config, pack_awq
from lite.rtn import quantize_rtn
from turbo.core.model import LlamaModel

from conftest import run_turbo_logits

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)

CASES = {
    # one dense layer among sparse ones (mlp_only_layers), norm_topk_prob, per-head QK-norm
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                    num_experts_per_tok=2, head_dim=16, norm_topk_prob=True,
                                                    mlp_only_layers=[1])),
    # a shared expert with its sigmoid gate, q/k/v bias, unnormalised top-k
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(intermediate_size=96, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=48, num_experts=8,
                                                    num_experts_per_tok=3)),
    # QK-norm over all heads
    "olmoe": (transformers.OlmoeConfig, dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=None)),
}


def build_tiny_moe(path, name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random float32 MoE of family ``name`` saved at ``path`` (per-expert names, as save_pretrained writes);
    norms and biases randomised and the router sharpened, so that every weight and the routing matter."""
    cls, extra = CASES[name]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**TINY, **extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif n.endswith("gate.weight") and p.dim() == 2:  # routers, the shared-expert gate
                p.copy_(0.3 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


def quantize_tiny(src, dst, group_size: int = 16) -> None:
    """An AWQ-format W4A16 copy of ``src`` (round-to-nearest, asymmetric) at ``dst``: every decoder linear of
    :func:`lite.formats.arch.layer_linears` quantized (experts included, routers not), and the same weights
    dequantized written back into ``src`` so that transformers runs exactly what turbo runs."""
    import json
    import shutil

    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, dict(sd)
    linears = {f"model.layers.{i}.{n}" for i in range(cfg["num_hidden_layers"]) for n in layer_linears(cfg, i)}
    for k, v in sd.items():
        mod = k[: -len(".weight")]
        if k.endswith(".weight") and mod in linears:
            qw = quantize_rtn(v, 4, group_size, False)
            deq[k] = qw.dequantize(torch.float32)
            for part, t in pack_awq(qw).items():
                out[f"{mod}.{part}"] = t
        else:
            out[k] = v
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    save_file(deq, str(src / "model.safetensors"))
    cfg["quantization_config"] = awq_quantization_config(4, group_size, zero_point=True)
    (dst / "config.json").write_text(json.dumps(cfg))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_moe_matches_transformers(tmp_path, name):
    hf = build_tiny_moe(tmp_path, name)
    model = LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)
    assert model.cfg.moe is not None and any(l.sparse for l in model.layers)
    ids = _ids(40, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([ids], [ids[:17], ids[17:30], ids[30:31], ids[31:32], ids[32:]]):
        rel = _rel(run_turbo_logits(model, chunks), ref)
        assert rel <= 1e-4, (name, rel)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_moe_w4a16_matches_dequantized_transformers(tmp_path, name):
    src, dst = tmp_path / "f32", tmp_path / "w4"
    build_tiny_moe(src, name)
    quantize_tiny(src, dst)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    model = LlamaModel.from_pretrained(dst, get_backend("torch"), torch.float32)
    experts = next(l.experts for l in model.layers if l.sparse)
    assert experts.quantized == "w4a16" and experts.num_experts == moe_config(hf.config.to_dict()).num_experts
    ids = _ids(33, 2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([ids], [ids[:20], ids[20:21], ids[21:22], ids[22:]]):
        rel = _rel(run_turbo_logits(model, chunks), ref)
        assert rel <= 1e-4, (name, rel)


def test_experts_reference_against_dense_loop():
    """Backend.experts (grouped by expert) equals a per-token loop over the selected experts, float64."""
    be = get_backend("torch")
    g = torch.Generator().manual_seed(0)
    e, h, inter, t, k = 6, 32, 16, 11, 3
    gate_up = [torch.randn(2 * inter, h, generator=g, dtype=torch.float64) for _ in range(e)]
    down = [torch.randn(h, inter, generator=g, dtype=torch.float64) for _ in range(e)]
    handle = be.prepare_experts(gate_up, down, torch.float64)
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[3] = torch.tensor([0, 1, 2])  # expert 5 may be unused; a token reusing low ids
    w = torch.rand(t, k, generator=g, dtype=torch.float64)
    got = be.experts(x, ids, w, handle)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            gu = gate_up[ids[i, j]] @ x[i]
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            ref[i] += w[i, j] * (down[ids[i, j]] @ act)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_prepare_experts_refuses_mixed_and_mismatched():
    be = get_backend("torch")
    dense = torch.zeros(8, 4)
    qw = quantize_rtn(torch.randn(8, 16), 4, 16, False)
    with pytest.raises(ValueError, match="all quantized or all dense"):
        be.prepare_experts([dense, qw], [dense.T, dense.T], torch.float32)
    with pytest.raises(ValueError, match="one even width"):
        be.prepare_experts([torch.zeros(8, 4), torch.zeros(6, 4)], [torch.zeros(4, 4), torch.zeros(4, 3)],
                           torch.float32)
    assert isinstance(qw, QuantizedWeight)


@pytest.mark.parametrize("tokens", [1, 3, 16, 70])
def test_cpu_grouped_w4_experts_against_float64(tokens):
    """The torch backend's stacked experts (the C++ grouped kernel, bf16) against float64 math on the dequantized
    weights: decode (1 token, 8 experts), small batches and a prefill-sized step where experts share many rows."""
    from backends.torch_backend import W4ExpertsHandle

    be = get_backend("torch")
    g = torch.Generator().manual_seed(tokens)
    e, h, inter, k = 16, 128, 64, 4
    gate_up = [quantize_rtn(torch.randn(2 * inter, h, generator=g) * 0.05, 4, 32, False) for _ in range(e)]
    down = [quantize_rtn(torch.randn(h, inter, generator=g) * 0.05, 4, 32, False) for _ in range(e)]
    handle = be.prepare_experts(gate_up, down, torch.bfloat16)
    if not isinstance(handle, W4ExpertsHandle):
        pytest.skip("the C++ grouped W4A16 kernel does not run on this CPU (AVX-512 BF16)")
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g).to(torch.bfloat16)
    got = be.experts(x, ids, w, handle).double()
    ref = torch.zeros(tokens, h, dtype=torch.float64)
    xd = x.double()
    for i in range(tokens):
        for j in range(k):
            gu = gate_up[ids[i, j]].dequantize(torch.float64) @ xd[i]
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            ref[i] += w[i, j].double() * (down[ids[i, j]].dequantize(torch.float64) @ act)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 2e-2, rel
    generic = super(type(be), be).experts(x, ids, w, be.__class__.__mro__[1].prepare_experts(be, gate_up, down,
                                                                                              torch.bfloat16))
    assert ((generic.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2
