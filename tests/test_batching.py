"""Persistent batching never changes what a request produces alone (greedy), even under preemption.

Run in float32: a row of a batched matmul may round differently from the same row computed alone (other
M, other kernel blocking), and in 16-bit that can flip a near-tie of greedy argmax; the scheduler itself
is what these tests check.
"""
from __future__ import annotations

import random

import pytest

from turbo import Engine, EngineConfig, GenerationConfig

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # the end-to-end tier (README)

TOPICS = ["the sea", "a robot", "Paris", "mathematics", "a cat", "the moon", "coffee", "rain", "music",
          "a library", "mountains", "bread"]


def _prompts(n: int) -> list[str]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(1, 40)))
        out.append(f"Write one sentence about {TOPICS[i % len(TOPICS)]}. Context: {words}.")
    return out


@pytest.fixture(scope="module")
def alone_outputs(smollm2_path):
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=2048, enable_prefix_caching=False))
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    return [engine.generate(p, gen).token_ids for p in _prompts(32)]


def test_batch_of_32_with_preemption_matches_alone(smollm2_path, alone_outputs):
    # 12 blocks of 16 tokens: far less than 32 requests need at once, so the scheduler must preempt
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=192, block_size=16,
                                               max_num_batched_tokens=256))
    engine.scheduler.decode_reserve = 0  # admit prompts until the pool is full, so decode must preempt
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, gen) for p in _prompts(32)]
    preemptions = 0
    while engine.has_unfinished():
        engine.step()
        preemptions = max(preemptions, sum(r.seq.num_preemptions for r in reqs))
    assert preemptions > 0, "the tiny pool should have forced preemption"
    for r, alone in zip(reqs, alone_outputs):
        assert r.output_ids == alone
    st = engine.stats()
    assert st["blocks_free"] == st["blocks_total"] and st["running"] == 0 and st["waiting"] == 0


def test_generate_list_runs_together_and_matches(smollm2_path, alone_outputs):
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096))
    outs = engine.generate(_prompts(32)[:8], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == alone_outputs[:8]
    assert engine.stats()["steps"] < 8 * 13  # batched: far fewer steps than one request at a time


def test_evicted_session_continues_identically(smollm2_path):
    gen = GenerationConfig(max_new_tokens=16)
    turns = ["What is the capital of France?", "What is the capital of Japan?", "And of Italy?"]
    ref_engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096))
    ref = ref_engine.session()
    expected = [ref.chat(t, gen=gen) for t in turns]

    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=256, block_size=16,
                                               enable_prefix_caching=False))
    s = engine.session()
    got = [s.chat(turns[0], gen=gen)]
    assert s.seq.block_table and s.seq.num_computed > 0  # resident while idle
    # other traffic needs the whole pool: the idle session's KV is evicted, its tokens kept
    engine.generate("Tell me a long story about " + "a dragon and " * 70, max_new_tokens=8, ignore_eos=True)
    assert s.seq.block_table == [] and s.seq.num_computed == 0 and len(s.seq.token_ids) > 40
    got += [s.chat(t, gen=gen) for t in turns[1:]]
    assert s.last.cached_tokens < s.last.prompt_tokens
    assert got == expected


def test_batch_invariant_bf16_w4a16_matches_alone_bit_exact(smollm2_rtn_g64):
    """In 16-bit, batch_invariant=True makes a request's greedy tokens independent of batching, chunked
    prefill and preemption: the W4A16 RTN model in bfloat16, 32 requests in a tiny pool vs alone."""
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    alone_engine = Engine(smollm2_rtn_g64, EngineConfig(dtype="bfloat16", max_kv_tokens=2048,
                                                         enable_prefix_caching=False, batch_invariant=True))
    alone = [alone_engine.generate(p, gen).token_ids for p in _prompts(32)]
    engine = Engine(smollm2_rtn_g64, EngineConfig(dtype="bfloat16", max_kv_tokens=192, block_size=16,
                                                   max_num_batched_tokens=256, batch_invariant=True))
    engine.scheduler.decode_reserve = 0  # admit prompts until the pool is full, so decode must preempt
    reqs = [engine.add_request(p, gen) for p in _prompts(32)]
    while engine.has_unfinished():
        engine.step()
    assert sum(r.seq.num_preemptions for r in reqs) > 0
    assert [r.output_ids for r in reqs] == alone
