"""The HTTP server (turbo/serve/) in-process on a loopback port, over the RTN W4A16 SmolLM2, driven by the official
``openai`` client and raw httpx: results equal the engine's, streams equal non-streamed replies, every error has its
status and the OpenAI error shape, sessions prefill only new tokens, and a client that goes away frees its blocks."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from click.testing import CliRunner

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.cli import main
from turbo.serve.app import create_app
from turbo.serve.logprobs import UNLIKELY_LOGPROB

from conftest import serve_in_thread

pytestmark = pytest.mark.slow
KEY = "sk-test-key"
MODEL = "smollm2-test"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2_rtn_g64):
    """(base url, app) of a server on a free loopback port; stopped (and its engine loop) at the end."""
    engine = Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=2048, max_batch_size=8))
    app = create_app(engine, model_name=MODEL, api_keys=[KEY, "sk-other"], max_request_bytes=64 * 1024)
    url, stop = serve_in_thread(app)
    yield url, app
    stop()
    assert not app.state.loop.running  # the app's own loop stops with it


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def app(served):
    return served[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def engine_result(app, prompt, **gen):
    """What the engine itself produces for ``prompt`` (through the server's loop, from this thread)."""
    return app.state.loop.submit(prompt, GenerationConfig(**gen)).result()


def assert_error(r: httpx.Response, status: int, param=None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and contains in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def wait_until(cond, seconds: float = 2.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def idle_and_freed(engine) -> bool:
    """No request runs and every block is free except those of idle sessions' resident caches."""
    held = sum(len(s.block_table) for s in engine.scheduler.idle.values())
    return not engine.has_unfinished() and engine.block_manager.num_free == engine.block_manager.num_blocks - held


def test_health_models_and_api_keys(url, client, http):
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": MODEL}  # no key needed
    err = assert_error(httpx.get(f"{url}/v1/models"), 401, contains="no API key")
    assert err["code"] == "invalid_api_key"
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401, contains="not valid")
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-other"}).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert_error(http.get("/v1/nope"), 404, contains="no endpoint GET /v1/nope")
    assert_error(http.get("/v1/chat/completions"), 405)


def test_chat_equals_the_engine_streamed_or_not(app, client):
    engine = app.state.engine
    ids = engine.chat_template_ids(MSGS)
    ref = engine_result(app, ids, max_new_tokens=8)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # under one 64-token block: nothing to reuse

    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])

    # a list of text parts and the developer role read like a string and the system role
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": "You are terse."},
                  {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    plain = engine_result(app, engine.chat_template_ids([{"role": "system", "content": "You are terse."},
                                                         {"role": "user", "content": "Name a color."}]),
                          max_new_tokens=4)
    assert parts.choices[0].message.content == plain.text


def test_completions_prompt_forms_stream_and_logprobs(app, client):
    engine = app.state.engine
    ref = engine_result(app, "The sky is", max_new_tokens=6)
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text == ref.text and c.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(engine.encode("The sky is")) and r.usage.completion_tokens == 6
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the chosen token is the most likely
        assert len(top) == 2 and chosen == max(top.values()) < 0

    ids = client.completions.create(model=MODEL, prompt=engine.encode("The sky is"), max_tokens=6, temperature=0)
    assert ids.choices[0].text == ref.text
    streamed = list(client.completions.create(model=MODEL, prompt=["The sky is"], max_tokens=6, temperature=0,
                                              stream=True, logprobs=1))
    assert "".join(s.choices[0].text for s in streamed) == ref.text
    assert sum((s.choices[0].logprobs.token_logprobs for s in streamed if s.choices[0].logprobs), []) == \
        lp.token_logprobs

    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.logprob == t.top_logprobs[0].logprob != UNLIKELY_LOGPROB and len(t.top_logprobs) == 3
        assert bytes(t.bytes).decode() == t.token


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=8, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"top_k": 40, "min_p": 0.02})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    s = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert a == b == s and a


def test_concurrent_requests_share_the_batch(app, client):
    engine = app.state.engine
    steps0 = engine.counters.steps
    results = [None] * 3

    def one(i):
        stream = client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"min_tokens": 8})
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r for r in results)
    # alone they would take 3 x 8 steps (the prefill step gives the first token); together about 8 or 9
    assert engine.counters.steps - steps0 <= 16


