"""The agents' API end to end through HTTP (turbo/serve/answer.py, structured.py, tools.py, tool_parsers/,
logprobs.py): ``n`` > 1 choices (seeds, streams, usage, a shared prefill), structured outputs (json_schema, json_object,
vLLM's guided_* and structured_outputs, the token limit, a session turn, logprobs under a constraint), tool calls
(required, named, none, tool messages, parallel_tool_calls, a repeated call), and the same across the engine process
of `liteturbo serve`. Over the float32 SmolLM2 (greedy replies are deterministic), driven by the official ``openai``
client and raw httpx; replies are checked with jsonschema, Python's regex and llguidance's token bytes."""
from __future__ import annotations

import json
import math
import os
import re
import signal

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.errors import InvalidRequest
from turbo.core.inputs import encode
from turbo.serve import protocol, tools
from turbo.serve.app import create_app
from turbo.serve.logprobs import UNLIKELY_LOGPROB

from conftest import serve_in_thread

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # the end-to-end tier (README)
MODEL = "smol"
BLOCK = 16
MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "skills", "address"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["engineer", "artist", "teacher", "doctor", "other"]},
                         "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1,
                                    "maxItems": 2},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "country": {"type": "string", "maxLength": 16}}}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "pop"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "pop": {"type": "integer", "minimum": 0, "maximum": 100000000}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a time zone",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                       "properties": {"timezone": {"type": "string", "maxLength": 20}}}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]
