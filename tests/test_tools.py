"""Tool calling (turbo/serve/tools.py, turbo/tool_parsers/, turbo/serve/tool_grammar.py): request checks, tool messages, the prompt,
the three reply formats whole and streamed (joined by the openai client's own stream accumulator), the grammar
that forces a call (checked with llguidance on SmolLM2's tokenizer, the arguments checked with jsonschema), and the
finish reason."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from lite.formats import LiteturboError
from turbo.errors import InvalidRequest
from turbo.http_errors import APIError
from turbo.serve import protocol, tools
from turbo.tool_parsers import ToolParser

from tool_format_cases import assert_stream_equals_parse, compact, consumes, matcher, openai_join, stream  # noqa: E402,F401

llguidance = pytest.importorskip("llguidance")
import llguidance.hf  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from turbo.core.startup import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def lltok(tok):
    return llguidance.hf.from_tokenizer(tok)


def api_error(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(*args, **kw)
    assert ei.value.status == 400
    return ei.value


# --- read_tools --------------------------------------------------------------------------------------------------

def test_read_tools_accepts_openai_tools_with_their_defaults():
    req = tools.read_tools([WEATHER, TIME, NOARGS], None, None)
    assert [t.name for t in req.tools] == ["get_weather", "get_time", "ping"]
    assert (req.choice, req.named, req.parallel, req.max_calls, req.parses) == ("auto", None, True, None, True)
    assert req.tools[0].description == "The weather in a city" and req.tools[1].description is None
    assert req.tools[2].parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert req.openai()[0] == WEATHER
    named = tools.read_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.named, named.parallel, named.max_calls) == ("named", "get_time", False, 1)
    assert tools.read_tools([WEATHER], "required", False).max_calls == 1
    assert tools.read_tools([WEATHER], "none", None).parses is False
    assert tools.read_tools(None, None, None) is None and tools.read_tools([], "none", True) is None


@pytest.mark.parametrize("body, choice, parallel, param, text", [
    (None, "required", None, "tool_choice", "needs 'tools'"),
    ([], {"type": "function", "function": {"name": "f"}}, None, "tool_choice", "needs 'tools'"),
    ({"type": "function"}, None, None, "tools", "must be a list"),
    ([{"type": "custom", "custom": {"name": "x"}}], None, None, "tools", "only function tools"),
    ([{"type": "function", "function": {"name": "get weather"}}], None, None, "tools", "1 to 64 letters"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, None, "tools", "1 to 64 letters"),
    ([{"type": "function", "function": {"name": "f", "returns": {}}}], None, None, "tools", "'returns'"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, None, "tools", "description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None, "tools", "strict"),
    ([WEATHER, WEATHER], None, None, "tools", "'get_weather' twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, None, "tools",
     "\"type\": \"object\""),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "tools", "schema object"),
    ([{"type": "function", "function": {"name": "fmt", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "bogus"}}}}}], None, None, "tools",
     "'fmt' is a JSON schema this server cannot enforce: Unknown format: bogus"),
    ([{"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)b"}}}}}], None, None, "tools",
     "'look' is a JSON schema this server cannot enforce"),
    ([{"type": "function", "function": {"name": "r", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}], None, None, "tools", "'r'"),
    ([WEATHER], "any", None, "tool_choice", "\"required\""),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, None, "tool_choice",
     "not in 'tools' (get_weather)"),
    ([WEATHER], {"type": "function", "name": "get_weather"}, None, "tool_choice", "\"function\": {\"name\""),
    ([WEATHER], None, "yes", "parallel_tool_calls", "true or false"),
])
def test_read_tools_refuses_bad_fields_naming_them(body, choice, parallel, param, text):
    e = api_error(tools.read_tools, body, choice, parallel)
    assert e.param == param and text in e.message, e.message


def test_the_schema_check_is_llguidances_own_verdict():
    m = llguidance.LLMatcher
    good, bad = WEATHER["function"]["parameters"], {"type": "object", "properties": {"x": {"type": "foo"}}}
    assert m.validate_grammar(m.grammar_from_json_schema(good)) == ""
    err = m.validate_grammar(m.grammar_from_json_schema(bad))
    assert err and err in api_error(tools.read_tools, [{"type": "function", "function": {
        "name": "f", "parameters": bad}}]).message


# --- messages -------------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
    {"role": "assistant", "content": "It is 18C and sunny; 14:05."},
    {"role": "user", "content": "Thanks"},
]


def test_read_messages_reads_tool_calls_and_results_for_templates():
    out = protocol.read_messages(CONVERSATION)
    assert out[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]}
    assert out[3] == {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert out[4] == {"role": "tool", "content": "14:05", "tool_call_id": "call_2", "name": "get_time"}
    assert out[0] == {"role": "system", "content": "Be brief."} and out[5]["content"].startswith("It is")
    # tool_calls empty or null: a plain assistant message
    plain = protocol.read_messages([{"role": "user", "content": "x"},
                                    {"role": "assistant", "content": "y", "tool_calls": []},
                                    {"role": "assistant", "content": "z", "tool_calls": None}])
    assert plain[1:] == [{"role": "assistant", "content": "y"}, {"role": "assistant", "content": "z"}]


def _with(i: int, **change) -> list[dict]:
    msgs = json.loads(json.dumps(CONVERSATION))
    msgs[i] = {k: v for k, v in {**msgs[i], **change}.items() if v is not ...}
    return msgs


def _call(args) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}


@pytest.mark.parametrize("msgs, text", [
    (_with(2, tool_calls=[_call('["Paris"]')]), "arguments must be a JSON object as a string"),
    (_with(2, tool_calls=[_call("{city: Paris}")]), "arguments must be a JSON object"),
    (_with(2, tool_calls=[_call({"city": "Paris"})]), "arguments must be a JSON object as a string"),
    (_with(2, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]), ".id must be"),
    (_with(2, tool_calls=[{**_call("{}"), "index": 0}]), "tool_calls[0] must be"),
    (_with(2, tool_calls=[_call("{}"), _call("{}")]), "repeats an id"),
    (_with(2, tool_calls="call_1"), "tool_calls must be a list"),
    (_with(2, refusal="no"), "unsupported field 'refusal'"),
    (_with(3, tool_call_id=...), "needs 'tool_call_id'"),
    (_with(3, tool_call_id="call_9"), "answers tool_call_id \"call_9\""),
    (_with(3, extra=1), "unsupported field 'extra'"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "r"}],
     "it made no tool calls"),
    # a result after the next user message no longer answers the earlier call
    (CONVERSATION[:4] + [{"role": "user", "content": "?"}, CONVERSATION[4]], "answers tool_call_id \"call_2\""),
    ([{"role": "function", "content": "x"}], "use system, developer, user, assistant or tool"),
])
def test_bad_tool_messages_are_400_naming_the_message(msgs, text):
    e = api_error(protocol.read_messages, msgs)
    assert e.param == "messages" and text in e.message, e.message


# --- the prompt -----------------------------------------------------------------------------------------------------

def test_without_tools_the_prompt_is_the_templates_own(tok):
    for msgs in ([{"role": "user", "content": "Hi"}], CONVERSATION[:2] + [{"role": "assistant", "content": "ok"},
                                                                          {"role": "user", "content": "more"}]):
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tools.render_prompt(tok, msgs, None) == want


def test_fallback_prompt_for_a_template_without_tools(tok):
    assert not tools.template_handles_tools(tok, [WEATHER])  # SmolLM2's template has no tool support
    req = tools.read_tools([WEATHER, TIME], None, None)
    got = tools.render_prompt(tok, protocol.read_messages(CONVERSATION), req)
    tool_lines = "\n".join(json.dumps(t) for t in (WEATHER, TIME))
    system = ("Be brief.\n\n# Tools\n\nYou may call functions to help with the user's request. The functions are "
              f"listed as JSON inside <tools></tools>:\n<tools>\n{tool_lines}\n</tools>\n\nTo call a function, "
              "answer with a JSON object holding its name and its arguments inside <tool_call></tool_call> tags, "
              "one block per call:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <the arguments as a "
              "JSON object>}\n</tool_call>\nEach function's result comes back inside "
              "<tool_response></tool_response>.")
    want_msgs = [
        {"role": "system", "content": system}, CONVERSATION[1],
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'
                                         '\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n14:05\n"
                                    "</tool_response>"},
        CONVERSATION[5], CONVERSATION[6]]
    assert got == tok.apply_chat_template(want_msgs, add_generation_prompt=True, tokenize=False)
    assert got.count("Be brief.") == 1 and "SmolLM" not in got  # merged into the user's system message
    # no system message: the tools' system message comes first (in place of the template's default one)
    alone = tools.render_prompt(tok, [{"role": "user", "content": "Hi"}], req)
    assert alone.startswith("<|im_start|>system\n# Tools\n") and alone.endswith("<|im_start|>assistant\n")
    # the call the fallback asks for is what the default parser reads
    assert tools.choose_parser(tok) == "hermes"
    content, calls = ToolParser("hermes").parse(want_msgs[2]["content"])
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


QWENISH = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}\n<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{%- if m.role == 'tool' %} ({{ m.tool_call_id }}){% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_tools_renders_them_itself(tok):
    import copy

    t2 = copy.copy(tok)
    t2.chat_template = QWENISH
    req = tools.read_tools([WEATHER], None, None)
    msgs = protocol.read_messages(CONVERSATION)
    got = tools.render_prompt(t2, msgs, req)
    assert got == t2.apply_chat_template(msgs, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert 'TOOLS:{"type": "function"' in got and '<tool_call>get_weather {"city": "Paris"}</tool_call>' in got
    assert "18C, sunny (call_1)" in got
    assert tools.choose_parser(t2) == "hermes"


def test_prompt_errors_are_invalid_requests(tok):
    import copy

    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        tools.render_prompt(bare, [{"role": "user", "content": "x"}])
    strict = copy.copy(tok)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        tools.render_prompt(strict, [{"role": "user", "content": "x"}])


def test_choose_parser_from_the_template_or_by_name(tok):
    import copy

    for mark, name in (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("<tool_call>", "hermes")):
        t2 = copy.copy(tok)
        t2.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}" + mark
        assert tools.choose_parser(t2) == name
    assert tools.choose_parser(tok, "mistral") == "mistral"
    with pytest.raises(LiteturboError, match="unknown tool-call parser 'qwen'; choose one of hermes, llama3_json, "
                                             "mistral"):
        tools.choose_parser(tok, "qwen")


# --- parsers --------------------------------------------------------------------------------------------------------

def wrap(fmt: str, calls: list[tuple[str, str]], before: str = "", after: str = "") -> str:
    """A reply in ``fmt`` with ``calls`` (name, arguments JSON text as the model wrote it)."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objs = [f'{{"name": {json.dumps(n)}, "{key}": {a}}}' for n, a in calls]
    if fmt == "hermes":
        return before + "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objs) + after
    if fmt == "mistral":
        return before + "[TOOL_CALLS] [" + ", ".join(objs) + "]" + after
    return "; ".join(objs) + after


