"""The ``deepseek_v3`` tool-call parser (turbo/tool_parsers/deepseek_v3.py) on the published examples (vLLM's
deepseekv3_tool_parser.py docstring, test_deepseekv3_tool_parser.py and test_deepseekv31_tool_parser.py), whole and
streamed alike, and its grammar (turbo/serve/tool_grammar.py)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tool_format_cases import assert_stream_equals_parse, check_published, consumes, grammar, sample_under
from turbo.tool_parsers import ToolParser, parser_for_template

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"


def v3(name: str, args: str) -> str:
    return CALL_BEGIN + "function" + SEP + name + "\n```json\n" + args + "\n```" + CALL_END


TOKYO = CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + CALLS_END
PUBLISHED = [
    (CALLS_BEGIN + v3("get_current_weather", '{"location": "Beijing"}') + "\n"
     + v3("get_current_weather", '{"location": "Shanghai"}') + CALLS_END,
     [("get_current_weather", {"location": "Beijing"}), ("get_current_weather", {"location": "Shanghai"})], None),
    (TOKYO, [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None),
    (CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo", "unit": "celsius"}')
     + v3("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}') + CALLS_END,
     [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
      ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})], None),
    (CALLS_BEGIN + v3("test_function", '{"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": '
                                       'true, "null_field": null, "array_field": ["a", "b", "c"], "object_field": '
                                       '{"nested": "value"}, "empty_array": [], "empty_object": {}}') + CALLS_END,
     [("test_function", {"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True,
                         "null_field": None, "array_field": ["a", "b", "c"], "object_field": {"nested": "value"},
                         "empty_array": [], "empty_object": {}})], None),
    (CALLS_BEGIN + v3("get_current_time", "{}") + CALLS_END, [("get_current_time", {})], None),
    ("Let me check the weather for you." + CALLS_BEGIN + v3("get_weather", '{"city": "Paris"}') + CALLS_END,
     [("get_weather", {"city": "Paris"})], "Let me check the weather for you."),
    (CALLS_BEGIN + v3("send_message", '{"text": "He said \\"hello\\"", "path": "C:\\\\Users\\\\file", '
                                      '"newline": "line1\\nline2"}') + CALLS_END,
     [("send_message", {"text": 'He said "hello"', "path": "C:\\Users\\file", "newline": "line1\nline2"})], None),
    ("How can I help you today? I can check weather for you.", [],
     "How can I help you today? I can check weather for you."),
    # V3.1: no type, no fence
    ("normal text" + CALLS_BEGIN + CALL_BEGIN + "foo" + SEP + '{"x":1}' + CALL_END + CALLS_END, [("foo", {"x": 1})],
     "normal text"),
    ("some prefix text" + CALLS_BEGIN + CALL_BEGIN + "foo" + SEP + '{"x":1}' + CALL_END + CALL_BEGIN + "bar" + SEP
     + '{"y":2}' + CALL_END + CALLS_END + " some suffix text", [("foo", {"x": 1}), ("bar", {"y": 2})],
     "some prefix text\nsome suffix text"),  # vLLM drops the suffix; here it stays content
]


def test_published_examples_whole_and_streamed():
    check_published("deepseek_v3", PUBLISHED)


def test_malformed_blocks_are_content_and_cut_blocks_are_dropped():
    rng = random.Random(2)
    for bad in (CALLS_BEGIN + v3("get_weather", '{"city": "Tokyo"') + CALLS_END,  # the JSON does not close
                CALLS_BEGIN + "function" + SEP + "get_weather\n```json\n{\"city\": \"Tokyo\"}\n```" + CALLS_END,
                CALLS_BEGIN + v3("get_weather", '["not", "an", "object"]') + CALLS_END):
        assert assert_stream_equals_parse("deepseek_v3", "x " + bad, rng) == ("x " + bad, [])
    for end in range(1, len(TOKYO)):
        content, calls = assert_stream_equals_parse("deepseek_v3", "Hi " + TOKYO[:end], rng, cut=True)
        assert calls == [] and content == "Hi "
    assert assert_stream_equals_parse("deepseek_v3", TOKYO + TOKYO.replace("Tokyo", "Oslo"), rng, max_calls=1)[1][0] \
        .arguments == '{"city":"Tokyo","unit":"celsius"}'


def test_chosen_from_the_template():
    assert parser_for_template("you should first print " + CALLS_BEGIN + CALL_BEGIN + "function" + SEP) == \
        "deepseek_v3"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from turbo.core.startup import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def lltok(tok):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tok)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_current_time"}}]


def test_grammar_required_named_and_auto(tok, lltok):
    g = grammar(TOOLS, "required", True, "deepseek_v3")
    paris = v3("get_weather", '{"city": "Paris"}')
    for text in (CALLS_BEGIN + paris + CALLS_END, CALLS_BEGIN + paris + v3("get_current_time", "{}") + CALLS_END):
        assert consumes(tok, lltok, g, text)[:2] == (True, True), text
    for bad in (CALLS_BEGIN + v3("get_weather", '{"city": 3}') + CALLS_END,
                CALLS_BEGIN + v3("get_weather", '{"city": "P", "x": 1}') + CALLS_END,
                CALLS_BEGIN + v3("nope", "{}") + CALLS_END, "Hi " + CALLS_BEGIN + paris + CALLS_END):
        assert not consumes(tok, lltok, g, bad)[1], bad
    one = grammar(TOOLS, "required", False, "deepseek_v3")
    assert consumes(tok, lltok, one, CALLS_BEGIN + paris + CALLS_END)[2]
    assert not consumes(tok, lltok, one, CALLS_BEGIN + paris + paris)[0]
    auto = grammar(TOOLS, "auto", True, "deepseek_v3")
    for text in ("It is sunny.", "Let me look." + CALLS_BEGIN + paris + CALLS_END,
                 CALLS_BEGIN + paris + CALLS_END + " Done."):
        assert consumes(tok, lltok, auto, text)[:2] == (True, True), text
    assert not consumes(tok, lltok, auto, "a " + CALLS_BEGIN + v3("nope", "{}"))[0]


def test_sampling_under_the_grammar_gives_valid_calls(tok, lltok):
    g = grammar(TOOLS, "required", False, "deepseek_v3")
    got = 0
    for seed in range(4):
        text = sample_under(tok, lltok, g, seed, max_tokens=150)
        if text is None:
            continue
        content, calls = ToolParser("deepseek_v3").parse(text)
        assert content is None and len(calls) == 1, text
        params = {"get_weather": TOOLS[0]["function"]["parameters"], "get_current_time": {"type": "object"}}
        jsonschema.validate(json.loads(calls[0].arguments), params[calls[0].name])
        got += 1
    assert got >= 2
