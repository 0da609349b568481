"""Every tool-call format through the server (``create_app(tool_call_parser=...)``, the official openai client): on
SmolLM2, ``tool_choice`` "required" and a named function give calls in that format (the grammar of
turbo/serve/tool_grammar.py) that the format's parser reads back into arguments that validate, streamed and not
alike; ``auto`` replies are plain text or valid calls. In the end-to-end tier (``pytest -m e2e``)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from turbo import Engine, EngineConfig
from turbo.tool_parsers import PARSERS

pytestmark = pytest.mark.e2e  # ~1 minute of SmolLM2 replies in every format: the end-to-end tier

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096, max_batch_size=4))


def _client(engine, parser):
    import openai
    from fastapi.testclient import TestClient

    from turbo.serve.app import create_app

    http = TestClient(create_app(engine, model_name="m", api_keys="", tool_call_parser=parser))
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0,
                               timeout=300)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("parser", PARSERS)
def test_required_and_named_calls_in_every_format(engine, parser):
    http, client = _client(engine, parser)
    with http:
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=150, temperature=0,
                      parallel_tool_calls=False)
            r = client.chat.completions.create(**kw).choices[0]
            calls = _calls(r.message)
            assert len(calls) == 1 and r.message.content is None, (parser, r.message)
            name, args = calls[0]
            jsonschema.validate(args, PARAMS[name])
            assert r.finish_reason == ("tool_calls" if choice == "required" else "stop")
            if choice != "required":
                assert name == "get_time"
            streamed, ids = [], set()
            for chunk in client.chat.completions.create(stream=True, **kw):
                for d in chunk.choices[0].delta.tool_calls or []:
                    if d.id:
                        ids.add(d.id)
                        streamed.append([d.function.name, ""])
                    streamed[-1][1] += d.function.arguments or ""
            assert [(n, json.loads(a)) for n, a in streamed] == calls and len(ids) == 1


@pytest.mark.parametrize("parser", ["qwen3_xml", "pythonic", "deepseek_v3", "granite"])
def test_auto_replies_are_text_or_valid_calls(engine, parser):
    http, client = _client(engine, parser)
    with http:
        for seed in range(3):
            r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="auto",
                                               max_tokens=60, temperature=0.8, seed=seed).choices[0]
            for name, args in _calls(r.message):
                jsonschema.validate(args, PARAMS[name])
            if r.message.tool_calls:
                assert r.finish_reason in ("tool_calls", "length")
