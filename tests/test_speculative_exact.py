"""Speculation is exact at any temperature (turbo/core/speculative.py, the engine's verify step):

- the distribution of the first 3 sampled tokens of a tiny model (temperature 0.7, top_p 0.8; 20,000 seeds) with
  speculation equals the one without, by a two-sample chi-square test that a broken acceptance rule (every draft
  kept) fails;
- the same seed gives the same tokens with and without speculation when the logits rows are the single-step ones:
  float32 (SmolLM2: sampled, with penalties and a logit bias, logprobs, and a JSON schema whose mask applies at every
  verified position) and bf16 with ``batch_invariant=True`` (the W4A16 checkpoint).
"""
from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.core import speculative
from turbo.core.speculative import accepted as speculative_accepted

from test_speculative import TEXT, _ids  # noqa: E402 - the passage and chat-prompt helper shared with it

SAMPLES = int(__import__("os").environ.get("SPEC_SAMPLES", 20_000))
VOCAB = 16


def _chi2_two_sample(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Pearson's chi-square statistic of homogeneity of two samples over the same cells (cells with fewer than
    ``min_count`` observations in both pooled into one) and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    big = [c for c in set(a) | set(b) if a[c] + b[c] >= min_count]
    table = [(a[c], b[c]) for c in big]
    rest = (na - sum(x for x, _ in table), nb - sum(y for _, y in table))
    if sum(rest):
        table.append(rest)
    stat = 0.0
    for x, y in table:
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(table) - 1


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The upper 0.1 % point of chi-square with ``df`` degrees of freedom (Wilson-Hilferty; z = 3.09)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("spec-exact") / "tiny", seed=3, vocab_size=VOCAB,
                            initializer_range=0.12)
    return Engine(path, EngineConfig(dtype="float32", max_batch_size=500, max_num_batched_tokens=4096,
                                     max_kv_tokens=40_000, block_size=16))


def _prompt(engine) -> list[int]:
    """Segments ``x v a b`` for every token v, then ``x``: after the first sampled token v, the drafter proposes
    ``a b`` (the model's own greedy continuation, so drafts are often but not always kept)."""
    x = 3
    base = [t for v in range(VOCAB) for t in (x, v, v, v)] + [x]
    cont = {v: engine.generate(base + [v], GenerationConfig(max_new_tokens=2, ignore_eos=True)).token_ids
            for v in range(VOCAB)}
    return [t for v in range(VOCAB) for t in (x, v, *cont[v])] + [x]


def _first3(engine, prompt, seeds, spec: int) -> Counter:
    """How often each first-3-token tuple was sampled, one request per seed, 500 at a time."""
    got = Counter()
    for at in range(0, len(seeds), 500):
        reqs = [engine.add_request(prompt, GenerationConfig(max_new_tokens=4, temperature=0.7, top_p=0.8, seed=s,
                                                            speculative=spec, ignore_eos=True))
                for s in seeds[at:at + 500]]
        while engine.has_unfinished():
            engine.step()
        got.update(tuple(r.output_ids[:3]) for r in reqs)
    return got