def test_bad_requests_get_400_naming_the_field(app, http):
    def chat(**body):
        return http.post("/v1/chat/completions", json={"messages": MSGS, **body})

    def comp(**body):
        return http.post("/v1/completions", json={"prompt": "Hi", **body})

    raw = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert_error(raw, 400, contains="not valid JSON")
    assert_error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400, contains="must be a JSON object")
    assert_error(http.post("/v1/chat/completions", content=b""), 400, contains="body is empty")
    for body, param, text in [
        (dict(max_tokens=0), "max_tokens", "integer >= 1"), (dict(max_tokens=-5), "max_tokens", "got -5"),
        (dict(max_tokens="8"), "max_tokens", "integer"), (dict(temperature=-0.5), "temperature", ">= 0"),
        (dict(top_p=0), "top_p", "(0, 1]"), (dict(top_p=1.5), "top_p", "(0, 1]"),
        (dict(stream="yes"), "stream", "true or false"),
        (dict(stop=[""]), "stop", "non-empty"), (dict(seed=-1), "seed", ">= 0"),
        (dict(n=65), "n", "[1, 64]"), (dict(tools=[{"type": "function", "function": {"name": "f b"}}]), "tools", "letters"),
        (dict(response_format={"type": "json_schema", "json_schema": {}}), "response_format", "json_schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}), None,
         "json_schema cannot be used"),
        (dict(guided_regex="(ab"), None, "regex"), (dict(guided_choice=[]), "guided_choice", "non-empty list"),
        (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", "one structured-output"),
        (dict(tool_choice="required"), "tool_choice", "tools"),
        (dict(logit_bias={"42": 500}), None, "token 42 has 500"), (dict(frobnicate=1), "frobnicate", "unrecognized"),
        (dict(top_logprobs=2), "top_logprobs", "logprobs"), (dict(stream_options={"include_usage": True}),
                                                               "stream_options", "stream"),
        (dict(min_tokens=9, max_tokens=4), "min_tokens", "larger than"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages", "role"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages", "only text"),
        (dict(messages=[]), "messages", "non-empty"),
    ]:
        assert_error(chat(**body), 400, param, text)
    for body, param, text in [(dict(echo=True), "echo", "echo"), (dict(suffix="x"), "suffix", "suffix"),
                              (dict(best_of=2), "best_of", "best_of"), (dict(prompt=["a", "b"]), "prompt", "2 prompts"),
                              (dict(logprobs=21), "logprobs", "[0, 20]"), (dict(prompt=""), None, "prompt is empty")]:
        assert_error(comp(**body), 400, param, text)
    # a prompt longer than the session: both numbers in the message, before any work
    long_prompt = " ".join(["word"] * 2100)
    n = len(app.state.engine.encode(long_prompt))
    assert_error(comp(prompt=long_prompt), 400, contains=f"the prompt has {n} tokens but the context holds 2048")
    err = assert_error(chat(model="gpt-4"), 404, "model", "'smollm2-test'")
    assert err["code"] == "model_not_found"
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 70_000}), 413, contains="65536 bytes")
    assert not app.state.engine.has_unfinished()


def test_over_capacity_is_503_with_retry_after(app, http):
    loop = app.state.loop
    loop.max_waiting = 0  # every submission finds the queue full
    try:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    finally:
        loop.max_waiting = 256
    assert_error(r, 503, contains="waiting")
    assert r.headers["retry-after"] == "1"


def test_engine_failure_is_500_or_an_error_event(app, client, http, monkeypatch):
    def broken(step):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(app.state.engine.runner, "run", broken)
    assert_error(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 500,
                 contains="RuntimeError: kernel exploded")
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "kernel exploded" in json.loads(events[-2])["error"]["message"]
    with pytest.raises(openai.APIError, match="kernel exploded"):
        list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=True))
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens
    assert idle_and_freed(app.state.engine)