TOKYO = [{"role": "user", "content": "What time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    """(base url, app) of a server over the float32 SmolLM2 (KV blocks of 16 tokens); stopped at the end."""
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=BLOCK,
                                               max_batch_size=8))
    app = create_app(engine, model_name=MODEL, api_keys="")
    url, stop = serve_in_thread(app)
    yield url, app
    stop()


@pytest.fixture(scope="module")
def app(served):
    return served[1]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0], timeout=120) as c:
        yield c


def error(r: httpx.Response, status: int, param=None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert contains in err["message"] and (param is None or err["param"] == param), err
    return err


def strict_json(text: str):
    """``json.loads`` that refuses NaN and +-Infinity (not JSON, though Python's parser takes them)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def sse(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [strict_json(x) for x in lines[:-1]]


def valid(text: str | None, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def joined(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons per choice index of an openai stream (chat or completions), and its last chunk."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    last = None
    for chunk in stream:
        last = chunk
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, last


# --- n > 1 -----------------------------------------------------------------------------------------------------------

def test_n_chat_choices_repeat_with_seeds_and_stream_the_same(app, client):
    kw = dict(model=MODEL, messages=MSGS, temperature=0.9, seed=7, max_tokens=10, extra_body={"min_tokens": 10})
    a = client.chat.completions.create(n=3, logprobs=True, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) > 1  # each choice draws with its own seed
    assert [c.message.content for c in client.chat.completions.create(n=3, **kw).choices] == texts
    for i in (0, 1):  # choice i is the request with seed + i alone
        alone = client.chat.completions.create(**dict(kw, seed=7 + i))
        assert alone.choices[0].message.content == texts[i]
    assert [len(c.logprobs.content) for c in a.choices] == [10, 10, 10]
    assert a.usage.prompt_tokens == len(app.state.engine.chat_template_ids(MSGS))  # the prompt counted once
    assert a.usage.completion_tokens == 30 and a.usage.total_tokens == a.usage.prompt_tokens + 30

    got, finish, last = joined(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True},
                                                              **kw))
    assert [got[i] for i in range(3)] == texts and finish == {0: "length", 1: "length", 2: "length"}
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == \
        (a.usage.prompt_tokens, 30)


def test_n_completions_choices_streamed_and_not(app, client):
    kw = dict(model=MODEL, prompt="The sea is", temperature=0.9, seed=3, max_tokens=8, extra_body={"min_tokens": 8})
    a = client.completions.create(n=2, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1] and texts[0] != texts[1]
    assert [c.text for c in client.completions.create(n=2, **kw).choices] == texts
    assert client.completions.create(**kw).choices[0].text == texts[0]
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (len(app.state.engine.encode("The sea is")), 16)
    got, finish, last = joined(client.completions.create(n=2, stream=True, stream_options={"include_usage": True},
                                                         **kw))
    assert [got[0], got[1]] == texts and finish == {0: "length", 1: "length"}
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (a.usage.prompt_tokens, 16)


def test_n_out_of_range_or_with_a_session_is_400(http):
    error(http.post("/v1/chat/completions", json={"messages": MSGS, "n": 65}), 400, "n", "[1, 64]")
    error(http.post("/v1/completions", json={"prompt": "Hi", "n": 65}), 400, "n", "[1, 64]")
    error(http.post("/v1/completions", json={"prompt": "Hi", "n": 0}), 400, "n")
    error(http.post("/v1/chat/completions", json={"messages": MSGS, "n": 2, "session_id": "sess-" + "0" * 24}), 400,
          "n", "session")


def test_later_choices_reuse_the_prompts_kv(app, http):
    engine = app.state.engine
    prompt = "Once upon a time in a small harbour town there lived an old lighthouse keeper named Tobias who " * 3
    p = len(engine.encode(prompt))
    assert p > 2 * BLOCK and p % BLOCK
    before = engine.stats()["prefill_tokens"]
    r = http.post("/v1/completions", json={"prompt": prompt, "n": 4, "max_tokens": 2, "seed": 1})
    assert r.status_code == 200, r.text
    grown = engine.stats()["prefill_tokens"] - before
    # the first choice computes the prompt; the others take its full blocks and compute only the last partial one
    assert p <= grown <= p + 3 * (p % BLOCK), (p, grown)
    assert r.json()["usage"]["prompt_tokens"] == p and r.json()["usage"]["completion_tokens"] == 8


# --- structured outputs ----------------------------------------------------------------------------------------------

def _person_msgs(who: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {who} as a JSON object."}]


def test_json_schema_replies_validate_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=MODEL, messages=_person_msgs("a French chef"), response_format=fmt, max_tokens=150, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and valid(r.choices[0].message.content, PERSON), r.choices[0]
    got, finish, _ = joined(client.chat.completions.create(stream=True, **kw))
    assert got[0] == r.choices[0].message.content and finish[0] == "stop"
    sampled = client.chat.completions.create(**dict(kw, messages=_person_msgs("an old fisherman"), temperature=0.8,
                                                    seed=5))
    assert sampled.choices[0].finish_reason == "stop" and valid(sampled.choices[0].message.content, PERSON)
    ask = [{"role": "user", "content": "Give a JSON object with the key ok set to true."}]
    obj = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_a_token_limit_inside_the_schema_ends_with_length_never_stop(http):
    body = {"messages": [{"role": "user", "content": "Describe Paris as JSON."}], "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}}
    full = http.post("/v1/chat/completions", json=dict(body, max_tokens=60)).json()
    text, k = full["choices"][0]["message"]["content"], full["usage"]["completion_tokens"]
    assert full["choices"][0]["finish_reason"] == "stop" and valid(text, CITY) and k > 4
    for limit in (k - 1, k // 2):
        cut = http.post("/v1/chat/completions", json=dict(body, max_tokens=limit)).json()["choices"][0]
        assert cut["finish_reason"] == "length" and text.startswith(cut["message"]["content"]), (limit, cut)
        events = sse(http.post("/v1/chat/completions", json=dict(body, max_tokens=limit, stream=True)))
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert not valid(cut["message"]["content"], CITY)


def test_vllm_guided_fields_and_structured_outputs_hold(client):
    def ask(q: str, max_tokens: int = 12, **extra) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], temperature=0,
                                           max_tokens=max_tokens, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", ask("Name a city and a number.",
                                                           guided_regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"))
    assert ask("Is the sky blue?", guided_choice=["yes", "no"]) in ("yes", "no")
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", ask("What is 2+3?", guided_grammar=lark))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", ask("Give a phone number.",
                                                  structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"}))
    assert ask("Pick a fruit.", structured_outputs={"choice": ["apple", "pear"]}) in ("apple", "pear")
    guided = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["green", "purple"]})
    assert guided.choices[0].text in ("green", "purple") and guided.choices[0].finish_reason == "stop"


def test_a_gbnf_grammar_holds(http):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Pick a color."}], "temperature": 0, "max_tokens": 12,
        "guided_grammar": 'root ::= "color: " ("red" | "green" | "blue")'})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("color: red", "color: green", "color: blue")


def test_bad_or_double_constraints_are_400(http):
    def chat(**body):
        return http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body})

    error(chat(guided_choice=["a"], structured_outputs={"regex": "b"}), 400, contains="one structured-output")
    error(chat(response_format={"type": "json_object"}, guided_json=CITY), 400, "guided_json", "one structured-output")
    error(chat(structured_outputs={"regex": "a", "choice": ["b"]}), 400, "structured_outputs", "exactly one")
    for schema, reason in (({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
                           ({"$ref": "#/$defs/missing"}, "/$defs/missing"),
                           ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater")):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        err = error(chat(response_format=fmt), 400, contains=reason)
        assert err["type"] == "invalid_request_error" and "json_schema" in err["message"]
    error(chat(guided_grammar="start: undefined_rule"), 400, contains="grammar")


def test_a_session_turn_keeps_its_format_and_the_next_turn_is_free(app, http):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    turns = [("Describe Paris as JSON.", {"response_format": fmt}, GenerationConfig(json_schema=CITY)),
             ("Now say hello in plain words.", {}, GenerationConfig())]
    sid = http.post("/v1/sessions", json={}).json()["id"]
    got = []
    for content, extra, _ in turns:
        r = http.post(f"/v1/sessions/{sid}/chat", json={"content": content, "temperature": 0, "max_tokens": 40,
                                                        **extra})
        assert r.status_code == 200, r.text
        got.append(r.json())
    assert got[0]["finish_reason"] == "stop" and valid(got[0]["content"], CITY)
    assert not got[1]["content"].lstrip().startswith("{")  # no JSON is forced on the free turn
    s = app.state.engine.session()  # the engine's own session, the first turn constrained, the second not
    want = [app.state.loop.submit_chat(s, content, GenerationConfig(
        temperature=0, max_new_tokens=40, json_schema=g.json_schema)).result().text for content, _, g in turns]
    s.close()
    assert [g["content"] for g in got] == want
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200


def _allowed_first_tokens(app, choices: list[str]) -> set[bytes]:
    """Every token of the model whose bytes are a non-empty prefix of one of ``choices`` (llguidance's bytes)."""
    import llguidance.hf

    lt = llguidance.hf.from_tokenizer(app.state.engine.tokenizer)
    enc = [c.encode() for c in choices]
    out = set()
    for t in range(len(app.state.engine.tokenizer)):
        raw = lt.decode_bytes([t])
        if raw and any(c.startswith(raw) for c in enc):
            out.add(raw)
    return out


def _check_alternatives(content, choices: list[str]) -> None:
    done = b""
    for entry in content:
        assert entry.logprob != UNLIKELY_LOGPROB
        for alt in entry.top_logprobs:
            assert any(c.encode().startswith(done + bytes(alt.bytes)) for c in choices), (done, alt)
            assert math.isfinite(alt.logprob)
        done += bytes(entry.bytes)
    assert done.decode() in choices


def test_logprobs_under_a_constraint_show_only_allowed_tokens(app, client):
    choices = ["yes", "no"]
    allowed = _allowed_first_tokens(app, choices)
    assert {b"yes", b"no"} <= allowed and len(allowed) <= 5
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], temperature=0, max_tokens=5,
              logprobs=True, top_logprobs=5, extra_body={"guided_choice": choices})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    _check_alternatives(content, choices)
    first = content[0].top_logprobs
    assert {bytes(a.bytes) for a in first} == allowed  # every allowed token, and they hold all the probability
    assert sum(math.exp(a.logprob) for a in first) == pytest.approx(1.0, abs=1e-3)
    streamed = [e.choices[0].logprobs.content for e in client.chat.completions.create(stream=True, **kw)
                if e.choices and e.choices[0].logprobs and e.choices[0].logprobs.content]
    streamed = [x for part in streamed for x in part]
    # the same tokens and alternatives (the values may differ in the last bits: the prompt's KV now comes from the
    # prefix cache, computed in other chunks)
    assert [(x.bytes, [a.bytes for a in x.top_logprobs]) for x in streamed] == \
        [(x.bytes, [a.bytes for a in x.top_logprobs]) for x in content]
    assert [a.logprob for x in streamed for a in x.top_logprobs] == \
        pytest.approx([a.logprob for x in content for a in x.top_logprobs], abs=1e-4)


def test_more_top_logprobs_than_allowed_tokens_are_left_out(served):
    # a client of its own: after a 500 here the server drops the connection
    with httpx.Client(base_url=served[0], timeout=120) as http:
        body = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "temperature": 0, "max_tokens": 5,
                "logprobs": True, "top_logprobs": 20, "guided_choice": ["yes", "no"]}
        for e in sse(http.post("/v1/chat/completions", json=dict(body, stream=True))):  # strict JSON: no -Infinity
            for entry in e["choices"][0]["logprobs"]["content"]:
                assert 2 <= len(entry["top_logprobs"]) <= 5
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        entry = strict_json(r.text)["choices"][0]["logprobs"]["content"][0]
        assert 2 <= len(entry["top_logprobs"]) <= 5
        r = http.post("/v1/completions", json={"prompt": "Is the sky blue?", "max_tokens": 5, "temperature": 0,
                                               "logprobs": 20, "guided_choice": ["yes", "no"]})
        assert r.status_code == 200 and len(strict_json(r.text)["choices"][0]["logprobs"]["top_logprobs"][0]) <= 5


