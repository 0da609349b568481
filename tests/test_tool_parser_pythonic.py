"""The ``pythonic`` tool-call parser (turbo/tool_parsers/pythonic.py) on the published examples (Meta's Llama 3.2 and
Llama 4 prompt-format docs; vLLM's test_pythonic_tool_parser.py and test_llama4_pythonic_tool_parser.py), whole and
streamed alike, and its grammar (turbo/serve/tool_grammar.py)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tool_format_cases import assert_stream_equals_parse, check_published, consumes, grammar, sample_under
from turbo.tool_parsers import ToolParser, parser_for_template

SIMPLE = "get_weather(city='San Francisco', metric='celsius')"
SIMPLE_ARGS = {"city": "San Francisco", "metric": "celsius"}
MORE = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
        "passed_test=True, aliases=['John', 'Johnny'])")
MORE_ARGS = {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, "role": None,
             "passed_test": True, "aliases": ["John", "Johnny"]}
PUBLISHED = [
    ("[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]",
     [("get_weather", SIMPLE_ARGS), ("get_weather", {"city": "Seattle", "metric": "celsius"})], None),
    ("[get_user_info(user_id=7890, special='black')]", [("get_user_info", {"user_id": 7890, "special": "black"})],
     None),
    ('[get_weather(city="San Francisco"), get_weather(city="Seattle")]',
     [("get_weather", {"city": "San Francisco"}), ("get_weather", {"city": "Seattle"})], None),
    (f"[{SIMPLE}]", [("get_weather", SIMPLE_ARGS)], None),
    (f"[{MORE}]", [("register_user", MORE_ARGS)], None),
    ("[get_weather()]", [("get_weather", {})], None),
    ("[do_something_cool(additional_data={})]", [("do_something_cool", {"additional_data": {}})], None),
    ("[do_something_cool(steps=[])]", [("do_something_cool", {"steps": []})], None),
    ("[get_weather(city='Martha\\'s Vineyard', metric='\\\"cool units\\\"')]",
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})], None),
    (f"[{SIMPLE}, {MORE}]", [("get_weather", SIMPLE_ARGS), ("register_user", MORE_ARGS)], None),
    ("[get_weather(city='LA',metric='C'),register_user(name='Doe',age=9)]",
     [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})], None),
    ("<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>",
     [("get_weather", {"city": "LA", "metric": "C"})], None),
    ("<|python_start|>[get_weather(city='LA', metric='C'),register_user(name='Doe', age=9)]",
     [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})], None),
    ("[get_weather(city='SF')]\n", [("get_weather", {"city": "SF"})], None),
    ("How can I help you today?", [], "How can I help you today?"),
]


def test_published_examples_whole_and_streamed():
    check_published("pythonic", PUBLISHED)


def test_what_is_not_a_call_stays_content():
    rng = random.Random(3)
    for text in ("Sure: [get_weather(city='SF')]", "[get_weather('SF')]", "get_weather(city='SF')", "[1, 2] items",
                 "[a.b(x=1)]", "[f(**kw)]", "[]", "[unclosed(city='SF'"):
        assert assert_stream_equals_parse("pythonic", text, rng) == (text, []), text
    # lenient where vLLM is strict: JSON literals, a negative number, leading whitespace, text after the list
    assert [json.loads(c.arguments) for c in ToolParser("pythonic").parse("[f(a=true, b=null, c=-1)]")[1]] == \
        [{"a": True, "b": None, "c": -1}]
    assert assert_stream_equals_parse("pythonic", "  [f(a=1)]\nDone.", rng)[0] == "Done."


def test_cut_max_calls_and_repeats():
    rng = random.Random(5)
    text = f"[{SIMPLE}, {MORE}]"
    for end in range(1, len(text)):  # the list is one block: cut anywhere, it is dropped whole
        assert assert_stream_equals_parse("pythonic", text[:end], rng, cut=True) == ("", [])
    assert [c.name for c in assert_stream_equals_parse("pythonic", text, rng, max_calls=1)[1]] == ["get_weather"]
    s = ToolParser("pythonic").streamer()
    s.feed(f"[{SIMPLE}, {SIMPLE}, {MORE}]")
    s.finish()
    assert s.repeated and [c.name for c in s.calls] == ["get_weather"]


def test_chosen_from_the_template():
    llama32 = ("Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), "
               "func_name2(params)]")
    assert parser_for_template(llama32) == "pythonic"
    assert parser_for_template("Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]") == \
        "pythonic"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from turbo.core.startup import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def lltok(tok):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tok)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "metric": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


def test_grammar_required_named_and_auto(tok, lltok):
    g = grammar(TOOLS, "required", True, "pythonic")
    for text in ('[get_weather(city="Paris")]', '[get_weather(city="Paris", metric="celsius", days=3), ping()]',
                 '[get_weather(city="Paris", days=2)]', "[ping()]"):
        assert consumes(tok, lltok, g, text)[:2] == (True, True), text
        content, calls = ToolParser("pythonic").parse(text)
        assert content is None and calls
    for bad in ('[get_weather(days=2)]', '[get_weather(city="P", days=9)]', '[get_weather(city="P", x=1)]',
                '[get_weather(metric="celsius", city="P")]', '[nope()]', 'Hi [ping()]', '[get_weather(city=3)]'):
        assert not consumes(tok, lltok, g, bad)[1], bad
    one = grammar(TOOLS, "required", False, "pythonic")
    assert consumes(tok, lltok, one, "[ping()]")[2] and not consumes(tok, lltok, one, "[ping(), ping()]")[0]
    named = grammar(TOOLS, {"type": "function", "function": {"name": "ping"}}, True, "pythonic")
    assert consumes(tok, lltok, named, "[ping()]")[1] and not consumes(tok, lltok, named, '[get_weather(city="P")]')[0]
    auto = grammar(TOOLS, "auto", True, "pythonic")
    for text in ("It is sunny.", '[get_weather(city="Paris")]', "  [ping()]"):
        assert consumes(tok, lltok, auto, text)[:2] == (True, True), text
    assert not consumes(tok, lltok, auto, "[nope()]")[0]


def test_sampling_under_the_grammar_gives_valid_calls(tok, lltok):
    g = grammar(TOOLS, "required", False, "pythonic")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    got = 0
    for seed in range(6):
        text = sample_under(tok, lltok, g, seed, max_tokens=80)
        if text is None:
            continue
        content, calls = ToolParser("pythonic").parse(text)
        assert content is None and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
        got += 1
    assert got >= 2