def test_sessions_prefill_only_new_tokens(app, client, http):
    r = http.post("/v1/sessions", json={"system": "You are terse.", "temperature": 0, "max_tokens": 6})
    assert r.status_code == 201
    sid = r.json()["id"]
    assert r.json()["defaults"] == {"temperature": 0, "max_tokens": 6}
    usages = []
    t1 = http.post(f"/v1/sessions/{sid}/chat", json={"content": "What is the capital of France?"}).json()
    usages.append(t1["usage"])
    with http.stream("POST", f"/v1/sessions/{sid}/chat", json={"content": "And of Japan?", "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["finish_reason"] in ("stop", "length")
    usages.append(events[-1]["usage"])
    text2 = "".join(e["delta"] for e in events)
    # the session_id extension: a turn with the last user message, in the chat completion shape
    t3 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "And of Italy?"}],
                                        extra_body={"session_id": sid})
    usages.append(t3.usage.model_dump())
    # every turn computes only what the last one left uncomputed: the cache holds all but the last reply token
    for prev, cur in zip(usages, usages[1:]):
        assert cur["prompt_tokens_details"]["cached_tokens"] == prev["prompt_tokens"] + prev["completion_tokens"] - 1
        assert cur["prompt_tokens"] - cur["prompt_tokens_details"]["cached_tokens"] < 20
    info = http.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in info["messages"]] == ["system"] + ["user", "assistant"] * 3
    assert info["messages"][2]["content"] == t1["content"] and info["messages"][4]["content"] == text2
    assert info["messages"][6]["content"] == t3.choices[0].message.content
    assert info["tokens"] == usages[-1]["total_tokens"] and not info["busy"]
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    assert_error(http.get(f"/v1/sessions/{sid}"), 404, contains="no session")
    assert_error(http.post(f"/v1/sessions/{sid}/chat", json={"content": "Hi"}), 404)
    assert_error(http.post("/v1/sessions", json={"temperature": -1}), 400, "temperature")
    assert idle_and_freed(app.state.engine)


def test_create_session_opens_a_client_named_session_from_chat_completions(app, client, http):
    """What a client behind sglang-router does (no POST /v1/sessions reaches a replica): it names the session, sends
    ``create_session`` with every turn, and the first one opens it with the leading system message."""
    from turbo.session_ids import new_session_id

    sid = new_session_id()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
    usages = []
    for text in ("What is the capital of France?", "And of Japan?"):
        msgs[-1]["content"] = text
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"session_id": sid, "create_session": True})
        usages.append(r.usage.model_dump())
    # the second turn continued the first (same session, its KV reused), the system prompt kept once
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[0]["prompt_tokens"] + usages[0]["completion_tokens"] - 1
    info = http.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in info["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert info["messages"][0]["content"] == "You are terse."
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "create_session": True}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "create_session", "session_id")
    assert_error(http.post("/v1/chat/completions", json=dict(body, session_id="my-session")), 400, "session_id")
    assert_error(http.post("/v1/chat/completions", json=dict(body, session_id=sid, create_session="yes")), 400,
                 "create_session")
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    assert idle_and_freed(app.state.engine)