TRICKY_ARGS = [
    '{"city": "Paris"}', '{}', '{ }', '{"a": [1, 2.50, -0, 1e5, 1E-7, 12345678901234567890, -3.0e+2, true, false, '
    'null]}', '{"s": "quote \\" backslash \\\\ slash \\/ nl \\n tab \\t ctl \\u0001 é \\u00e9 \\ud83d\\ude00 '
    '\\ud800 lone"}', '{"tag": "</tool_call> and ]} and <tool_call>", "nest": {"deep": [[{"x": {}}], []]}}',
    '{\n  "pretty": [\n    1,\n    {"k": "v"}\n  ]\n}', '{"emoji": "😀", "cjk": "天气"}',
]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_parsers_read_their_format_whole_and_streamed_alike(fmt):
    rng = random.Random(7)
    for args in TRICKY_ARGS:
        text = wrap(fmt, [("get_weather", args), ("ping", "{}")], before="" if fmt == "llama3_json" else "Sure. ")
        content, calls = assert_stream_equals_parse(fmt, text, rng)
        assert [c.name for c in calls] == ["get_weather", "ping"]
        assert json.loads(calls[0].arguments) == json.loads(args) and calls[1].arguments == "{}"
        # compact as json.dumps writes it, but a lone surrogate stays escaped (valid UTF-8)
        assert calls[0].arguments == compact(json.loads(args)).replace("\ud800", "\\ud800")
        assert content == (None if fmt == "llama3_json" else "Sure.")
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls) and calls[0].id != calls[1].id


