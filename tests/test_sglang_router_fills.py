"""What sglang-router forwards reaches a replica as a request it serves (issue 57): the bodies below are what
sglang-router 0.3.2 sent on to a worker that logged them (``liteturbo route``'s router), for requests that left out
``model`` and the optional fields: it writes ``"model": "unknown"`` and its own fields at their defaults. A replica
(the float32 SmolLM2, in this process) answers each with 200, as it answers the same request sent to it directly, and
still answers a model name that is not its own with 404, and a router field at another value with a 400 naming it."""
from __future__ import annotations

import json

import httpx
import pytest

from turbo import Engine, EngineConfig
from turbo.serve.app import create_app

from conftest import serve_in_thread

MODEL = "smol"
USER = [{"role": "user", "content": "Name a colour."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT_FILLS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
              "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
              "return_hidden_states": False}
# (path, body as the router forwarded it, extra headers); "model" is the router's "unknown" where the client left it out
FORWARDED = {
    "chat": ("/v1/chat/completions", {"messages": USER, "model": "unknown", "max_completion_tokens": 3,
                                      "stream": False, **CHAT_FILLS}, {}),
    "chat with tools (tool_choice auto filled)": (
        "/v1/chat/completions", {"messages": USER, "model": "unknown", "max_completion_tokens": 3, "stream": False,
                                 "tool_choice": "auto", "tools": [TOOL], **CHAT_FILLS}, {}),
    "chat with an empty tool list (tool_choice none filled)": (
        "/v1/chat/completions", {"messages": USER, "model": "unknown", "max_completion_tokens": 3, "stream": False,
                                 "tool_choice": "none", "tools": [], **CHAT_FILLS}, {}),
    "chat streamed, a session by its routing key": (
        "/v1/chat/completions", {"messages": USER, "model": "unknown", "max_completion_tokens": 3, "stream": True,
                                 "stream_options": {"include_usage": True}, **CHAT_FILLS},
        {"x-smg-routing-key": "sess-0123456789abcdef01234567"}),
    "completion": ("/v1/completions", {"model": MODEL, "prompt": "Red, green and", "max_tokens": 3, "stream": False,
                                       "echo": False, "no_stop_trim": False, "ignore_eos": False,
                                       "skip_special_tokens": True, "return_hidden_states": False}, {}),
    "completion streamed": ("/v1/completions", {"model": MODEL, "prompt": "Red, green and", "max_tokens": 3,
                                                "stream": True, "echo": False, "no_stop_trim": False,
                                                "ignore_eos": False, "skip_special_tokens": True,
                                                "return_hidden_states": False}, {}),
    "response": ("/v1/responses", {"input": "Name a colour.", "model": "unknown", "store": True, "stream": None,
                                   "temperature": 1.0, "top_p": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0,
                                   "repetition_penalty": 1.0, "max_output_tokens": 3}, {}),
    "response with tools": ("/v1/responses", {
        "input": "Weather in Paris?", "max_output_tokens": 3, "model": "unknown", "parallel_tool_calls": True,
        "store": True, "stream": False, "temperature": 1.0, "tool_choice": "auto",
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}],
        "top_p": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}, {}),
}


@pytest.fixture(scope="module")
def url(smollm2_path):
    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=2048, block_size=16, max_batch_size=4))
    url, stop = serve_in_thread(create_app(engine, model_name=MODEL, api_keys=""))
    yield url
    stop()


def _post(url: str, path: str, body: dict, headers: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("case", FORWARDED)
def test_what_sglang_router_forwards_is_served_as_the_direct_request(url, case):
    path, body, headers = FORWARDED[case]
    if headers:  # a new session per run: the router's key opens it
        from turbo.session_ids import new_session_id

        headers = {"x-smg-routing-key": new_session_id()}
    r = _post(url, path, body, headers)
    assert r.status_code == 200, r.text  # "unknown" was 404; the router's completion and response fields were 400
    if body.get("stream"):
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        assert events and not any("error" in e for e in events) and r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["model"] == MODEL
    direct = {k: v for k, v in body.items() if v != "unknown"}  # the client's own request, without the router
    assert _post(url, path, direct, headers).status_code == 200


@pytest.mark.parametrize("path, body", [(p, b) for p, b, _ in FORWARDED.values() if not b.get("stream")])
def test_a_model_that_is_not_served_is_still_404(url, path, body):
    r = _post(url, path, dict(body, model="gpt-4o"), {})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("path, body, field, value", [
    ("/v1/chat/completions", FORWARDED["chat"][1], "skip_special_tokens", False),
    ("/v1/chat/completions", FORWARDED["chat"][1], "continue_final_message", True),
    ("/v1/completions", FORWARDED["completion"][1], "no_stop_trim", True),
    ("/v1/completions", FORWARDED["completion"][1], "return_hidden_states", 1),
    ("/v1/responses", FORWARDED["response"][1], "priority", 5),
])
def test_a_router_field_at_another_value_is_400_naming_it(url, path, body, field, value):
    r = _post(url, path, dict(body, **{field: value}), {})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