def test_a_session_id_in_sglang_routers_header_is_a_session_turn(app, http):
    """sglang-router forwards ``x-smg-routing-key`` and re-writes the body: drops ``session_id`` and adds its own
    fields at their defaults. The header's session id opens and continues the session; another key is only the
    router's; the router's fields at other values are refused by name."""
    from turbo.session_ids import new_session_id

    sid = new_session_id()
    forwarded = {"model": MODEL, "max_tokens": 5, "temperature": 0, "logprobs": False, "ignore_eos": False,
                 "continue_final_message": False, "no_stop_trim": False, "return_hidden_states": False,
                 "separate_reasoning": True, "skip_special_tokens": True, "stream_reasoning": True}
    usages = []
    for text in ("Name a colour.", "Another one."):
        r = http.post("/v1/chat/completions", headers={"x-smg-routing-key": sid},
                      json=dict(forwarded, messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": text}]))
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[0]["total_tokens"] - 1
    assert [m["role"] for m in http.get(f"/v1/sessions/{sid}").json()["messages"]] == \
        ["system", "user", "assistant", "user", "assistant"]
    assert http.delete(f"/v1/sessions/{sid}").json()["deleted"] is True
    # a key that is not a session id: a plain request (both system and user messages are its prompt)
    r = http.post("/v1/chat/completions", headers={"x-smg-routing-key": "user-42"},
                  json=dict(forwarded, messages=[{"role": "user", "content": "Hi"}]))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert http.get("/v1/sessions/user-42").status_code == 404
    hi = dict(forwarded, messages=[{"role": "user", "content": "Hi"}])
    # a key that starts like a session id but breaks the rule, or names another session than the body: 400
    assert_error(http.post("/v1/chat/completions", headers={"x-smg-routing-key": "sess-ABC"}, json=hi), 400,
                 "x-smg-routing-key", "24 lowercase hex")
    assert_error(http.post("/v1/chat/completions", headers={"x-smg-routing-key": sid},
                           json=dict(hi, session_id=new_session_id())), 400, "session_id", "two sessions")
    # what sglang-router asks a replica when it registers it: the id clients pass as model
    assert http.get("/get_model_info").json()["served_model_name"] == MODEL
    assert_error(http.post("/v1/chat/completions", json=dict(forwarded, messages=[{"role": "user", "content": "Hi"}],
                                                             skip_special_tokens=False)), 400, "skip_special_tokens")
    assert idle_and_freed(app.state.engine)


def test_busy_session_is_409_and_a_dropped_stream_frees_it(app, http):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    long_turn = {"content": "Tell me a long story.", "stream": True, "max_tokens": 1000, "min_tokens": 1000,
                 "on_disconnect": "keep"}
    with http.stream("POST", f"/v1/sessions/{sid}/chat", json=long_turn) as s:
        lines = s.iter_lines()  # kept: a dropped iterator closes the response
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["delta"] is not None
        err = assert_error(http.post(f"/v1/sessions/{sid}/chat", json={"content": "Hi"}), 409,
                           contains="still being generated")
        assert err["type"] == "conflict_error"
        assert_error(http.delete(f"/v1/sessions/{sid}"), 409)
    # the client closed the stream early: the turn is cancelled, its partial reply kept ("keep"), the session usable
    assert wait_until(lambda: not http.get(f"/v1/sessions/{sid}").json()["busy"])
    info = http.get(f"/v1/sessions/{sid}").json()
    assert info["last_usage"]["completion_tokens"] < 1000 and info["messages"][-1]["role"] == "assistant"
    assert wait_until(lambda: idle_and_freed(app.state.engine))
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def test_disconnected_clients_free_their_blocks(app, client, url):
    engine = app.state.engine
    long = dict(model=MODEL, messages=MSGS, max_tokens=1000, extra_body={"min_tokens": 1000})
    stream = client.chat.completions.create(stream=True, **long)
    for _, chunk in zip(range(3), stream):
        pass
    assert engine.has_unfinished()
    t0 = time.time()
    stream.close()
    assert wait_until(lambda: idle_and_freed(engine)), engine.stats()
    streamed_cancel = time.time() - t0
    # not streaming: the server notices the closed connection while it waits, and cancels
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0,
                   json={"messages": MSGS, "max_tokens": 1000, "min_tokens": 1000})
    assert wait_until(lambda: idle_and_freed(engine)), engine.stats()
    assert streamed_cancel < 2.0


def test_cli_serve_options_and_bad_port():
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for opt in ("--host", "--port", "--api-keys", "--device", "--backend", "--kv-cache-dtype", "--quant-policy",
                "--max-batch-size", "--session-len", "--cache-max-entry-count", "LITETURBO_API_KEYS", "127.0.0.1",
                "23333"):
        assert opt in r.output, opt
    r = CliRunner().invoke(main, ["serve", "--port", "70000"])
    assert r.exit_code == 2 and "port must be an integer in [0, 65535], got 70000" in r.output


def test_metrics_count_requests_tokens_and_latencies(url, http):
    def scrape():
        r = httpx.get(f"{url}/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        vals = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, v = line.rsplit(" ", 1)
                vals[name] = float(v)
        return vals

    before = scrape()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is", "max_tokens": 5,
                                           "temperature": 0})
    assert r.status_code == 200
    after = scrape()
    assert after["liteturbo_generated_tokens_total"] - before.get("liteturbo_generated_tokens_total", 0) == 5
    assert after["liteturbo_time_to_first_token_seconds_count"] - before.get(
        "liteturbo_time_to_first_token_seconds_count", 0) == 1
    assert after['liteturbo_requests_finished_total{reason="length"}'] >= 1
    assert after["liteturbo_kv_blocks_total"] > 0 and after["liteturbo_requests_running"] == 0
    assert 0 <= after["liteturbo_prefix_cache_hit_rate"] <= 1 and "liteturbo_sessions" in after