def test_hermes_details():
    p = ToolParser("hermes")
    c, calls = p.parse('Let me look.\n<tool_call>\n{"arguments": {"x": 1}, "name": "f", "id": 3}\n</tool_call>\n'
                       'Then: <tool_call>{"name": "g"}</tool_call>  done  ')
    assert c == "Let me look.\nThen:\ndone" and [(k.name, k.arguments) for k in calls] == [("f", '{"x":1}'),
                                                                                             ("g", "{}")]
    for text in ("Just text, <b>bold</b> and <tool_c", "<tool_call>not json</tool_call> x", "<tool_call>[1, 2]",
                 '<tool_call>{"nom": "f"}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', '<tool_call>\n{"name": "f"',
                 "  spaces kept  \n", ""):
        assert p.parse(text) == (text, []), text  # no call: the text exactly
    c, calls = p.parse("<tool_call><tool_call>\n" + '{"name": "f", "arguments": {}}\n</tool_call>')
    assert c == "<tool_call>" and calls[0].name == "f"


CUT = {  # format -> (a complete call, then one cut inside its JSON by max_tokens)
    "hermes": 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", '
              '"arguments": {"city": "Par',
    "llama3_json": '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"city": "Par',
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"city": "Par',
}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_a_call_cut_by_max_tokens_is_dropped_whole(fmt):
    # issue 39: a cut call came back as a tool_calls entry whose arguments were not JSON, "<tool_call" in content
    text = CUT[fmt]
    for end in range(1, len(text) + 1):  # cut at every character
        part = text[:end]
        rng = random.Random(end)
        content, calls = ToolParser(fmt).parse(part, cut=True)
        s = ToolParser(fmt).streamer()
        deltas, i = [], 0
        while i < len(part):
            n = rng.choice((1, 2, 5))
            deltas += s.feed(part[i:i + n])
            i += n
        msg = openai_join(deltas + s.finish(cut=True))
        assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == \
            [(c.name, c.arguments) for c in calls]
        assert (msg.content or None) == (content or None)
        for c in calls:
            assert c.name == "f" and c.arguments == '{"a":1}'  # complete calls only
        closed = text.index("}}") + 2
        assert len(calls) == (end >= closed)
        assert not any(m in (content or "") for m in ("<tool", "[TOOL", "{", "<|")), (part, content)
        assert "Sure.\n".startswith(content or ""), (part, content)  # the text before the calls, as far as it came


