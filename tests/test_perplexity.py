"""Perplexity through turbo equals the GPTQ-protocol perplexity computed with transformers' forward."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

import calib_data


def test_wikitext2_join_matches_hf_protocol():
    text = calib_data.wikitext2_test_text()
    # SOURCES.md: the HF rows joined with "\n\n" are 1,294,336 characters
    assert len(text) == 1_294_336
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter")
    assert len(calib_data.load_rows("c4")) == 1000 and len(calib_data.load_rows("zh", "dev")) == 848
    # the Chinese text: one half evaluates, the other calibrates (the default split), never the same paragraph
    ev, cal = calib_data.load_rows("zh", "eval"), calib_data.load_rows("zh")
    assert len(ev) == len(cal) == 424 and not set(ev) & set(cal)
    assert calib_data.eval_text("zh") == "\n\n".join(ev)
    with pytest.raises(ValueError, match="bundled"):
        calib_data.load_rows("pile")


@pytest.mark.slow
def test_perplexity_matches_transformers_on_smollm2(smollm2_path):
    from turbo import Engine, EngineConfig
    from turbo.perplexity import perplexity

    text = calib_data.wikitext2_test_text()[:20000]
    seqlen = 256
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=seqlen, block_size=32))
    got = perplexity(engine, text, seqlen=seqlen, max_windows=3, progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    ids = engine.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    nlls = []
    for i in range(3):
        w = ids[:, i * seqlen:(i + 1) * seqlen]
        with torch.no_grad():
            nlls.append(hf(w, labels=w).loss.item())
    ref = math.exp(sum(nlls) / 3)
    assert got["windows"] == 3 and got["tokens"] == 3 * seqlen
    assert abs(got["ppl"] - ref) / ref < 1e-4, (got["ppl"], ref)