# --- tools -----------------------------------------------------------------------------------------------------------

def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _stream_message(client, **kw):
    """The message and finish reason the openai client's own accumulator assembles from a stream."""
    state = ChatCompletionStreamState()
    finishes = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    final = state.get_final_completion().choices[0]
    assert finishes == [final.finish_reason]
    return final.message, final.finish_reason


def test_required_tool_calls_validate_and_stream_the_same(client):
    kw = dict(model=MODEL, messages=TOKYO, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in PARAMS
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    msg, finish = _stream_message(client, **kw)
    assert finish == "tool_calls" and _calls(msg) == _calls(choice.message) and not msg.content


def test_a_call_cut_by_max_tokens_is_dropped_whole_streamed_or_not(client, http):
    # issue 39: the call cut by max_tokens came back with arguments that are not JSON and "<tool_call" in content
    kw = dict(model=MODEL, messages=PARIS + [{"role": "user", "content": "And the time in Tokyo and Lima?"}],
              tools=TOOLS, tool_choice="required", temperature=0)
    full = client.chat.completions.create(max_tokens=200, **kw)
    whole = _calls(full.choices[0].message)
    assert len(whole) >= 2, whole  # a second call exists to cut
    n = full.usage.completion_tokens
    kept = []
    for limit in (3, 9, n // 2 + 3, n - 12):
        r = client.chat.completions.create(max_tokens=limit, **kw).choices[0]
        calls = _calls(r.message)  # json.loads: every returned call is complete JSON
        assert r.finish_reason == "length" and calls == whole[:len(calls)], (limit, r)
        kept.append(len(calls))
        for name, args in calls:
            jsonschema.validate(args, PARAMS[name])
        assert not r.message.content or "<tool" not in r.message.content and "{" not in r.message.content, r
        # streamed (raw events: the openai client's accumulator refuses a "length" finish)
        events = sse(http.post("/v1/chat/completions", json=dict(kw, max_tokens=limit, stream=True)))
        deltas = [c["delta"] for e in events for c in e["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        streamed: dict[int, list] = {}
        for d in deltas:
            for c in d.get("tool_calls") or ():
                entry = streamed.setdefault(c["index"], [c.get("function", {}).get("name"), ""])
                entry[1] += c["function"].get("arguments", "")
        assert [(name, json.loads(a)) for name, a in streamed.values()] == calls
        assert (content or None) == (r.message.content or None)
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert kept[0] == 0 and any(0 < k < len(whole) for k in kept), kept  # cut in the first call, and in a later one


def test_required_calls_over_open_schemas_end(client):
    # issue 39: schemas written without additionalProperties; SmolLM2 kept inventing keys until max_tokens
    open_tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "Current local time in a time zone",
            "parameters": {"type": "object", "required": ["timezone"], "properties": {
                "timezone": {"type": "string"}}}}}]
    closed = {t["function"]["name"]: dict(t["function"]["parameters"], additionalProperties=False)
              for t in open_tools}
    asks = ["What is the weather in Paris?", "What time is it in Tokyo?", "Is it raining in Oslo, in f?"]
    for i, ask in enumerate(asks * 2):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ask}], tools=open_tools, tool_choice="required",
            parallel_tool_calls=False, max_tokens=120, temperature=0 if i < len(asks) else 0.7, seed=i)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (ask, choice)
        (name, args), = _calls(choice.message)
        jsonschema.validate(args, closed[name])