def test_a_reply_that_ends_or_breaks_inside_a_call_gives_the_text():
    # not cut by max_tokens (end of sequence, a stop string) or broken JSON: plain text, never a half call
    p = ToolParser("hermes")
    for text in ('<tool_call>\n{"name": "f", "arguments": {"city": "Par',
                 '<tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call> after'):
        assert p.parse(text) == (text, []), text
        s = p.streamer()
        assert "".join(d["content"] for d in s.feed(text) + s.finish()) == text and s.calls == []
    content, calls = p.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
                             '<tool_call>{"name": "g", "arguments": {"a": ]}</tool_call>')
    assert [c.name for c in calls] == ["f"] and content == '<tool_call>{"name": "g", "arguments": {"a": ]}</tool_call>'


def test_llama3_json_only_at_the_start():
    p = ToolParser("llama3_json")
    c, calls = p.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}')
    assert c is None and (calls[0].name, calls[0].arguments) == ("f", '{"a":1}')
    c, calls = p.parse('  {"name": "f", "parameters": {}} and some text')
    assert c == "and some text" and len(calls) == 1
    for text in ('Here: {"name": "f", "parameters": {}}', '{"city": "Paris"}', "{oops"):
        assert p.parse(text) == (text, [])


def test_max_calls_keeps_the_first():
    rng = random.Random(3)
    for fmt in ("hermes", "llama3_json", "mistral"):
        text = wrap(fmt, [("a", '{"i": 1}'), ("b", '{"i": 2}'), ("c", "{}")], after="")
        _, calls = assert_stream_equals_parse(fmt, text, rng, max_calls=1)
        assert [(c.name, c.arguments) for c in calls] == [("a", '{"i":1}')]


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "int", "float", "lit"] if depth < 3 else ["str", "int", "float", "lit"])
    if kind == "obj":
        return {_random_str(rng): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "arr":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "str":
        return _random_str(rng)
    if kind == "int":
        return rng.choice([0, -1, 7, 10 ** rng.randint(0, 25) * rng.choice([1, -1])])
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-9, 3.0e21, rng.uniform(-1e6, 1e6)])
    return rng.choice([True, False, None])


def _random_str(rng: random.Random) -> str:
    alphabet = 'ab "\\/\n\t\x01\x1féü天😀{}[],:<>_tool_call'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


