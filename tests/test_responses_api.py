"""OpenAI's Responses API on sessions (turbo/serve/responses_api.py, response_store.py) driven by the official
``openai`` client against the float32 SmolLM2: a second response with ``previous_response_id`` is its session's next
turn (cached tokens ≥ 90 % of the first response's input + output), equal to the same conversation sent whole; a
branch (two responses continuing one parent); streamed events that parse and equal the non-streamed response; a
function call round trip with ``function_call_output``; ``text.format`` json_schema; GET / DELETE; stored responses
surviving a new app over the same session dir; and the 400 / 404s."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from turbo import Engine, EngineConfig
from turbo.engine_proc.sessions import SessionRegistry
from turbo.http_errors import APIError
from turbo.serve import responses_api
from turbo.serve.app import create_app
from turbo.serve.response_store import ResponseStore

from conftest import serve_in_thread

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16, max_batch_size=4))


@pytest.fixture(scope="module")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def served(engine, session_dir):
    app = create_app(engine, model_name=MODEL, api_keys="", sessions=SessionRegistry(engine, session_dir=session_dir))
    url, stop = serve_in_thread(app)
    yield url, app
    stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def test_previous_response_is_a_session_turn(client):
    first = client.responses.create(model=MODEL, input="Name three colors.", instructions="Answer briefly.",
                                    max_output_tokens=24, temperature=0)
    assert first.object == "response" and first.id.startswith("resp_") and first.output_text
    second = client.responses.create(model=MODEL, input="Now name one more.", instructions="Answer briefly.",
                                     previous_response_id=first.id, max_output_tokens=16, temperature=0)
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * history
    assert second.previous_response_id == first.id
    # the same conversation sent whole, as a plain chat completion, answers the same
    ref = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Now name one more."}])
    assert second.output_text == ref.choices[0].message.content
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_branch_from_one_parent(client):
    root = client.responses.create(model=MODEL, input="Say a fruit.", max_output_tokens=12, temperature=0)
    a = client.responses.create(model=MODEL, input="Say a color.", previous_response_id=root.id,
                                max_output_tokens=12, temperature=0)
    b = client.responses.create(model=MODEL, input="Say a number.", previous_response_id=root.id,
                                max_output_tokens=12, temperature=0)
    ref = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "Say a fruit."}, {"role": "assistant", "content": root.output_text},
        {"role": "user", "content": "Say a number."}])
    assert b.output_text == ref.choices[0].message.content
    assert a.output_text  # the first branch went on in the root's session; the second got its own
    # and the first branch can still go on
    c = client.responses.create(model=MODEL, input="Another.", previous_response_id=a.id, max_output_tokens=8,
                                temperature=0)
    assert c.usage.input_tokens_details.cached_tokens >= 0.9 * (a.usage.input_tokens + a.usage.output_tokens)


def test_stream_equals_non_stream(client):
    kw = dict(model=MODEL, input="Say hello.", max_output_tokens=64, temperature=0, store=False)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"  # (the stream helper needs it; a cut reply ends "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status


def test_function_call_round_trip(client):
    kw = dict(model=MODEL, tools=[WEATHER], max_output_tokens=60, temperature=0)
    first = client.responses.create(input="What is the weather in Paris?", tool_choice="required", **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(client.responses.create(input="What is the weather in Paris?", tool_choice="required",
                                          stream=True, store=False, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(d.name, d.arguments) for d in done] == [(c.name, c.arguments) for c in calls]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    second = client.responses.create(previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}], **kw)
    assert second.output_text and second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens * 0.9
    # the whole conversation as items, without a stored previous response, is accepted as well
    again = client.responses.create(input=[{"role": "user", "content": "What is the weather in Paris?"},
                                           *[o.model_dump(exclude_none=True) for o in first.output],
                                           {"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "18 C and sunny"}], store=False, **kw)
    assert again.output_text == second.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(previous_response_id=first.id, input=[
            {"type": "function_call_output", "call_id": "call_nope", "output": "18"}], **kw)
    assert "call_nope" in str(e.value)


def test_text_format_json_schema(client):
    pet = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
           "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    r = client.responses.create(model=MODEL, input="A pet as JSON.", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "pet", "schema": pet, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), pet)


def test_incomplete_and_delete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    for gone in (r.id, "resp_" + "0" * 32, "not-an-id"):  # deleted, never stored, malformed: OpenAI's 400 and code
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="x", previous_response_id=gone)
        assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
        assert gone in e.value.message


def test_stored_responses_survive_a_restart(engine, served, session_dir, client):
    first = client.responses.create(model=MODEL, input="Name a river.", max_output_tokens=12, temperature=0)
    # a new app (a restarted server) over the same session dir: the registry restores the sessions
    app2 = create_app(engine, model_name=MODEL, api_keys="",
                      sessions=SessionRegistry(engine, session_dir=session_dir))
    url2, stop2 = serve_in_thread(app2)
    try:
        c2 = openai.OpenAI(base_url=f"{url2}/v1", api_key="unused", max_retries=0, timeout=120)
        assert c2.responses.retrieve(first.id).output_text == first.output_text
        nxt = c2.responses.create(model=MODEL, input="And a lake?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
        assert nxt.output_text
    finally:
        stop2()
        assert engine.loop.running  # the second app stopped the engine's loop when it shut down: started again


@pytest.mark.parametrize("body, needle", [
    ({"input": []}, "'input'"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "'reasoning'"),
    ({"input": "x", "background": True}, "'background'"),
    ({"input": "x", "frobnicate": 1}, "'frobnicate'"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "1"}]}, "c1"),
    ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}]}, "last input item"),
])
def test_bad_bodies_name_the_field(body, needle):
    with pytest.raises(APIError) as e:
        responses_api.read_request({"model": MODEL, **body}, MODEL, ResponseStore())
    assert e.value.status == 400 and needle in e.value.message, e.value.message


def test_response_sessions_are_capped(served, client):
    """One-off responses do not pile up sessions: beyond the cap the least recently used response session goes, and
    its response can still be continued (from the stored conversation)."""
    app = served[1]
    live = app.state.served.response_sessions
    old_cap, live.cap = live.cap, 2
    live.shed(app.state.served.client, 2)
    n_before = len(app.state.sessions) - len(live.order)
    try:
        firsts = [client.responses.create(model=MODEL, input=f"Say the number {i}.", max_output_tokens=6,
                                          temperature=0) for i in range(4)]
        assert len(live.order) <= 2
        assert len(app.state.sessions) <= n_before + 2
        nxt = client.responses.create(model=MODEL, input="And the next one?", previous_response_id=firsts[0].id,
                                      max_output_tokens=6, temperature=0)
        ref = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": "Say the number 0."}, {"role": "assistant", "content": firsts[0].output_text},
            {"role": "user", "content": "And the next one?"}])
        assert nxt.output_text == ref.choices[0].message.content
        assert len(live.order) <= 2
    finally:
        live.cap = old_cap
