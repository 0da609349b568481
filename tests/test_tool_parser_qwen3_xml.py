"""The ``qwen3_xml`` tool-call parser (turbo/tool_parsers/qwen3_xml.py) on Qwen3-Coder's published examples (vLLM's
tests/tool_use/test_qwen3coder_tool_parser.py and tests/entrypoints/openai/tool_parsers/test_qwen3xml_tool_parser.py),
whole and streamed alike, and its grammar (turbo/serve/tool_grammar.py)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tool_format_cases import assert_stream_equals_parse, check_published, consumes, grammar, sample_under
from turbo.tool_parsers import ToolParser, parser_for_template

TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "state": {"type": "string"}, "unit": {"type": "string", "enum": ["fahrenheit",
                                                                                                   "celsius"]}},
        "required": ["city", "state"]}}},
    {"type": "function", "function": {"name": "calculate_area", "parameters": {"type": "object", "properties": {
        "shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
DALLAS = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n"
          "</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>")
DALLAS_ARGS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
PUBLISHED = [
    (DALLAS, [("get_current_weather", DALLAS_ARGS)], None),
    ("Sure! Let me check the weather for you." + DALLAS, [("get_current_weather", DALLAS_ARGS)],
     "Sure! Let me check the weather for you."),
    ("<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n<parameter=dimensions>\n"
     "{\"width\": 10, \n \"height\": 20}\n</parameter>\n<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>",
     [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})], None),
    (DALLAS + "\n" + DALLAS.replace("Dallas", "Orlando").replace("TX", "FL"),
     [("get_current_weather", DALLAS_ARGS), ("get_current_weather", {"city": "Orlando", "state": "FL",
                                                                     "unit": "fahrenheit"})], None),
    ("Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n<parameter=shape>\ncircle\n"
     "</parameter>\n<parameter=dimensions>\n{\"radius\": 15.5}\n</parameter>\n<parameter=precision>\n3\n</parameter>\n"
     "</function>\n</tool_call>",
     [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})],
     "Let me calculate that area for you."),
    # the "city" value's closing tag left out: it ends at the next parameter
    ("Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n"
     "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>",
     [("get_current_weather", DALLAS_ARGS)], "Let me check the weather for you:"),
    ("This is a test response without any tool calls", [], "This is a test response without any tool calls"),
]


def test_published_examples_whole_and_streamed():
    check_published("qwen3_xml", PUBLISHED, tools=SCHEMAS)


def test_values_are_typed_by_the_tools_schema():
    typed = {"typed_fn": {"properties": {"count": {"type": "integer"}, "ratio": {"type": "float"},
                                         "flag": {"type": "boolean"}, "data": {"type": "object"},
                                         "items": {"type": "array"}, "label": {"type": "string"},
                                         "maybe": {"type": ["integer", "null"]}}}}
    cases = [("count", "42", 42), ("ratio", "2.0", 2), ("ratio", "3.14", 3.14), ("flag", "true", True),
             ("flag", "false", False), ("flag", "True", True), ("data", '{"key": "val", "n": 1}', {"key": "val", "n": 1}),
             ("data", "{'key': 'val', 'n': 1}", {"key": "val", "n": 1}), ("items", '[1, "two", true]', [1, "two", True]),
             ("items", "['a', 'b', 'c']", ["a", "b", "c"]), ("label", "007", "007"), ("label", "null", "null"),
             ("maybe", "null", None), ("count", "abc", "abc"), ("count", "3.5", "3.5"),
             ("label", "  spaced  ", "  spaced  ")]
    for key, raw, want in cases:
        text = f"<tool_call>\n<function=typed_fn>\n<parameter={key}>\n{raw}\n</parameter>\n</function>\n</tool_call>"
        _, calls = ToolParser("qwen3_xml").parse(text, tools=typed)
        assert json.loads(calls[0].arguments) == {key: want}, (key, raw)
    # a function or parameter the schema does not name, or no tools at all: text
    text = "<tool_call>\n<function=unknown_tool>\n<parameter=x>\n42\n</parameter>\n<parameter=y>\ntrue\n</parameter>" \
           "\n</function>\n</tool_call>"
    for tools in (typed, None):
        assert json.loads(ToolParser("qwen3_xml").parse(text, tools=tools)[1][0].arguments) == {"x": "42", "y": "true"}


def test_layout_details():
    rng = random.Random(1)
    p = "qwen3_xml"
    for text, want in [
        ("<tool_call>\n<function=noop>\n</function>\n</tool_call>", [("noop", {})]),
        ("<tool_call>\n<function=f>\n<parameter=v></parameter>\n</function>\n</tool_call>", [("f", {"v": ""})]),
        ("<tool_call>\n<function=f>\n<parameter=t>\nfirst line\nsecond line\n</parameter>\n</function>\n</tool_call>",
         [("f", {"t": "first line\nsecond line"})]),
        ("<tool_call>\n<function=f>\n<parameter=h>\n<b>bold</b>\n</parameter>\n</function>\n</tool_call>",
         [("f", {"h": "<b>bold</b>"})]),
        ("<tool_call>\n<function=f>\n<parameter=s>\n\nline1\n\n</parameter>\n</function>\n</tool_call>",
         [("f", {"s": "\nline1\n"})]),  # one newline each side is the layout's, the rest is the value's
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [("f", {"a": 1})]),  # Qwen3's JSON form
    ]:
        content, calls = assert_stream_equals_parse(p, text, rng)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == want
    # the rules every format shares: text around calls, a block that is no call, a cut block, max_calls, a repeat
    assert assert_stream_equals_parse(p, "I will look.\n\n" + DALLAS + "\nDone.", rng, tools=SCHEMAS)[0] == \
        "I will look.\nDone."
    for broken in ("<tool_call>\nnot xml\n</tool_call>", "<tool_call>\n<function=f>\n</tool_call>",
                   "<tool_call>\n<function=f>\n</function>\ntrailing</tool_call>"):
        assert assert_stream_equals_parse(p, "a " + broken + " b", rng) == ("a " + broken + " b", [])
    assert assert_stream_equals_parse(p, "Hi " + DALLAS[:-20], rng, cut=True) == ("Hi ", [])  # as hermes
    assert assert_stream_equals_parse(p, "Hi " + DALLAS[:-20], rng) == ("Hi " + DALLAS[:-20], [])
    assert assert_stream_equals_parse(p, "x <tool_", rng, cut=True) == ("x ", [])
    two = DALLAS + "\n" + DALLAS.replace("Dallas", "Austin")
    assert [json.loads(c.arguments)["city"] for c in assert_stream_equals_parse(p, two, rng, max_calls=1)[1]] == \
        ["Dallas"]
    s = ToolParser(p).streamer()
    s.feed(DALLAS + DALLAS + " more")
    s.finish()
    assert s.repeated and len(s.calls) == 1


def test_chosen_from_the_template():
    qwen3_coder = ("<tools>\n<function>\n<name>...</name>... reply in the following format:\n<tool_call>\n"
                   "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>")
    assert parser_for_template(qwen3_coder) == "qwen3_xml"
    assert parser_for_template("<|start_header_id|>ipython ... <function=") == "hermes"  # Functionary-like: no
    assert parser_for_template("<tool_call>\n{\"name\": ...}</tool_call>") == "hermes"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from turbo.core.startup import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def lltok(tok):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tok)


def test_grammar_required_named_and_auto(tok, lltok):
    g = grammar(TOOLS, "required", True, "qwen3_xml")
    assert consumes(tok, lltok, g, DALLAS)[:2] == (True, True)
    assert consumes(tok, lltok, g, DALLAS + "\n" + DALLAS)[:2] == (True, True)
    area = ("<tool_call>\n<function=calculate_area>\n<parameter=dimensions>\n{\"r\": 2}\n</parameter>\n"
            "<parameter=precision>\n3\n</parameter>\n</function>\n</tool_call>")
    assert consumes(tok, lltok, g, area)[:2] == (True, True)
    for bad in (DALLAS.replace("fahrenheit", "kelvin"),  # not in the enum
                DALLAS.replace("<function=get_current_weather>", "<function=get_weather>"),
                area.replace("\n3\n", "\nthree\n"),  # an integer
                DALLAS.replace("<parameter=state>\nTX\n</parameter>\n", ""),  # a required parameter left out
                "Sure. " + DALLAS):
        assert not consumes(tok, lltok, g, bad)[1], bad
    one = grammar(TOOLS, "required", False, "qwen3_xml")
    assert consumes(tok, lltok, one, DALLAS)[2] and not consumes(tok, lltok, one, DALLAS + "\n" + DALLAS)[0]
    named = grammar(TOOLS, {"type": "function", "function": {"name": "calculate_area"}}, True, "qwen3_xml")
    assert consumes(tok, lltok, named, area)[1] and not consumes(tok, lltok, named, DALLAS)[0]
    auto = grammar(TOOLS, "auto", False, "qwen3_xml")
    for text in ("It is sunny.", "Let me look." + DALLAS, DALLAS + "\nDone."):
        assert consumes(tok, lltok, auto, text)[:2] == (True, True), text
    assert not consumes(tok, lltok, auto, "Look <tool_call>\n<function=nope>")[0]


def test_sampling_under_the_grammar_gives_valid_calls(tok, lltok):
    closed = json.loads(json.dumps(TOOLS))
    for t in closed:
        t["function"]["parameters"]["properties"].pop("dimensions", None)
        t["function"]["parameters"]["additionalProperties"] = False
    g = grammar(closed, "required", False, "qwen3_xml")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in closed}
    got = 0
    for seed in range(6):
        text = sample_under(tok, lltok, g, seed, max_tokens=120)
        if text is None:  # a raw string value ran on: the token limit, as a model may
            continue
        content, calls = ToolParser("qwen3_xml").parse(text, tools=schemas)
        assert content is None and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
        got += 1
    assert got >= 2