def test_a_named_tool_choice_calls_that_function(client):
    kw = dict(model=MODEL, messages=PARIS, tools=TOOLS, max_tokens=100, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.chat.completions.create(**kw)
    calls = _calls(r.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"] and r.choices[0].finish_reason == "stop"  # OpenAI's answer
    jsonschema.validate(calls[0][1], PARAMS["get_time"])
    msg, finish = _stream_message(client, **kw)
    assert _calls(msg) == calls and finish == "stop"


def test_tool_choice_none_answers_in_plain_text(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, tools=TOOLS, tool_choice="none", max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_tool_result_reaches_the_prompt(app, client, http):
    args = {"city": "Paris", "unit": "celsius"}
    convo = PARIS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 17, "sky": "cloudy"}'}]
    r = client.chat.completions.create(model=MODEL, messages=convo, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tok = app.state.engine.tokenizer
    text = tools.render_prompt(tok, protocol.read_messages(convo), tools.read_tools(TOOLS))
    assert '{"temperature": 17, "sky": "cloudy"}' in text and '"city": "Paris"' in text
    assert r.usage.prompt_tokens == len(encode(tok, text, add_special_tokens=False))
    plain = client.chat.completions.create(model=MODEL, messages=PARIS, tools=TOOLS, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    error(http.post("/v1/chat/completions", json={"messages": convo[:1] + convo[2:], "tools": TOOLS}), 400,
          "messages", "tool_call_id")


def test_required_tools_with_a_response_format_is_400(http):
    error(http.post("/v1/chat/completions", json={"messages": PARIS, "tools": TOOLS, "tool_choice": "required",
                                                  "response_format": {"type": "json_object"}}), 400, "tool_choice")


def test_parallel_calls_stop_at_a_repeat_and_parallel_false_keeps_one(app, client):
    kw = dict(model=MODEL, messages=PARIS, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0)
    # what the engine writes under the same grammar, unread: calls until the token limit
    tok = app.state.engine.tokenizer
    req = tools.read_tools(TOOLS, "required")
    ids = encode(tok, tools.render_prompt(tok, protocol.read_messages(PARIS), req), add_special_tokens=False)
    raw = app.state.loop.submit(ids, GenerationConfig(temperature=0, max_new_tokens=160, grammar=tools.call_grammar(
        req, "hermes", tok))).result()
    written = [json.loads(b) for b in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", raw.text)]
    written = [(c["name"], c["arguments"]) for c in written]
    first_repeat = next(i for i, c in enumerate(written) if c in written[:i])  # this model repeats itself
    assert first_repeat >= 2
    r = client.chat.completions.create(**kw)
    assert _calls(r.choices[0].message) == written[:first_repeat] and r.choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens < len(raw.token_ids)  # the repeat stopped the generation
    one = client.chat.completions.create(parallel_tool_calls=False, **kw)
    assert _calls(one.choices[0].message) == written[:1] and one.choices[0].finish_reason == "tool_calls"


# --- the engine process (`liteturbo serve`) --------------------------------------------------------------------------

def test_engine_process_serves_n_guided_and_refuses_a_bad_schema(smollm2_path):
    from test_engine_process import _start_server

    proc, url = _start_server(smollm2_path, "--model-name", "w")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="w", messages=MSGS, temperature=0.9, seed=11, max_tokens=8)
        a = client.chat.completions.create(n=3, **kw)
        texts = [c.message.content for c in a.choices]
        assert [c.index for c in a.choices] == [0, 1, 2] and len(set(texts)) > 1
        assert [c.message.content for c in client.chat.completions.create(n=3, **kw).choices] == texts
        assert client.chat.completions.create(**kw).choices[0].message.content == texts[0]
        g = client.chat.completions.create(model="w", messages=[{"role": "user", "content": "Pick a color."}],
                                           temperature=0, max_tokens=8,
                                           extra_body={"guided_choice": ["red", "green", "blue"]})
        assert g.choices[0].message.content in ("red", "green", "blue") and g.choices[0].finish_reason == "stop"
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                             "pattern": "(?<=a)b"}}}
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS, "response_format": fmt}, timeout=60)
        err = error(r, 400, contains="look-around")
        assert err["type"] == "invalid_request_error"
        # a session's tool turns cross the process boundary (tools and the tool result ride the "chat" message)
        sid = httpx.post(f"{url}/v1/sessions", json={}, timeout=60).json()["id"]
        t = httpx.post(f"{url}/v1/sessions/{sid}/chat", timeout=120, json={
            "content": "What time is it in Tokyo?", "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}).json()
        assert [c["function"]["name"] for c in t["tool_calls"]] == ["get_time"]
        res = httpx.post(f"{url}/v1/sessions/{sid}/chat", timeout=120, json={
            "role": "tool", "tool_call_id": t["tool_calls"][0]["id"], "content": "09:00", "max_tokens": 4})
        assert res.status_code == 200, res.text
        msgs = httpx.get(f"{url}/v1/sessions/{sid}", timeout=60).json()["messages"]
        assert msgs[-2]["role"] == "tool" and msgs[-2]["content"] == "09:00"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # the engine process lives on
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_session_turns_call_tools_and_take_tool_results(app, http):
    """Tools on the sessions API: a turn with tools and tool_choice required answers tool_calls (streamed the same),
    a tool-result turn (role tool) is rendered with the session's tools into the prompt, statelessly equal, and the
    session reuses its KV; the chat completions session path takes a tool message too."""
    tok = app.state.engine.tokenizer
    turn = {"content": "What's the weather in Paris?", "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 0}
    sids = [http.post("/v1/sessions", json={}).json()["id"] for _ in range(2)]
    body = http.post(f"/v1/sessions/{sids[0]}/chat", json=turn).json()
    calls = body["tool_calls"]
    assert body["finish_reason"] == "tool_calls" and body["content"] is None and calls
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])
    chunks = sse(http.post(f"/v1/sessions/{sids[1]}/chat", json=dict(turn, stream=True)))
    got: dict[int, list[str]] = {}
    for ch in chunks:
        for tc in ch.get("tool_calls", []):
            g = got.setdefault(tc["index"], ["", "", ""])
            g[0] += tc.get("function", {}).get("name", "")
            g[1] += tc.get("function", {}).get("arguments", "")
            g[2] += tc.get("id", "")
    assert [(n, json.loads(a)) for n, a, _ in got.values()] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # the session keeps the turn with its calls and the ids it sent (issue 39: it kept only the text)
    kept = http.get(f"/v1/sessions/{sids[0]}").json()["messages"][-1]
    assert [c["id"] for c in kept["tool_calls"]] == [c["id"] for c in calls] and kept["content"] is None
    assert [c["function"]["arguments"] for c in kept["tool_calls"]] == [
        json.loads(c["function"]["arguments"]) for c in calls]
    kept1 = http.get(f"/v1/sessions/{sids[1]}").json()["messages"][-1]
    assert [c["id"] for c in kept1["tool_calls"]] == [g[2] for g in got.values()]
    # a tool turn naming an id no open call has: 400 naming tool_call_id, the session unchanged
    before = http.get(f"/v1/sessions/{sids[0]}").json()["messages"]
    for wrong in ("call_nope", got[0][2]):  # made up; a call of the other session
        r = http.post(f"/v1/sessions/{sids[0]}/chat", json={"role": "tool", "tool_call_id": wrong, "content": "18"})
        assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"], r.text
        r = http.post("/v1/chat/completions", json={"session_id": sids[0], "max_tokens": 4, "messages": [
            {"role": "tool", "tool_call_id": wrong, "content": "18"}]})
        assert r.status_code == 400, r.text
    assert http.get(f"/v1/sessions/{sids[0]}").json()["messages"] == before
    # the tool's result, on a turn without tools: the session renders its tools again
    res = http.post(f"/v1/sessions/{sids[0]}/chat", json={"role": "tool", "tool_call_id": calls[0]["id"],
                                                          "content": '{"temp": 18}', "max_tokens": 8,
                                                          "temperature": 0}).json()
    info = http.get(f"/v1/sessions/{sids[0]}").json()
    msgs = info["messages"]
    assert msgs[-2] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": calls[0]["id"]}
    want = encode(tok, tools.render_prompt(tok, msgs[:-1], tools.read_tools(TOOLS)), add_special_tokens=False)
    assert res["usage"]["prompt_tokens"] == len(want) and "<tool_response>" in tok.decode(want)
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # the chat completions spelling of the same turn: the last message is the tool's result
    r = http.post("/v1/chat/completions", json={"session_id": sids[1], "max_tokens": 4, "messages": [
        {"role": "tool", "tool_call_id": got[0][2], "content": '{"temp": 18}'}]})
    assert r.status_code == 200, r.text
    # answered: the same id again, or any id after a user turn, answers nothing
    r = http.post(f"/v1/sessions/{sids[0]}/chat", json={"role": "tool", "tool_call_id": calls[0]["id"],
                                                        "content": "18"})
    assert r.status_code == 400 and "answers no call of this session" in r.json()["error"]["message"], r.text
    # the case: a session whose last assistant turn made no call
    plain = http.post("/v1/sessions", json={}).json()["id"]
    assert http.post(f"/v1/sessions/{plain}/chat", json={"content": "Hi", "max_tokens": 4}).status_code == 200
    r = http.post(f"/v1/sessions/{plain}/chat", json={"role": "tool", "tool_call_id": "call_nope", "content": "18"})
    assert r.status_code == 400 and len(http.get(f"/v1/sessions/{plain}").json()["messages"]) == 2, r.text
    for bad in ({"content": "x", "role": "tool"}, {"content": "x", "tool_call_id": "call_1"},
                {"content": "x", "role": "system"}):
        error(http.post(f"/v1/sessions/{sids[0]}/chat", json=bad), 400)


def test_library_session_keeps_its_tools_across_turns_and_a_save(smollm2_path, tmp_path):
    from turbo.chat_render import render_prompt
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=2048, block_size=BLOCK))
    tok = engine.tokenizer
    s = engine.session(system="Be brief.")
    s.chat("What's the weather in Paris?", tools=TOOLS, max_new_tokens=6)
    s.chat("And in Rome?", max_new_tokens=6)  # no tools given: the session's stay in the prompt
    assert s.tools == TOOLS
    want = encode(tok, render_prompt(tok, s.messages[:-1], TOOLS), add_special_tokens=False)
    assert s.last.prompt_tokens == len(want) and s.last.cached_tokens > 0
    with pytest.raises(InvalidRequest, match="tool_call_id"):  # no turn made a call yet
        s.chat('{"temp": 18}', tool_call_id="call_x", max_new_tokens=4)
    assert s.messages[-1]["role"] == "assistant" and len(s.messages) == 5
    grammar = tools.call_grammar(tools.read_tools(TOOLS, "required", False), "hermes")
    s.chat("And in Oslo?", grammar=grammar, max_new_tokens=60, temperature=0)
    (call,) = s.messages[-1]["tool_calls"]  # read from the reply, kept with its id and its arguments as a dict
    assert call["function"]["name"] in PARAMS and isinstance(call["function"]["arguments"], dict)
    s.chat('{"temp": 18}', tool_call_id=call["id"], max_new_tokens=4)
    assert s.messages[-2] == {"role": "tool", "content": '{"temp": 18}', "tool_call_id": call["id"]}
    s.save(tmp_path / "s")
    back = engine.load_session(tmp_path / "s")
    assert back.tools == TOOLS and back.messages == s.messages
    with pytest.raises(Exception, match="tools must be a list"):
        s.chat("x", tools={"name": "f"})