@pytest.mark.e2e
def test_sessions_survive_a_server_restart_with_the_same_tokens(smollm2_rtn_g64, tmp_path):
    """Three turns, the server restarted with the same session dir, a fourth turn: the same tokens as four turns
    without a restart."""
    from turbo.engine_proc.sessions import SessionRegistry

    turns = ["Hi! My name is Ada.", "What is 2+2?", "Name a color.", "What is my name?"]
    body = {"max_tokens": 12, "temperature": 0}

    def engine():
        return Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=2048, max_batch_size=8))

    ref = engine().session()
    want = [ref.chat(t, max_new_tokens=12) for t in turns]

    def app_with(eng):
        return create_app(eng, model_name=MODEL, api_keys="",
                          sessions=SessionRegistry(eng, session_dir=tmp_path / "sessions"))

    url1, stop1 = serve_in_thread(app_with(engine()))
    sid = httpx.post(f"{url1}/v1/sessions", json={}, timeout=60).json()["id"]
    got = [httpx.post(f"{url1}/v1/sessions/{sid}/chat", json={"content": t, **body}, timeout=120).json()
           for t in turns[:3]]
    stop1()
    url2, stop2 = serve_in_thread(app_with(engine()))
    try:
        r = httpx.post(f"{url2}/v1/sessions/{sid}/chat", json={"content": turns[3], **body}, timeout=120).json()
        hist = httpx.get(f"{url2}/v1/sessions/{sid}", timeout=60).json()
    finally:
        stop2()
    assert [g["content"] for g in got + [r]] == want, (got, r)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the saved KV came back with the session
    assert [m["content"] for m in hist["messages"] if m["role"] == "assistant"] == want


def test_chat_url_talks_to_the_server_through_sessions(url, app):
    msgs = ["What is the capital of France?", "And of Italy?"]
    before = len(app.state.sessions)
    r = CliRunner().invoke(main, ["chat", "--url", url.removeprefix("http://"), "--api-key", KEY,
                                  "--max-new-tokens", "10"],
                           input="\n".join(msgs + ["/reset", msgs[0], "/exit"]) + "\n")
    assert r.exit_code == 0, r.output
    assert len(app.state.sessions) == before  # the chat deleted its session when it ended
    s = app.state.engine.session()
    want = [app.state.loop.submit_chat(s, m, GenerationConfig(max_new_tokens=10)).result().text for m in msgs]
    s.close()
    assert f"assistant: {want[0]}\n" in r.output and f"assistant: {want[1]}\n" in r.output
    assert r.output.count(f"assistant: {want[0]}\n") == 2  # after /reset the first answer comes again
    bad = CliRunner().invoke(main, ["chat", "--url", url, "--api-key", "sk-wrong"], input="hi\n")
    assert bad.exit_code == 2 and "401" in bad.output


def test_deep_json_and_null_bodies_are_400(http):
    deep = "[" * 20000 + "]" * 20000
    r = http.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert_error(r, 400, contains="nests JSON")
    assert_error(http.post("/v1/completions", content="null", headers={"Content-Type": "application/json"}), 400,
                 contains="got a JSON null")


def test_unknown_v1_paths_need_a_key_first_and_head_of_the_page(url, http):
    assert_error(httpx.get(f"{url}/v1/nope", timeout=30), 401)
    assert_error(http.get("/v1/nope"), 404, contains="no endpoint GET /v1/nope")
    assert httpx.head(f"{url}/", timeout=30).status_code == 200
