"""The ``granite`` tool-call parser (turbo/tool_parsers/granite.py) on the published examples (vLLM's
test_granite_tool_parser.py), whole and streamed alike, and its grammar (turbo/serve/tool_grammar.py)."""
from __future__ import annotations

import random

import pytest

from tool_format_cases import assert_stream_equals_parse, check_published, consumes, grammar
from turbo.tool_parsers import ToolParser, parser_for_template

TYPES = {"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True, "null_field": None,
         "array_field": ["a", "b", "c"], "object_field": {"nested": "value"}, "empty_array": [], "empty_object": {}}
PUBLISHED = [
    ('<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', [("get_weather", {"city": "Tokyo"})],
     None),
    ('<|tool_call|> [\n  {"name": "get_weather", "arguments": {"city": "Tokyo"}},\n  {"name": "get_time", '
     '"arguments": {"timezone": "Asia/Tokyo"}}\n]',
     [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})], None),
    ('<tool_call> [{\n  "name": "test_function",\n  "arguments": {\n    "string_field": "hello",\n    "int_field": 42,'
     '\n    "float_field": 3.14,\n    "bool_field": true,\n    "null_field": null,\n    "array_field": ["a", "b", "c"],'
     '\n    "object_field": {"nested": "value"},\n    "empty_array": [],\n    "empty_object": {}\n  }\n}]',
     [("test_function", TYPES)], None),
    ('<|tool_call|> [{"name": "refresh", "arguments": {}}]', [("refresh", {})], None),
    ('<tool_call> [{\n  "name": "test_function",\n  "arguments": {\n    "quoted": "He said \\"hello\\"",\n    "path": '
     '"C:\\\\Users\\\\file.txt",\n    "newline": "line1\\nline2",\n    "unicode": "emoji: \U0001f389"\n  }\n}]',
     [("test_function", {"quoted": 'He said "hello"', "path": "C:\\Users\\file.txt", "newline": "line1\nline2",
                         "unicode": "emoji: \U0001f389"})], None),
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', [("get_weather", {"city": "Tokyo"})],
     None),
    ("This is a regular response without any tool calls.", [], "This is a regular response without any tool calls."),
    # vLLM reads this as no calls (its test is marked xfail); here the text around the call is content
    ('Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]\n'
     "I'll get that information.", [("get_weather", {"city": "Tokyo"})],
     "Let me check the weather for you.\nI'll get that information."),
]


def test_published_examples_whole_and_streamed():
    check_published("granite", PUBLISHED)


def test_malformed_is_content_or_dropped_when_cut():
    rng = random.Random(4)
    cut = '<|tool_call|> [{"name": "func", "arguments": {'
    assert assert_stream_equals_parse("granite", cut, rng) == (cut, [])
    assert assert_stream_equals_parse("granite", cut, rng, cut=True) == ("", [])
    for text in ('<|tool_call|> [{"name": "func", "arguments": "not a dict"}]', "Some text [{\"name\": \"func\"}]"):
        assert assert_stream_equals_parse("granite", text, rng) == (text, [])


def test_chosen_from_the_template():
    granite = ("<|start_of_role|>system<|end_of_role|>... respond with <|tool_call|> followed by a JSON list of tools "
               "used.")
    assert parser_for_template(granite) == "granite"
    assert parser_for_template("<|tool_call|> ... <|/tool_call|>") == "hermes"  # Phi-4-mini's is not Granite's


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from turbo.core.startup import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def lltok(tok):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tok)


def test_grammar_required_and_auto(tok, lltok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    g = grammar(tools, "required", True, "granite")
    call = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]'
    assert consumes(tok, lltok, g, call)[:2] == (True, True)
    assert ToolParser("granite").parse(call)[1][0].arguments == '{"city":"Tokyo"}'
    assert not consumes(tok, lltok, g, call.replace('"Tokyo"', "3"))[1]
    assert not consumes(tok, lltok, g, "Hi " + call)[0]
    auto = grammar(tools, "auto", True, "granite")
    assert consumes(tok, lltok, auto, "It is sunny.")[:2] == (True, True)
    assert consumes(tok, lltok, auto, call)[:2] == (True, True)
    assert not consumes(tok, lltok, auto, '<|tool_call|>[{"name": "nope", "arguments": {}}]')[0]
