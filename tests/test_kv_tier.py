"""The host tier of session KV (turbo/core/kv_tier.py): an evicted idle session's KV comes back from host memory on
its next turn (cached tokens, replies equal to a pool that never evicted, in 16-bit and int4 storage), the budget
pushes out the least recently spilled, a closed session's KV leaves the tier, the disk tier is a session's saved KV;
and the session overflow policy (refuse, or drop the oldest turns)."""
from __future__ import annotations

import pytest

from lite.formats import LiteturboError
from turbo import Engine, EngineConfig

from tiny_models import build_tiny_llama, save_word_tokenizer

TEXT = " ".join(["the", "of", "and", "to", "in", "a", "is", "that", "for", "it"] * 12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tier") / "tiny", num_hidden_layers=2)
    save_word_tokenizer(path, 128, bos=True)  # the variant with a chat template: sessions need one
    return path


def _chat_rounds(engine, n_sessions=4, rounds=2):
    systems = ["the of", "and to", "in a", "is that", "for it", "of the"]  # distinct prompts: no shared prefixes
    ss = [engine.session(system=systems[i]) for i in range(n_sessions)]
    out = []
    for r in range(rounds):
        for s in ss:
            text = s.chat(f"{TEXT} round {r}", max_new_tokens=6, ignore_eos=True)
            out.append((text, s.last.cached_tokens))
    return ss, out


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_evicted_sessions_come_back_from_the_host_tier(tiny, kv):
    big = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16, kv_cache_dtype=kv))
    small = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=384, block_size=16, kv_cache_dtype=kv,
                                      session_host_gib=0.5))
    _, want = _chat_rounds(big)
    _, got = _chat_rounds(small)
    assert [t for t, _ in got] == [t for t, _ in want]  # the same replies as a pool that never evicted
    assert [c for _, c in got[4:]] == [c for _, c in want[4:]]  # and the whole history came back as cached
    st = small.stats()
    assert st["host_tier_host_hits"] >= 3 and st["host_tier_spills"] >= 3 and st["host_tier_host_restore_seconds"] > 0


def test_the_budget_pushes_out_the_oldest_and_close_forgets(tiny):
    e = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=384, block_size=16, session_host_gib=1e-4))
    ss, got = _chat_rounds(e)  # ~100 KiB of budget: about one session's KV
    st = e.stats()
    assert st["host_tier_dropped"] >= 1 and st["host_tier_bytes"] <= st["host_tier_budget_bytes"]
    for s in ss:
        s.close()
    assert e.stats()["host_tier_sessions"] == 0 and e.stats()["host_tier_bytes"] == 0
    with pytest.raises(LiteturboError, match="session_host_gib"):
        EngineConfig(session_host_gib=-1)


def test_through_the_server_an_evicted_session_reports_its_history_as_cached(tiny):
    import httpx

    from conftest import serve_in_thread
    from turbo.serve.app import create_app

    ref = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16))
    engine = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=384, block_size=16, session_host_gib=0.5))
    replies = {}
    for name, e in (("ref", ref), ("tier", engine)):
        url, stop = serve_in_thread(create_app(e, model_name="t", api_keys=""))
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                sids = [http.post("/v1/sessions", json={"system": s}).json()["id"]
                        for s in ("the of", "and to", "in a", "is that")]
                for sid in sids:  # the later sessions push the first ones' KV out of the small pool
                    http.post(f"/v1/sessions/{sid}/chat", json={"content": TEXT, "max_tokens": 5, "ignore_eos": True,
                                                                "temperature": 0})
                t = http.post(f"/v1/sessions/{sids[0]}/chat", json={"content": "of and", "max_tokens": 5, "temperature": 0,
                                                                     "ignore_eos": True}).json()
                replies[name] = (t["content"], t["usage"]["prompt_tokens_details"]["cached_tokens"])
                metrics = http.get("/metrics").text
        finally:
            stop()
    assert replies["tier"] == replies["ref"] and replies["tier"][1] > len(TEXT.split())
    assert 'liteturbo_session_host_tier{figure="host_hits"} 1.0' in metrics


