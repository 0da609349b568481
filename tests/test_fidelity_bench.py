"""bench/fidelity.py's distribution scores against an independent computation: transformers' forward gives the 16-bit
reference logits, and the KL divergence, top-1 agreement and perplexity it reports for a row equal the ones computed
from those logits and the row's own logits over whole windows; the reference row scores KL 0 and agreement 1."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from turbo import Engine

from test_scale_smoke import _load_bench_module
from tiny_models import build_tiny_llama

fidelity = _load_bench_module("fidelity")


def test_distribution_scores_match_transformers_and_direct_kl(tmp_path):
    path = build_tiny_llama(tmp_path / "tiny")
    engines = {("16-bit", kv): Engine(path, dtype="float32", kv_cache_dtype=kv, kv_rotation=False, max_kv_tokens=256)
               for kv in ("auto", "int4")}
    gen = torch.Generator().manual_seed(3)
    windows = [torch.randint(2, 128, (48,), generator=gen).tolist() for _ in range(2)]
    got = fidelity.distribution_scores(engines, ("16-bit", "auto"), windows)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kls, agree, nll, nll_ref, count = [], 0, 0.0, 0.0, 0
    for w in windows:
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].double(), -1)
        row = torch.log_softmax(torch.cat([lg for lg, _ in fidelity.chunk_logits(engines[("16-bit", "int4")], w)])
                                .double(), -1)
        targets = torch.tensor(w[1:])
        kls.append((ref.exp() * (ref - row)).sum(-1))
        agree += int((ref.argmax(-1) == row.argmax(-1)).sum())
        nll -= float(row.gather(1, targets[:, None]).sum())
        nll_ref -= float(ref.gather(1, targets[:, None]).sum())
        count += len(targets)
    kl = torch.cat(kls)
    ref_row, int4_row = got[("16-bit", "auto")], got[("16-bit", "int4")]
    assert ref_row["kl_mean"] == pytest.approx(0, abs=1e-7) and ref_row["top1_agree"] == 1.0
    assert ref_row["ppl_wikitext2"] == pytest.approx(math.exp(nll_ref / count), rel=1e-4)
    assert int4_row["kl_mean"] > 1e-5  # int4 keys and values do move the distribution
    assert int4_row["kl_mean"] == pytest.approx(float(kl.mean()), rel=2e-2)
    assert int4_row["kl_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), rel=2e-2)
    assert int4_row["top1_agree"] == pytest.approx(agree / count, abs=1.5 / count)
    assert int4_row["ppl_wikitext2"] == pytest.approx(math.exp(nll / count), rel=1e-4)