def test_random_arguments_round_trip_in_every_format():
    rng = random.Random(2024)
    for n in range(150):
        fmt = ("hermes", "llama3_json", "mistral")[n % 3]
        calls_in = [(f"fn_{i}", {_random_str(rng): _random_json(rng) for _ in range(rng.randint(0, 3))})
                    for i in range(rng.randint(1, 3))]
        style = rng.choice([{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}])
        text = wrap(fmt, [(name, json.dumps(a, **style)) for name, a in calls_in],
                    before="" if fmt == "llama3_json" else rng.choice(["", "Ok ", "x\n"]))
        _, calls = assert_stream_equals_parse(fmt, text, rng)
        assert [c.name for c in calls] == [name for name, _ in calls_in]
        for c, (_, a) in zip(calls, calls_in):
            assert json.loads(c.arguments) == a and c.arguments == compact(a)


def test_text_without_calls_streams_as_the_same_text():
    rng = random.Random(11)
    pieces = ["Hello", " ", "\n", "<", "tool", "_call", ">", "</tool_call>", "[TOOL_CALLS]", "{", '"name"', ":",
              '"f"', "}", "<|python_tag|>", "x"]
    for n in range(300):
        fmt = ("hermes", "llama3_json", "mistral")[n % 3]
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        content, calls = assert_stream_equals_parse(fmt, text, rng)
        if not calls:
            assert content == text


def test_streamed_content_is_held_only_while_it_may_be_a_marker():
    s = ToolParser("hermes").streamer()
    assert s.feed("Hello <tool_") == [{"content": "Hello"}]  # " <tool_" may open a call
    assert s.feed("box> x") == [{"content": " <tool_box> x"}]
    assert s.feed(' <tool_call>{"name": "f", "arguments": ') == []
    assert s.feed('{"a": [1') == []  # a call goes out once its object closes (never half a call)
    head, args = s.feed("0]}}</tool_call>")
    assert head["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":[10]}'}}]}
    assert s.finish() == []


# --- the grammar of a forced call ------------------------------------------------------------------------------------

def schema_ok(tool: dict, args: dict) -> bool:
    try:
        jsonschema.validate(args, tool["function"].get("parameters", {"type": "object", "properties": {}}))
        return True
    except jsonschema.ValidationError:
        return False


def test_grammar_forces_calls_in_the_hermes_format(tok, lltok):
    req = tools.read_tools([WEATHER, TIME], "required", True)
    g = tools.call_grammar(req, "hermes")
    good = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
            '<tool_call>\n{"name":"get_time","arguments":{"tz":"UTC"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>']
    for text in good:
        assert consumes(tok, lltok, g, text) == (True, True, False)  # complete, more calls allowed
        content, calls = ToolParser("hermes").parse(text)
        assert content is None and calls
        for c in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[c.name]
            assert schema_ok(tool, json.loads(c.arguments))
    bad = {
        "wrong name": '<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>',
        "city not a string": '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',
        "days over maximum": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "days": 8}}\n'
                             '</tool_call>',
        "unknown argument": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "x": 1}}\n</tool_call>',
        "enum": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}\n</tool_call>',
        "extra key": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}, "id": 1}\n</tool_call>',
        "content first": 'Sure! <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
        "padding": '<tool_call>\n{"name": "get_time",   "arguments": {"tz": "UTC"}}\n</tool_call>',
    }
    for why, text in bad.items():
        assert consumes(tok, lltok, g, text)[0] is False, why
    # the schema-violating ones are indeed invalid for jsonschema (the test data is right)
    for why in ("city not a string", "days over maximum", "unknown argument"):
        args = json.loads(bad[why].split("\n")[1])["arguments"]
        assert not schema_ok(WEATHER, args), why
    missing = '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>'
    assert not schema_ok(WEATHER, {"days": 2}) and consumes(tok, lltok, g, missing)[1] is False