def test_the_disk_tier_is_the_sessions_saved_kv(tiny, tmp_path):
    """No host tier: a session saved with its KV (as --session-dir does after every turn) loads it back from disk
    after an eviction; a file replaced since is not used (the history is recomputed)."""
    ref = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16))
    _, want = _chat_rounds(ref)
    e = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=384, block_size=16))
    systems = ["the of", "and to", "in a", "is that"]
    ss = [e.session(system=s) for s in systems]
    got = []
    for r in range(2):
        for i, s in enumerate(ss):
            got.append((s.chat(f"{TEXT} round {r}", max_new_tokens=6, ignore_eos=True), s.last.cached_tokens))
            s.save(tmp_path / f"s{i}", include_kv=True)
    assert got == want and e.stats()["host_tier_disk_hits"] >= 3 and e.stats()["host_tier_spills"] == 0
    # a replaced file: not loaded (recomputed), and the reply is still the same
    for i in range(1, 4):  # push session 0 out again (these come back from disk themselves)
        ss[i].chat("of", max_new_tokens=2, ignore_eos=True)
    hits = e.stats()["host_tier_disk_hits"]
    (tmp_path / "s0" / "kv.safetensors").write_bytes(b"not the saved KV")
    again = ss[0].chat("and", max_new_tokens=3, ignore_eos=True)
    assert e.stats()["host_tier_disk_hits"] == hits and isinstance(again, str)


def test_session_overflow_refuses_with_both_numbers_or_drops_the_oldest_turns(tiny):
    words = " ".join(["the", "of", "and", "to"] * 10)  # 40 tokens a message
    refuse = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16, session_len=160))
    s = refuse.session(system="the of")
    s.chat(words, max_new_tokens=4, ignore_eos=True)
    s.chat(words, max_new_tokens=4, ignore_eos=True)
    before = list(s.messages)
    with pytest.raises(LiteturboError, match=r"would reach \d+ tokens but session_len is 160"):
        s.chat(words + " " + words, max_new_tokens=4, ignore_eos=True)
    assert s.messages == before  # refused: nothing changed
    drop = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16, session_len=160,
                                     session_overflow="drop-oldest"))
    d = drop.session(system="the of")
    for i in range(6):
        d.chat(f"{words} turn {i}", max_new_tokens=4, ignore_eos=True)  # would reach ~300 tokens
    assert d.messages[0] == {"role": "system", "content": "the of"}
    users = [m["content"] for m in d.messages if m["role"] == "user"]
    assert users[-1].endswith("turn 5") and len(users) < 6 and users == [f"{words} turn {i}" for i in
                                                                         range(6 - len(users), 6)]
    assert d.last.prompt_tokens < 160
    with pytest.raises(LiteturboError, match="session_overflow"):
        EngineConfig(session_overflow="truncate")


def test_the_planner_counts_the_host_tier(smollm2_path):
    from turbo.plan import plan_checkpoint

    p, _ = plan_checkpoint(str(smollm2_path), device="cpu", session_len=2048, kv_cache_dtype="int8")
    p.with_host_tier(1.0)
    assert p.host_tier_sessions == 2**30 // (p.kv_bytes_per_token * 2048) > 0
    assert "session host tier" in p.table() and p.engine_options["session_host_gib"] == 1.0
    assert p.to_dict()["host_tier_sessions"] == p.host_tier_sessions


def test_drop_oldest_drops_even_the_only_earlier_turn_and_plan_refuses_nan(tiny):
    words = " ".join(["the", "of", "and", "to"] * 25)  # 100 tokens
    e = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16, session_len=160,
                                  session_overflow="drop-oldest"))
    s = e.session(system="the of")
    s.chat(words, max_new_tokens=4, ignore_eos=True)
    s.chat(words + " and", max_new_tokens=4, ignore_eos=True)  # would reach ~215 tokens: the first turn goes
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    assert s.messages[1]["content"].endswith(" and")
    from turbo.plan import plan_checkpoint
    p, _ = plan_checkpoint("smollm2-135m-instruct", device="cpu")
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(LiteturboError, match="session-host-gib"):
            p.with_host_tier(bad)


def test_a_restored_session_without_room_now_loads_its_kv_from_disk_later(tiny, tmp_path):
    big = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=2048, block_size=16))
    saved = []
    for i, system in enumerate(("the of", "and to", "in a")):
        s = big.session(system=system)
        s.chat(TEXT, max_new_tokens=4, ignore_eos=True)
        s.save(tmp_path / f"s{i}", include_kv=True)
        saved.append(len(s.seq.token_ids))
    small = Engine(tiny, EngineConfig(dtype="float32", max_kv_tokens=256, block_size=16))  # holds about two
    with pytest.warns(UserWarning, match="loads it from this file when there is room"):
        restored = [small.load_session(tmp_path / f"s{i}") for i in range(3)]
    last = restored[-1]  # the one that found no room
    last.chat("of", max_new_tokens=2, ignore_eos=True)
    assert small.stats()["host_tier_disk_hits"] >= 1 and last.last.cached_tokens >= saved[-1] - 2
