"""SessionRegistry: ids, expiry, the cap on resident KV (LRU evicted first, history kept), persistence across a
restart (a fourth turn after reloading equals the one without the restart)."""
from __future__ import annotations

import pytest

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.errors import Conflict, NotFound
from turbo.engine_proc.sessions import SessionRegistry

G = GenerationConfig(max_new_tokens=6, ignore_eos=True)
TURNS = ["the of and", "to in a", "is that for", "it with was"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import AutoTokenizer

    from tiny_models import build_key_outlier_model

    path = build_key_outlier_model(tmp_path_factory.mktemp("reg") / "model")
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(str(path))
    return path


def _engine(path):
    return Engine(path, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=4))


def test_ids_get_delete_and_expiry(model_path):
    reg = SessionRegistry(_engine(model_path), idle_timeout=3600)
    sid, s = reg.create("sys")
    assert sid.startswith("sess-") and reg.get(sid) is s and len(reg) == 1
    with pytest.raises(NotFound, match="no session 'sess-nope'"):
        reg.get("sess-nope")
    s.chat(TURNS[0], gen=G)
    reg.delete(sid)
    with pytest.raises(NotFound):
        reg.get(sid)
    sid2, s2 = reg.create()
    it = s2.chat(TURNS[0], gen=G, stream=True)
    next(it)
    with pytest.raises(Conflict):
        reg.delete(sid2)
    it.close()
    reg.idle_timeout = 0.0
    assert reg.expire() == [sid2] and len(reg) == 0 and s2.closed


def test_cap_evicts_the_least_recently_used_kv_and_keeps_history(model_path):
    engine = _engine(model_path)
    reg = SessionRegistry(engine, max_sessions=2)
    ids = []
    for i in range(2):
        sid, s = reg.create()
        s.chat(TURNS[i], gen=G)
        ids.append(sid)
    reg.get(ids[0])  # ids[1] is now the least recently used
    assert all(reg.get(i).seq.block_table for i in ids)
    reg.get(ids[0])
    sid3, s3 = reg.create()  # a third resident session: the LRU one's KV goes
    s_old, s_new = reg._sessions[ids[1]], reg._sessions[ids[0]]
    assert not s_old.seq.block_table and s_old.seq.num_computed == 0 and s_old.messages
    assert s_new.seq.block_table
    # the evicted session's next turn recomputes its history and answers as an uninterrupted one
    ref = _engine(model_path).session()
    ref.chat(TURNS[1], gen=G)
    assert s_old.chat(TURNS[2], gen=G) == ref.chat(TURNS[2], gen=G)
    # (its full blocks may still come from the prefix cache: evicted blocks keep their hashes until reused)


def test_sessions_survive_a_restart_with_the_same_tokens(model_path, tmp_path):
    # reference: four turns without a restart
    ref = _engine(model_path).session("sys")
    want = [ref.chat(m, gen=G) for m in TURNS]
    # three turns, persisted; a new engine and registry restore them; the fourth turn continues
    reg = SessionRegistry(_engine(model_path), session_dir=tmp_path / "sessions")
    sid, s = reg.create("sys")
    got = []
    for m in TURNS[:3]:
        got.append(s.chat(m, gen=G))
        reg.persist(sid)
    reg2 = SessionRegistry(_engine(model_path), session_dir=tmp_path / "sessions")
    assert reg2.restore() == 1
    s2 = reg2.get(sid)
    got.append(s2.chat(TURNS[3], gen=G))
    assert got == want and s2.last.token_ids == ref.last.token_ids
    assert s2.last.cached_tokens > 0  # the saved KV was reloaded, not recomputed
