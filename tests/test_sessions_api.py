"""Session persistence, the async streaming API, pool sizing and session_len errors."""
from __future__ import annotations

import asyncio

import pytest

from lite.formats import LiteturboError
from turbo import Engine, EngineConfig, GenerationConfig

pytestmark = pytest.mark.slow
GEN = GenerationConfig(max_new_tokens=12)


@pytest.fixture(scope="module")
def engine(smollm2_rtn_g64):
    return Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=2048))


@pytest.mark.parametrize("include_kv", [True, False])
def test_saved_session_continues_like_the_original(engine, smollm2_rtn_g64, tmp_path, include_kv):
    s = engine.session(system="You are terse.")
    s.chat("What is the capital of France?", gen=GEN)
    folder = s.save(tmp_path / "sess", include_kv=include_kv)
    expected = s.chat("And of Japan?", gen=GEN)
    # a fresh engine, as after a restart
    other = Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=2048, enable_prefix_caching=False))
    r = other.load_session(folder)
    assert r.messages == s.messages[:-2] and r.system == "You are terse."
    assert (r.seq.num_computed > 0) == include_kv
    assert r.chat("And of Japan?", gen=GEN) == expected
    if include_kv:
        assert r.last.cached_tokens > 0  # the restored KV was used, not recomputed
    with pytest.raises(LiteturboError, match="not a saved liteturbo session"):
        other.load_session(tmp_path)
    s.close()
    r.close()


def test_async_streams_share_the_batch(engine):
    async def collect(prompt):
        pieces = []
        async for item in engine.astream(prompt, GEN):
            pieces.append(item)
        return pieces

    async def both():
        return await asyncio.gather(collect("Name a color."), collect("Name a fruit."))

    a, b = asyncio.run(both())
    assert a[-1].text == "".join(a[:-1]) and b[-1].text == "".join(b[:-1])
    assert a[-1].token_ids == engine.generate("Name a color.", GEN).token_ids
    assert engine.stats()["running"] == 0


def test_pool_sizing_options_and_report(smollm2_rtn_g64):
    e = Engine(smollm2_rtn_g64, EngineConfig(kv_cache_gib=0.25, block_size=32))
    st = e.stats()
    per_block = 2 * 30 * 32 * 3 * 64 * 2  # K+V, layers, tokens, kv heads, head dim, bf16 bytes
    assert st["blocks_total"] == int(0.25 * 2**30 // per_block)
    assert st["kv_cache_bytes"] == st["blocks_total"] * per_block
    assert Engine(smollm2_rtn_g64, EngineConfig(num_blocks=7)).stats()["blocks_total"] == 7
    with pytest.raises(LiteturboError, match="cache_max_entry_count"):
        EngineConfig(cache_max_entry_count=1.5)


def test_session_len_error_names_both_lengths(smollm2_rtn_g64):
    e = Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=2048, session_len=80))
    s = e.session()
    s.chat("Hi!", gen=GenerationConfig(max_new_tokens=8))
    with pytest.raises(LiteturboError, match=r"session would reach \d+ tokens but session_len is 80"):
        s.chat("Tell me everything about " + "the history of France and " * 10, gen=GEN)
    s.close()