@pytest.mark.e2e
def test_sampled_distribution_with_speculation_equals_without_and_a_broken_rule_fails(tiny, monkeypatch):
    monkeypatch.setattr(speculative, "STEP_ROWS", 10**6)  # every request drafts in these 500-request batches
    prompt = _prompt(tiny)
    plain = _first3(tiny, prompt, range(SAMPLES), 0)
    c0 = tiny.counters.as_dict()
    spec = _first3(tiny, prompt, range(SAMPLES, 2 * SAMPLES), 2)
    drafted = tiny.counters.spec_drafted - c0["spec_drafted"]
    kept = tiny.counters.spec_accepted - c0["spec_accepted"]
    assert drafted >= SAMPLES and 0.1 < kept / drafted < 0.9  # drafts verified, kept and rejected alike
    stat, df = _chi2_two_sample(plain, spec)
    print("chi2", stat, df, _chi2_critical(df), "kept", kept / drafted)
    assert stat < _chi2_critical(df), (stat, df)
    # the rule broken on purpose, two ways: every draft kept (as if a point-mass draft were certain), and a
    # rejected first draft kept one time in four (as a rejection that redraws from p with the draft still in it)
    coin = random.Random(0)
    rules = {"keep every draft": lambda sampled, drafts: len(drafts),
             "keep a rejected draft 1 in 4": lambda sampled, drafts: (
                 speculative_accepted(sampled, drafts) or int(bool(drafts) and coin.random() < 0.25))}
    for n, (name, rule) in enumerate(rules.items()):
        monkeypatch.setattr(speculative, "accepted", rule)
        broken = _first3(tiny, prompt, range((2 + n) * SAMPLES, (3 + n) * SAMPLES), 2)
        stat_b, df_b = _chi2_two_sample(plain, broken)
        print(name, stat_b, df_b, _chi2_critical(df_b))
        assert stat_b > 2 * _chi2_critical(df_b), (name, stat_b, df_b)


@pytest.fixture(scope="module")
def f32(smollm2_path):
    return Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16))


def _same_with_and_without(engine, prompt, **opts):
    c0 = engine.counters.as_dict()
    spec = engine.generate(prompt, GenerationConfig(speculative=3, **opts))
    c1 = engine.counters.as_dict()
    plain = engine.generate(prompt, GenerationConfig(**opts))
    assert c1["spec_steps"] > c0["spec_steps"]  # it did speculate
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    return spec, plain


@pytest.mark.e2e
@pytest.mark.parametrize("opts", [
    dict(temperature=0.7, top_p=0.9, seed=5),
    dict(temperature=1.0, top_k=20, min_p=0.05, seed=11, repetition_penalty=1.1, presence_penalty=0.3,
         frequency_penalty=0.2, logit_bias={13: -5.0}),
])
def test_seeded_sampled_tokens_equal_with_and_without_speculation_float32(f32, opts):
    p = _ids(f32, "Repeat this text exactly, word for word:\n\n" + TEXT)
    _same_with_and_without(f32, p, max_new_tokens=60, **opts)


@pytest.mark.e2e
def test_logprobs_under_speculation_are_the_targets(f32):
    p = _ids(f32, "Repeat this text exactly, word for word:\n\n" + TEXT)
    spec, plain = _same_with_and_without(f32, p, max_new_tokens=30, temperature=0.8, seed=2, logprobs=3)
    assert len(spec.logprobs) == len(spec.token_ids) == 30
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b))


@pytest.mark.e2e
def test_json_schema_masks_apply_at_every_verified_position(f32):
    schema = {"type": "object", "properties": {"keeper": {"type": "string"}, "wind": {"type": "string"},
                                               "boat": {"type": "string"}},
              "required": ["keeper", "wind", "boat"], "additionalProperties": False}
    p = _ids(f32, "Extract as JSON with keys keeper, wind and boat, quoting the text:\n\n" + TEXT)
    for opts in (dict(temperature=0.0), dict(temperature=0.7, seed=4)):
        spec, _ = _same_with_and_without(f32, p, max_new_tokens=120, json_schema=schema, **opts)
        if spec.finish_reason == "stop":
            assert set(json.loads(spec.text)) == {"keeper", "wind", "boat"}


@pytest.mark.e2e
def test_seeded_sampled_replies_equal_with_and_without_speculation_batch_invariant_bf16(smollm2_rtn_g64):
    engine = Engine(smollm2_rtn_g64, EngineConfig(batch_invariant=True, max_kv_tokens=4096))
    assert engine.dtype.is_floating_point and engine.dtype.itemsize == 2  # 16-bit compute
    prompts = [_ids(engine, "Repeat this text exactly, word for word:\n\n" + TEXT),
               _ids(engine, "Rewrite this text in the past perfect tense, keeping every detail:\n\n" + TEXT)]
    for seed in (0, 1, 2):
        for p in prompts:
            _same_with_and_without(engine, p, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=seed)