def test_grammar_one_call_and_named(tok, lltok):
    one = tools.call_grammar(tools.read_tools([WEATHER, TIME], "required", False), "hermes")
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert consumes(tok, lltok, one, call) == (True, True, True)  # stopped: nothing but EOS after it
    assert consumes(tok, lltok, one, call + "\n" + call)[0] is False
    named = tools.call_grammar(tools.read_tools([WEATHER, TIME], {"type": "function", "function": {
        "name": "get_weather"}}, True), "hermes")
    assert consumes(tok, lltok, named, call)[0] is False  # another tool, though it is in 'tools'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert consumes(tok, lltok, named, weather) == (True, True, True)
    noargs = tools.call_grammar(tools.read_tools([NOARGS], "required", False), "hermes")
    assert consumes(tok, lltok, noargs, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')[2]
    assert not consumes(tok, lltok, noargs, '<tool_call>\n{"name": "ping", "arguments": {"a": 1}}\n</tool_call>')[0]
    assert tools.call_grammar(tools.read_tools([WEATHER], "none", True), "hermes") is None
    with pytest.raises(LiteturboError, match="choose one of"):
        tools.call_grammar(tools.read_tools([WEATHER], "required", True), "qwen")


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_grammar_leaves_text_free_and_holds_a_started_call(tok, lltok, parallel):
    """tool_choice "auto": any text, but a call marker starts a call that must follow the format and the schema to
    its end (so no reply is a malformed call); without parallel calls, no second marker."""
    g = tools.call_grammar(tools.read_tools([WEATHER, TIME], "auto", parallel), "hermes")
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    for text in ("Sure, it is sunny.", "", "x < y and <tool_ but no call", call, "Let me check.\n" + call,
                 call + "\nDone."):
        assert consumes(tok, lltok, g, text)[:2] == (True, True), text
    for why, text in {"wrong name": '<tool_call>\n{"name": "get_wether", "arguments": {}}',
                      "bad arguments": '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}',
                      "extra argument": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "x": 1}}',
                      "marker without a call": "a <tool_call> b"}.items():
        assert consumes(tok, lltok, g, text)[0] is False, why
    assert consumes(tok, lltok, g, call + "\n" + call)[0] is parallel
    for fmt in ("llama3_json", "mistral"):
        g = tools.call_grammar(tools.read_tools([WEATHER, TIME], "auto", parallel), fmt)
        good = wrap(fmt, [("get_weather", '{"city": "Paris"}')])
        assert consumes(tok, lltok, g, good)[:2] == (True, True), good
        assert consumes(tok, lltok, g, "It is sunny.")[:2] == (True, True)
        assert consumes(tok, lltok, g, wrap(fmt, [("nope", "{}")]))[0] is False


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
def test_grammar_in_the_other_formats(tok, lltok, fmt):
    g = tools.call_grammar(tools.read_tools([WEATHER, TIME], "required", True), fmt)
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    for n in (1, 2):
        text = wrap(fmt, calls[:n])
        assert consumes(tok, lltok, g, text)[:2] == (True, True), text
        content, parsed = ToolParser(fmt).parse(text)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == \
            [(a, json.loads(b)) for a, b in calls[:n]]
    assert not consumes(tok, lltok, g, wrap(fmt, [("get_weather", '{"city": 1}')]))[0]
    assert not consumes(tok, lltok, g, wrap(fmt, [("nope", "{}")]))[0]
    assert not consumes(tok, lltok, g, "Hi " + wrap(fmt, calls[:1]))[0]
    other_key = wrap("mistral" if fmt == "llama3_json" else "llama3_json", calls[:1])  # arguments vs parameters
    assert not consumes(tok, lltok, g, other_key)[0]
    single = tools.call_grammar(tools.read_tools([WEATHER, TIME], "required", False), fmt)
    assert consumes(tok, lltok, single, wrap(fmt, calls[:1]))[1]
    assert not consumes(tok, lltok, single, wrap(fmt, calls))[0]


def test_grammar_keeps_local_refs_of_a_schema(tok, lltok):
    tree = {"type": "function", "function": {"name": "plant", "parameters": {
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
            "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"], "additionalProperties": False}}}}}
    g = tools.call_grammar(tools.read_tools([tree, WEATHER], "required", False), "hermes")
    ok = {"root": {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}}
    bad = {"root": {"v": 1, "kids": [{"w": 2}]}}
    assert schema_ok(tree, ok) and not schema_ok(tree, bad)
    text = '<tool_call>\n{"name": "plant", "arguments": %s}\n</tool_call>'
    assert consumes(tok, lltok, g, text % json.dumps(ok))[1]
    assert not consumes(tok, lltok, g, text % json.dumps(bad))[0]


def test_grammar_survives_schema_text_that_looks_like_lark(tok, lltok):
    odd = {"type": "function", "function": {"name": "u", "description": "http://x // no comment # nor } this",
                                             "parameters": {"type": "object", "description": "} \" # // 天 \n",
                                                            "properties": {"url": {"type": "string",
                                                                                   "description": "%json { ]"}},
                                                            "required": ["url"], "additionalProperties": False}}}
    g = tools.call_grammar(tools.read_tools([odd], "required", False), "hermes")
    text = '<tool_call>\n{"name": "u", "arguments": {"url": %s}}\n</tool_call>'
    assert consumes(tok, lltok, g, text % '"http://x"') == (True, True, True)
    assert not consumes(tok, lltok, g, text % "1")[0]


