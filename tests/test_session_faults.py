"""Session fault suite (issue 25, the kinds public reports show in other engines), through the HTTP API and the library:
a client disconnecting mid-turn (the session as before the turn, KV of the earlier turns kept; ``on_disconnect: keep``
keeps the partial reply), a lone UTF-16 surrogate in any field (400, nothing stored), a turn longer than the session (both numbers, KV kept),
two turns at once (409, consistent after), deleting during a turn (409), restoring a missing / damaged / foreign
session folder (a clear error, nothing else changed), and a restored session reusing its saved KV in every KV dtype."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from lite.formats import LiteturboError
from turbo import Engine, EngineConfig, GenerationConfig
from turbo.serve.app import create_app

from conftest import serve_in_thread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(smollm2_path):
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=2048, block_size=16, session_len=512))
    app = create_app(engine, model_name="smol", api_keys="")
    url, stop = serve_in_thread(app)
    with httpx.Client(base_url=url, timeout=120) as http:
        yield http, engine
    stop()


def _raw(http, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def test_a_lone_surrogate_is_400_on_every_route_and_stores_nothing(served):
    http, engine = served
    sid = http.post("/v1/sessions", json={}).json()["id"]
    cases = [("/v1/sessions", '{"system": "a \\ud800 b"}', "system"),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udfff"}]}', "messages"),
             ("/v1/completions", '{"prompt": "x", "stop": ["\\ud83d"]}', "stop"),
             (f"/v1/sessions/{sid}/chat", '{"content": "hi \\udc00"}', "content"),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1}', None)]
    for path, body, param in cases:
        r = _raw(http, path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert "lone UTF-16 surrogate" in err["message"] and (param is None or err["param"] == param)
    info = http.get(f"/v1/sessions/{sid}").json()
    assert info["messages"] == [] and info["tokens"] == 0  # the refused turn left nothing
    # the valid spelling of a surrogate pair is text and works
    ok = _raw(http, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], '
                                            '"max_tokens": 2}')
    assert ok.status_code == 200, ok.text


def test_a_turn_longer_than_the_session_is_refused_and_keeps_its_kv(served):
    http, engine = served
    sid = http.post("/v1/sessions", json={}).json()["id"]
    first = http.post(f"/v1/sessions/{sid}/chat", json={"content": "Name a fruit.", "max_tokens": 8,
                                                      "temperature": 0}).json()
    history = http.get(f"/v1/sessions/{sid}").json()
    r = http.post(f"/v1/sessions/{sid}/chat", json={"content": "word " * 600, "max_tokens": 4})
    assert r.status_code == 400 and "session_len is 512" in r.json()["error"]["message"]
    after = http.get(f"/v1/sessions/{sid}").json()
    assert after["messages"] == history["messages"] and after["kv_resident_tokens"] == history["kv_resident_tokens"]
    nxt = http.post(f"/v1/sessions/{sid}/chat", json={"content": "Another one.", "max_tokens": 4}).json()
    # the history's KV was not recomputed: everything up to the new message came from the cache
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


def _wait_idle(http, sid: str) -> dict:
    for _ in range(200):
        info = http.get(f"/v1/sessions/{sid}").json()
        if not info["busy"]:
            return info
        time.sleep(0.05)
    raise AssertionError("the session stayed busy")


@pytest.mark.e2e
@pytest.mark.parametrize("route", ["session", "chat"])
def test_a_client_disconnecting_mid_turn_leaves_the_session_as_before(served, route):
    http, engine = served
    greedy = {"max_tokens": 8, "temperature": 0}
    sid, twin = (http.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
    for s in (sid, twin):
        http.post(f"/v1/sessions/{s}/chat", json={"content": "Name a fruit.", **greedy}).raise_for_status()
    before = http.get(f"/v1/sessions/{sid}").json()
    path, body = (f"/v1/sessions/{sid}/chat", {"content": "Tell me a long story."}) if route == "session" else \
        ("/v1/chat/completions", {"session_id": sid, "messages": [{"role": "user", "content": "Tell me a long story."}]})
    with http.stream("POST", path, json=dict(body, stream=True, max_tokens=200, min_tokens=200)) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the reply has started: then the client goes
    after = _wait_idle(http, sid)
    assert after["messages"] == before["messages"] and after["tokens"] == before["tokens"]
    # the earlier turns' KV stayed, but for a last partial block the cancelled turn filled (then shared in the prefix
    # cache, so it is not written into again)
    kept = before["kv_resident_tokens"] // 16 * 16
    assert after["kv_resident_tokens"] >= kept
    nxt = http.post(f"/v1/sessions/{sid}/chat", json={"content": "And a vegetable?", **greedy}).json()
    ref = http.post(f"/v1/sessions/{twin}/chat", json={"content": "And a vegetable?", **greedy}).json()
    assert nxt["content"] == ref["content"] and nxt["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= kept


def test_on_disconnect_keep_keeps_the_partial_reply_and_bad_values_are_400(served):
    http, engine = served
    sid = http.post("/v1/sessions", json={}).json()["id"]
    turn = {"content": "Tell me a long story.", "stream": True, "max_tokens": 200, "min_tokens": 200,
            "on_disconnect": "keep"}
    with http.stream("POST", f"/v1/sessions/{sid}/chat", json=turn) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: {"))[6:])["delta"]
    info = _wait_idle(http, sid)
    assert [m["role"] for m in info["messages"]] == ["user", "assistant"]
    assert info["messages"][-1]["content"].startswith(first)
    bad = http.post(f"/v1/sessions/{sid}/chat", json={"content": "x", "on_disconnect": "save"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "on_disconnect"
    stateless = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "on_disconnect": "keep"})
    assert stateless.status_code == 400 and "session turns only" in stateless.json()["error"]["message"]
    blank = http.post(f"/v1/sessions/{sid}/chat", json={"content": " \n "})
    assert blank.status_code == 400 and "only whitespace" in blank.json()["error"]["message"]
    blank = http.post("/v1/chat/completions", json={"session_id": sid, "messages": [{"role": "user", "content": "  "}]})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "messages"
    assert "only whitespace" in blank.json()["error"]["message"]


def test_a_stream_closed_early_rolls_the_library_session_back(smollm2_path):
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16))
    s, twin = engine.session(system="Be brief."), engine.session(system="Be brief.")
    g = GenerationConfig(max_new_tokens=6, temperature=0)
    for x in (s, twin):
        x.chat("Name a color.", gen=g)
    messages, ids, n = list(s.messages), list(s.seq.token_ids), s.seq.num_computed
    it = s.chat("Tell me a long story.", stream=True, max_new_tokens=100, min_new_tokens=100)
    next(it)
    it.close()
    assert s.last.finish_reason == "cancelled" and not s.busy
    assert s.messages == messages and s.seq.token_ids == ids and s.seq.num_computed >= n - 16  # a shared block may go
    assert s.chat("And another.", gen=g) == twin.chat("And another.", gen=g)
    assert s.last.cached_tokens >= n - 16
    # keep_partial with nothing produced yet (cancelled while the prompt was computed): also as before the turn
    messages, ids, n = list(s.messages), list(s.seq.token_ids), s.seq.num_computed
    req, turn = s.begin_turn("Tell me a long story.", GenerationConfig(max_new_tokens=50), keep_partial=True)
    engine.cancel(req)
    s.end_turn(req, turn, None, [])
    assert s.messages == messages and s.seq.token_ids == ids and s.seq.num_computed >= n - 16 and not s.busy


def test_two_turns_at_once_get_409_and_delete_during_a_turn_gets_409(served):
    http, engine = served
    sid = http.post("/v1/sessions", json={}).json()["id"]
    started, results = threading.Event(), {}

    def long_turn():
        with http.stream("POST", f"/v1/sessions/{sid}/chat", json={"content": "Count to fifty.", "max_tokens": 120,
                                                                  "min_tokens": 120, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
            results["status"] = r.status_code

    t = threading.Thread(target=long_turn)
    t.start()
    assert started.wait(60)
    second = http.post(f"/v1/sessions/{sid}/chat", json={"content": "Hello?", "max_tokens": 2})
    gone = http.delete(f"/v1/sessions/{sid}")
    t.join(120)
    # the turn lasts 120 tokens (seconds on 2 cores), so both requests meet it running
    assert (second.status_code, gone.status_code, results["status"]) == (409, 409, 200), (second.text, gone.text)
    info = http.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in info["messages"]] == ["user", "assistant"] and not info["busy"]
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def test_restoring_a_missing_damaged_or_foreign_session_is_a_clear_error(smollm2_path, tmp_path):
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16))
    free = engine.stats()["blocks_free"]
    s = engine.session()
    s.chat("Hi", max_new_tokens=3)
    s.save(tmp_path / "good", include_kv=True)
    s.close()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "session.json").write_text('{"format": "liteturbo-session/1", "messages": [')  # truncated
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "session.json").write_text(json.dumps({"format": "llama.cpp-slot", "tokens": [1, 2]}))
    for path, words in ((tmp_path / "missing", "session.json missing"), (bad, "not JSON"),
                        (foreign, "lacks format")):
        with pytest.raises(LiteturboError, match=words):
            engine.load_session(path)
    assert engine.stats()["blocks_free"] == free and engine.stats()["running"] == 0  # nothing else changed


@pytest.mark.e2e
@pytest.mark.parametrize("kv", ["auto", "int8", "int4"])
def test_a_restored_session_reuses_its_saved_kv(smollm2_path, tmp_path, kv):
    cfg = EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16, kv_cache_dtype=kv,
                       enable_prefix_caching=False)  # no prefix cache: only the saved KV can give cached tokens
    engine = Engine(smollm2_path, cfg)
    s = engine.session(system="Be brief.")
    s.chat("Name a color.", max_new_tokens=6)
    n = s.seq.num_computed
    s.save(tmp_path / "s", include_kv=True)
    fresh = Engine(smollm2_path, cfg)  # a restart
    back = fresh.load_session(tmp_path / "s")
    back.chat("And another.", gen=GenerationConfig(max_new_tokens=3))
    assert n > 0 and back.last.cached_tokens >= n - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_with_batch_invariant_an_int4_sessions_next_turn_equals_the_stateless_request(tmp_path, dtype):
    """The next turn of a session (its last reply's K/V written by decode steps) and a stateless request over the same
    history (those K/V written by one prefill) write the same int4 codes under ``batch_invariant``, so the replies are
    the same token for token (docs/engine.md, "Same output alone or batched")."""
    from tiny_models import build_tiny_llama, save_word_tokenizer

    path = build_tiny_llama(tmp_path / "tiny", num_hidden_layers=2)
    save_word_tokenizer(path, 128, bos=True)
    engine = Engine(path, EngineConfig(dtype=dtype, max_kv_tokens=1024, block_size=16, kv_cache_dtype="int4",
                                       batch_invariant=True))
    g = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    for system in ("the of", "and to", "in a"):
        s = engine.session(system=system)
        s.chat("the of and to in a is that " * 3, gen=g)
        s.chat("for it of the", gen=g)
        ids = engine.chat_template_ids(s.messages[:-1])
        assert engine.generate(ids, g).token_ids == s.last.token_ids
        s.close()
