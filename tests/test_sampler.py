"""Sampling rules on hand-made logits (no model)."""
from __future__ import annotations

import math

import pytest
import torch

from lite.formats import LiteturboError
from turbo import GenerationConfig
from turbo.core.sampler import apply_penalties, sample, top_logprobs


def test_greedy_topk_topp_minp():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    assert sample(logits) == 1
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, top_k=1, generator=g) for _ in range(20)} == {1}
    # p = softmax([1,3,2,.5]) = [.086,.636,.234,.052]; top_p .7 keeps {1, 2}
    assert {sample(logits, 1.0, top_p=0.7, generator=g) for _ in range(200)} == {1, 2}
    # min_p .2: keep p >= .127 -> {1, 2}
    assert {sample(logits, 1.0, min_p=0.2, generator=g) for _ in range(200)} == {1, 2}


def test_same_seed_same_tokens():
    logits = torch.randn(100)
    a = [sample(logits, 1.0, generator=torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [sample(logits, 1.0, generator=torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b


def test_penalties_by_hand():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(logits, prompt_ids=[0], output_ids=[1, 2, 2], repetition_penalty=2.0)
    assert out.tolist() == [1.0, -4.0, 0.5, 0.0]
    out = apply_penalties(logits, [0], [1, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    assert out.tolist() == [2.0, -2.75, 0.0, 0.0]
    assert apply_penalties(logits, [0], [1]) is logits  # no penalty: untouched


def test_top_logprobs_sum_and_order():
    lp = top_logprobs(torch.tensor([0.0, 1.0, 2.0]), 2)
    assert [i for i, _ in lp] == [2, 1]
    z = math.log(1 + math.e + math.e ** 2)
    assert lp[0][1] == pytest.approx(2 - z) and lp[1][1] == pytest.approx(1 - z)


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(repetition_penalty=0), dict(min_new_tokens=5, max_new_tokens=2),
                                 dict(logprobs=-1), dict(presence_penalty=float("inf"))])
def test_bad_generation_options(bad):
    with pytest.raises(LiteturboError):
        GenerationConfig(**bad)