def test_grammar_matches_markers_that_are_special_tokens(smollm2_path):
    from turbo.core.startup import load_tokenizer

    t = load_tokenizer(smollm2_path)
    t.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    lt = llguidance.hf.from_tokenizer(t)
    g = tools.call_grammar(tools.read_tools([TIME], "required", False), "hermes", tokenizer=t)
    ids = t.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert g.startswith(f"start: call\ncall: <[{ids[0]}]> ")
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert consumes(t, lt, g, text) == (True, True, True)  # the markers tokenized as the special tokens
    spelled = [i for piece in re.split(r"(<tool_call>|</tool_call>)", text) if piece
               for i in (t.encode(piece, add_special_tokens=False) if "tool_call>" not in piece else
                         t.encode(piece.replace("<", "< "), add_special_tokens=False))]
    m = matcher(lt, g)
    assert not m.consume_tokens(spelled)  # text that only looks like the marker is refused


def test_sampling_under_the_grammar_gives_valid_calls(tok, lltok):
    """Random tokens among those the grammar allows, until it stops: every reply parses into valid calls."""
    import numpy as np

    closed_time = json.loads(json.dumps(TIME))
    closed_time["function"]["parameters"]["additionalProperties"] = False  # else random keys go on and on
    req = tools.read_tools([closed_time, {"type": "function", "function": {"name": "set", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
        "required": ["on", "level"], "additionalProperties": False}}}], "required", False)
    g = tools.call_grammar(req, "hermes")
    rng = np.random.default_rng(0)
    for _ in range(4):
        m, ids = matcher(lltok, g), []
        while not m.is_stopped() and len(ids) < 200:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[:len(tok)])
            t = int(rng.choice(allowed))
            assert m.consume_token(t), m.get_error()
            ids.append(t)
        assert m.is_stopped() and not m.is_error(), tok.decode(ids)
        content, calls = ToolParser("hermes").parse(tok.decode(ids))
        assert content is None and len(calls) == 1
        tool = {t["function"]["name"]: t for t in req.openai()}[calls[0].name]
        assert schema_ok(tool, json.loads(calls[0].arguments))


# --- finish reason -------------------------------------------------------------------------------------------------

def test_finish_reason():
    call = [tools.ToolCall("f", "{}")]
    auto = tools.read_tools([WEATHER], None, None)
    named = tools.read_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert tools.finish_reason("stop", call, auto) == "tool_calls"
    assert tools.finish_reason("stop", call) == "tool_calls"
    assert tools.finish_reason("stop", [], auto) == "stop"
    assert tools.finish_reason("length", call, auto) == "length"
    assert tools.finish_reason("stop", call, named) == "stop"  # OpenAI answers a named choice with "stop"
    assert call[0].openai() == {"id": call[0].id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_a_repeated_call_ends_the_reply_streamed_or_not():
    a = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    b = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
    text = a + b + a + b + "<tool_call>\n{\"name\": \"get_t"  # a small model looping until max_tokens
    content, calls = ToolParser("hermes").parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "UTC"})]
    s = ToolParser("hermes").streamer()
    deltas = []
    for k in range(0, len(text), 3):
        got = s.feed(text[k:k + 3])
        deltas += got
        if s.repeated:
            break
    assert s.repeated and k < len(a + b + a)  # noticed when the repeat's object closed, before the rest
    deltas += s.finish()
    joined: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            got = joined.setdefault(tc["index"], ["", ""])
            got[0] += tc.get("function", {}).get("name", "")
            got[1] += tc.get("function", {}).get("arguments", "")
    assert [(n, json.loads(x)) for n, x in joined.values()] == [(c.name, json.loads(c.arguments)) for c in calls]
    # a different call with the same name is no repeat
    c2 = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
    assert len(ToolParser("hermes").parse(a + b + c2)[1]) == 3


# --- schemas rewritten by their schema positions (turbo.serve.schema_walk) --------------------------------------------

