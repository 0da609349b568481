"""The whole engine on the Triton backend (in Triton's interpreter without a GPU) against the torch backend.

A tiny GQA Llama, 16-bit and W4A16, with a batch of ragged requests (different prompt lengths, chunked prefill,
prefix-cache hits) and 16-bit, int8 and int4 KV caches: greedy tokens must be the same as the torch backend's in
float32, and the logits close.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("triton")

from lite.pipeline import QuantConfig, quantize_checkpoint  # noqa: E402
from turbo import Engine, EngineConfig  # noqa: E402

from conftest import usable_backends  # noqa: E402
from tiny_models import save_word_tokenizer  # noqa: E402

pytestmark = [pytest.mark.skipif("triton" not in usable_backends(), reason="triton cannot run here"),
              pytest.mark.e2e]  # the end-to-end tier (README)

PROMPTS = [
    "the of and to in a is that for it",
    "you with was on as",
    "the of and to in a is that for it with on as be at by this",  # shares a prefix with the first one
    "are from or",
]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-triton")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("lm_head.weight"):
                p.mul_(8.0)  # sharp next-token distributions: few near-ties for greedy decoding
    dense = root / "dense"
    hf.save_pretrained(dense)
    save_word_tokenizer(dense, cfg.vocab_size)
    w4 = Path(quantize_checkpoint(str(dense), QuantConfig(w_bits=4, w_group_size=32, work_dir=str(root / "w4"))))
    return {"dense": dense, "w4a16": w4}


def _run(path, backend, kv):
    engine = Engine(path, EngineConfig(backend=backend, device="cpu" if not torch.cuda.is_available() else "cuda",
                                       dtype="float32", kv_cache_dtype=kv, block_size=4, max_kv_tokens=256,
                                       max_num_batched_tokens=12, lm_head="16bit"))
    outs = engine.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, logprobs=1)
    assert type(engine.backend).__name__.lower().startswith(backend)
    return outs, engine.stats()


@pytest.mark.parametrize("kind", ["dense", "w4a16"])
@pytest.mark.parametrize("kv", ["float32", "int8", "int4"])
def test_triton_engine_greedy_equals_torch(tiny_models, kind, kv):
    ref, _ = _run(tiny_models[kind], "torch", kv)
    got, stats = _run(tiny_models[kind], "triton", kv)
    tol = _TOL[kv]
    assert stats["cache_hit_tokens"] > 0  # the shared prefix was served from the cache
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids, (kind, kv)
        assert len(a.token_ids) == 8
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la[0][0] == lb[0][0] and abs(la[0][1] - lb[0][1]) < tol, (kind, kv)


# Logprob tolerance by KV dtype. A quantized cache rounds: the two backends' projections differ by ~1e-6, which can
# move a token's fp16 scale by one ulp (seen with the rotated int4 cache: a V scale 3.05e-5 apart, logprobs 1.6e-4
# apart after 8 decode steps), so quantized caches get 1e-3; a wrong kernel misses by far more than that.
_TOL = {"float32": 1e-4, "int8": 1e-3, "int4": 1e-3}
