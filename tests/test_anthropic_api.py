"""Anthropic's Messages API (turbo/serve/anthropic.py) driven by the official ``anthropic`` client against the
float32 SmolLM2: text equal to the chat completion of the same conversation, streaming equal to non-streaming, a
``tool_use`` → ``tool_result`` round trip, stop sequences, token counting, keys sent as ``x-api-key``, and the 400s
(in Anthropic's error shape) for bad bodies, a mismatched ``tool_result`` id first."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from turbo import Engine, EngineConfig
from turbo.serve import anthropic as messages_api
from turbo.serve.app import create_app
from turbo.http_errors import APIError

from conftest import serve_in_thread

MODEL = "smol"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0}  # the client has no sampling arguments any more; the API still reads them
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    """Base url of a server over the float32 SmolLM2 with the key "k1"; stopped at the end."""
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=2048, block_size=16, max_batch_size=4))
    url, stop = serve_in_thread(create_app(engine, model_name=MODEL, api_keys="k1"))
    yield url
    stop()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served, api_key="k1", max_retries=0, timeout=120)


def test_text_reply_equals_chat_completion(served, client):
    msg = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, system="Answer briefly.",
                                 messages=[{"role": "user", "content": "Name a color."}])
    oa = openai.OpenAI(base_url=f"{served}/v1", api_key="k1", max_retries=0)
    ref = oa.chat.completions.create(model=MODEL, max_tokens=20, extra_body=GREEDY, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == ref.choices[0].message.content and msg.content[0].text
    want = {"stop": "end_turn", "length": "max_tokens"}[ref.choices[0].finish_reason]
    assert msg.stop_reason == want and msg.stop_sequence is None
    u = msg.usage
    assert u.output_tokens == ref.usage.completion_tokens
    assert u.input_tokens + u.cache_read_input_tokens == ref.usage.prompt_tokens


def test_stream_equals_non_stream(client):
    kw = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Say hello."}])
    whole = client.messages.create(**kw)
    kinds = []
    with client.messages.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds


def test_tool_use_round_trip(client):
    kw = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER])
    first = client.messages.create(messages=PARIS, tool_choice={"type": "any"}, **kw)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # the streamed reply carries the same call (its input as one input_json_delta)
    with client.messages.stream(messages=PARIS, tool_choice={"type": "any"}, **kw) as stream:
        streamed = stream.get_final_message()
    s_uses = [b for b in streamed.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in s_uses] == [(b.name, b.input) for b in uses]
    assert streamed.stop_reason == "tool_use"
    history = PARIS + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                     "content": "18 C and sunny"}]}]
    second = client.messages.create(messages=history, tool_choice={"type": "none"}, **kw)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text


def test_named_tool_and_no_parallel(client):
    msg = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=PARIS, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather",
                                              "disable_parallel_tool_use": True})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and msg.stop_reason == "tool_use"


def test_stop_sequence_is_named(client):
    free = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Count from 1 to 9 with spaces."}])
    text = free.content[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, stop_sequences=["zzzq", stop],
                                 messages=[{"role": "user", "content": "Count from 1 to 9 with spaces."}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_count_tokens(served, client):
    n = client.messages.count_tokens(model=MODEL, messages=PARIS).input_tokens
    msg = client.messages.create(model=MODEL, max_tokens=1, messages=PARIS)
    assert n == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 5


def test_errors_in_anthropic_shape(served, client):
    bad_id = PARIS + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "18"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=bad_id, tools=[WEATHER])
    assert e.value.status_code == 400
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[2].content[0].tool_use_id" in body["error"]["message"] and "toolu_1" in body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=PARIS)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=PARIS)
    r = httpx.post(f"{served}/v1/messages", headers={"x-api-key": "k1"},
                   json={"model": MODEL, "messages": PARIS})  # no max_tokens
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "top-level 'system'"),
    ({"messages": PARIS, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "'thinking'"),
    ({"messages": PARIS, "temperature": 1.5}, "[0, 1]"),
    ({"messages": PARIS, "tools": [{"name": "f"}]}, "input_schema"),
    ({"messages": PARIS, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"messages": PARIS, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"messages": PARIS, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": PARIS, "frobnicate": 1}, "'frobnicate'"),
    ({"messages": PARIS, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"messages": PARIS + [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "get_weather",
                                                              "input": {}}, {"type": "tool_use", "id": "b",
                                                              "name": "get_weather", "input": {}}]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1"}]}],
      "tools": [WEATHER]}, "not b"),
])
def test_bad_bodies_name_the_field(body, needle):
    with pytest.raises(APIError) as e:
        messages_api.read_request({"model": MODEL, "max_tokens": 8, **body}, MODEL)
    assert e.value.status == 400 and needle in e.value.message, e.value.message


def test_output_config_format_gives_valid_json(client):
    pet = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
           "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    msg = client.messages.create(model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "A pet as JSON."}],
                                 output_config={"format": {"type": "json_schema", "schema": pet}}, extra_body=GREEDY)
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), pet)


def _use(*ids: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}] + [
        {"type": "tool_use", "id": i, "name": "get_weather", "input": {"city": "Paris"}} for i in ids]}


def _result(*ids: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "18 C"} for i in ids]}


UNANSWERED = {  # a tool_use not answered by a tool_result in the next message: (messages, the ids named)
    "a user string": ([_use("a"), {"role": "user", "content": "thanks"}], "a"),
    "user text blocks": ([_use("a"), {"role": "user", "content": [{"type": "text", "text": "thanks"}]}], "a"),
    "empty user content": ([_use("a"), {"role": "user", "content": []}], "a"),
    "a partial set": ([_use("a", "b"), _result("a")], "not b"),
    "none of two": ([_use("a", "b"), {"role": "user", "content": "go on"}], "a, b"),
    "the result a turn late": ([_use("a"), {"role": "user", "content": "hm"}, _result("a")], "a"),
    "another assistant turn at the end": ([_use("a"), {"role": "assistant", "content": "It is 18 C."}], "a"),
    "another assistant turn, then the user": ([_use("a"), {"role": "assistant", "content": "Hm."},
                                              {"role": "user", "content": "so?"}], "a"),
    "the end of the conversation": ([_use("a")], "a"),
    "early in a longer conversation": ([_use("a"), {"role": "user", "content": "x"},
                                        {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}], "a"),
    "the second of two calls left open": ([_use("a"), _result("a"), _use("b"), {"role": "user", "content": "ok"}],
                                          "b"),
}


@pytest.mark.parametrize("count_only", [False, True], ids=["messages", "count_tokens"])
@pytest.mark.parametrize("shape", UNANSWERED)
def test_every_unanswered_tool_use_is_400(shape, count_only):
    """Issue 57: an assistant tool_use followed by anything but a user message answering all of its ids (no
    tool_result at all, a plain string, some of the ids, another assistant turn, the end of the conversation) is a
    400 naming the ids, as Anthropic answers; /v1/messages and /v1/messages/count_tokens read messages alike."""
    msgs, ids = UNANSWERED[shape]
    body = {"model": MODEL, "messages": PARIS + msgs, "tools": [WEATHER], **({} if count_only else {"max_tokens": 8})}
    with pytest.raises(APIError) as e:
        messages_api.translate(body, count_only=count_only) if count_only else \
            messages_api.read_request(body, MODEL)
    assert e.value.status == 400 and ids in e.value.message and "tool_result" in e.value.message, e.value.message


@pytest.mark.parametrize("count_only", [False, True], ids=["messages", "count_tokens"])
@pytest.mark.parametrize("content, words", [
    ([{"type": "text", "text": "here:"}, _result("a")["content"][0]], "tool_result blocks come first"),
    (_result("a", "a")["content"], '"a" is answered a second time'),
], ids=["text before the result", "one id answered twice"])
def test_misplaced_tool_results_are_400_naming_the_rule(content, words, count_only):
    """A user message's tool_result blocks come before its text (Anthropic's rule), and each tool_use takes one
    tool_result: the 400 says which rule (a second answer to an id was told "it made no tool_use")."""
    body = {"model": MODEL, "messages": PARIS + [_use("a"), {"role": "user", "content": content}],
            "tools": [WEATHER], **({} if count_only else {"max_tokens": 8})}
    with pytest.raises(APIError) as e:
        messages_api.translate(body, count_only=count_only) if count_only else \
            messages_api.read_request(body, MODEL)
    assert e.value.status == 400 and words in e.value.message, e.value.message


@pytest.mark.parametrize("msgs", [[_use("a"), _result("a")], [_use("a", "b"), _result("b", "a")],
                                  [_use("a"), _result("a"), {"role": "assistant", "content": "18 C."},
                                   {"role": "user", "content": "thanks"}],
                                  [_use("a"), {"role": "user", "content": _result("a")["content"] + [
                                      {"type": "text", "text": "and tomorrow?"}]}]])
def test_answered_tool_uses_are_read(msgs):
    body = {"model": MODEL, "messages": PARIS + msgs, "tools": [WEATHER], "max_tokens": 8}
    req = messages_api.read_request(body, MODEL)
    assert [m["role"] for m in req.messages][:3] == ["user", "assistant", "tool"]


def test_unanswered_tool_use_is_400_on_both_routes(served):
    body = {"model": MODEL, "messages": PARIS + [_use("toolu_9"), {"role": "user", "content": "and?"}],
            "tools": [WEATHER]}
    for path, extra in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(f"{served}{path}", headers={"x-api-key": "k1"}, json={**body, **extra}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()
        assert err["type"] == "error" and "toolu_9" in err["error"]["message"], err


def _stream_usages(url: str, body: dict) -> tuple[dict, dict]:
    """(message_start's usage, message_delta's usage) of a streamed Messages request."""
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": "k1"}, json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    return events[0]["message"]["usage"], next(e for e in events if e["type"] == "message_delta")["usage"]


def test_input_tokens_mean_one_thing_in_the_stream_the_reply_and_count_tokens(served, client):
    """Issue 57: message_start counted prefix-cache hits in input_tokens and message_delta did not. Now both, and the
    non-streamed reply, say input_tokens = the prompt less cache_read_input_tokens (Anthropic's meaning), and
    count_tokens = their sum, with nothing cached and with the whole conversation cached."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "system": "You count tokens.",
            "messages": [{"role": "user", "content": "A sentence of a few words to count, then cache."}]}
    n = client.messages.count_tokens(model=MODEL, system=body["system"], messages=body["messages"]).input_tokens
    inputs = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    cached = []
    for _ in range(2):  # the second time the prompt's full blocks are in the prefix cache
        start, delta = _stream_usages(served, body)
        assert {k: start[k] for k in inputs} == {k: delta[k] for k in inputs}, (start, delta)
        assert start["input_tokens"] + start["cache_read_input_tokens"] == n and start["output_tokens"] == 0
        whole = httpx.post(f"{served}/v1/messages", headers={"x-api-key": "k1"}, json=body, timeout=120).json()
        assert whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"] == n
        cached.append(start["cache_read_input_tokens"])
    assert cached[0] == 0 < cached[1]  # a new prompt, then the same one read from the cache (its full 16-token blocks)