@pytest.mark.parametrize("word", ["default", "enum", "const", "examples"])
def test_grammar_rebases_refs_under_properties_named_like_keywords(tok, lltok, word):
    # the issue's input: the property's name is a JSON Schema keyword and its schema a $ref into $defs
    params = {"$defs": {"Level": {"enum": ["low", "high"]}}, "type": "object",
              "properties": {word: {"$ref": "#/$defs/Level"}}, "required": [word]}
    tool = {"type": "function", "function": {"name": "set_level", "parameters": params}}
    text = '<tool_call>\n{"name": "set_level", "arguments": %s}\n</tool_call>'
    for choice in ("required", {"type": "function", "function": {"name": "set_level"}}):
        g = tools.call_grammar(tools.read_tools([tool, WEATHER], choice, False), "hermes")
        assert consumes(tok, lltok, g, text % json.dumps({word: "low"}))[1]
        assert not consumes(tok, lltok, g, text % json.dumps({word: "mid"}))[0]
    assert schema_ok(tool, {word: "low"}) and not schema_ok(tool, {word: "mid"})


def test_grammar_root_ref_points_at_the_tools_own_schema(tok, lltok):
    # {"$ref": "#"} is the tool's whole parameters schema, not the grammar's root
    params = {"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}},
              "required": ["name"]}
    tool = {"type": "function", "function": {"name": "tree", "parameters": params}}
    g = tools.call_grammar(tools.read_tools([tool], "required", False), "hermes")
    text = '<tool_call>\n{"name": "tree", "arguments": %s}\n</tool_call>'
    good = {"name": "a", "child": {"name": "b", "child": {"name": "c"}}}
    bad = [{"name": "a", "child": {"name": 1}}, {"name": "a", "child": {"city": "x"}},
           {"name": "a", "child": {"name": "tree", "arguments": {}}}]
    assert schema_ok(tool, good) and consumes(tok, lltok, g, text % json.dumps(good))[1]
    for args in bad:
        assert not consumes(tok, lltok, g, text % json.dumps(args))[1], args
    assert not schema_ok(tool, bad[0])


def test_grammar_reads_a_missing_additional_properties_as_false(tok, lltok):
    open_ = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}
    text = '<tool_call>\n{"name": "w", "arguments": %s}\n</tool_call>'
    extra = {"city": "Paris", "type": "string"}  # what SmolLM2 wrote under the open schema (issue 39)
    nested_extra = {"city": "Paris", "where": {"lat": 1, "lon": 2}}
    g = tools.call_grammar(tools.read_tools([{"type": "function", "function": {"name": "w", "parameters": open_}}],
                                            "required", False), "hermes")
    assert consumes(tok, lltok, g, text % json.dumps({"city": "Paris", "where": {"lat": 1.5}}))[1]
    for args in (extra, nested_extra):
        assert not consumes(tok, lltok, g, text % json.dumps(args))[1], args
    said_true = dict(open_, additionalProperties=True)
    g = tools.call_grammar(tools.read_tools([{"type": "function", "function": {"name": "w",
                                                                               "parameters": said_true}}],
                                            "required", False), "hermes")
    assert consumes(tok, lltok, g, text % json.dumps(extra))[1]  # an explicit true is kept
    assert not consumes(tok, lltok, g, text % json.dumps(nested_extra))[1]  # the nested object is still closed


def test_schema_walk_leaves_data_alone():
    from turbo.serve.schema_walk import close_objects, rebase_refs

    schema = {"type": "object", "default": {"$ref": "#/x", "properties": {"a": {}}},
              "examples": [{"$ref": "#"}], "enum": [{"$ref": "#"}], "const": {"$ref": "#"},
              "properties": {"default": {"$ref": "#/$defs/L"}, "enum": {"items": {"$ref": "#"}},
                             "obj": {"properties": {"c": {}}}},
              "allOf": [{"properties": {"b": {}}}], "$defs": {"L": {"anyOf": [{"$ref": "#/$defs/L"}]}}}
    out = rebase_refs(close_objects(schema), "#/$defs/tool0")
    for data in ("default", "examples", "enum", "const"):
        assert out[data] == schema[data]
    assert out["properties"]["default"] == {"$ref": "#/$defs/tool0/$defs/L"}
    assert out["properties"]["enum"]["items"] == {"$ref": "#/$defs/tool0"}
    assert out["$defs"]["L"]["anyOf"][0] == {"$ref": "#/$defs/tool0/$defs/L"}
    assert out["properties"]["obj"]["additionalProperties"] is False
    # beside or inside an allOf an object stays open (closing one part would reject the others' properties)
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    assert schema["properties"]["default"] == {"$ref": "#/$defs/L"}  # the input is not modified
