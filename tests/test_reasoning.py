"""Reasoning parsers (turbo/reasoning_parsers.py): a thinking model's reply split into reasoning and content, whole
and streamed in pieces of every size (always the same), from a prompt that opened the block or not."""
from __future__ import annotations

import random

import pytest

from lite.formats import LiteturboError
from turbo.reasoning_parsers import ReasoningParser, parser_for_template, prompt_opens_reasoning

CASES = [  # (reply, prompt_open, reasoning, content)
    ("Let me think.\n</think>\n\nThe answer is 4.", True, "Let me think.\n", "The answer is 4."),
    ("<think>\nhmm 2+2</think>4", False, "\nhmm 2+2", "4"),
    ("  <think>a < b, so</think>  yes", False, "a < b, so", "yes"),
    ("Just an answer, no <think> here.", False, None, "Just an answer, no <think> here."),
    ("still thinking when the limit cut", True, "still thinking when the limit cut", None),
    ("<think>cut inside </thi", False, "cut inside </thi", None),
    ("</think>", True, "", None),
    ("<thin", False, None, "<thin"),
    ("", False, None, ""),
    ("x</think>y</think>z", True, "x", "y</think>z"),
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("reply, prompt_open, reasoning, content", CASES)
def test_split_whole_and_streamed_agree(name, reply, prompt_open, reasoning, content):
    p = ReasoningParser(name)
    assert p.split(reply, prompt_open) == (reasoning, content)
    rng = random.Random(len(reply))
    for _ in range(20):  # random piece boundaries, markers split anywhere
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(0, 6))))
        pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
        s = p.streamer(prompt_open)
        deltas = [d for piece in pieces for d in s.feed(piece)] + s.finish()
        got_r = "".join(d.get("reasoning_content", "") for d in deltas)
        got_c = "".join(d.get("content", "") for d in deltas)
        assert got_r == (reasoning or "") and got_c == (content or ""), pieces


def test_prompt_and_template_detection():
    assert prompt_opens_reasoning("<|user|>hi<|assistant|><think>\n")
    assert not prompt_opens_reasoning("<|assistant|><think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("plain")
    assert parser_for_template("{{ '<think>\\n' }}") == "deepseek_r1"
    assert parser_for_template("{% if enable_thinking %}<think>{% endif %}") == "qwen3"
    assert parser_for_template("{{ messages }}") is None
    with pytest.raises(LiteturboError, match="choose one of"):
        ReasoningParser("o1")


# --- through the HTTP front: a thinking template over the float32 SmolLM2 ---------------------------------------------

THINKING_TEMPLATE = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{% set content = message['content'] %}{% if message['role'] == 'assistant' and '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}{{'<|im_start|>' + message['role'] + '
' + content + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
<think>
' }}{% endif %}"""
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "How many legs does a cat have?"}]


@pytest.fixture(scope="module")
def thinking(smollm2_path, tmp_path_factory):
    """(url of a server with the reasoning parser chosen from the template, its engine loop, the end-of-reasoning
    token ids): SmolLM2's files with a DeepSeek-R1-style template whose generation prompt opens ``<think>``."""
    from conftest import serve_in_thread
    from turbo import Engine, EngineConfig
    from turbo.serve.app import create_app

    d = tmp_path_factory.mktemp("thinking")
    for f in smollm2_path.iterdir():
        if f.name != "chat_template.jinja" and f.is_file():
            (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    engine = Engine(d, EngineConfig(dtype="float32", max_kv_tokens=2048, block_size=16))
    app = create_app(engine, model_name="m", api_keys="")
    assert app.state.served.reasoning is not None and app.state.served.reasoning.name == "deepseek_r1"
    url, stop = serve_in_thread(app)
    yield url, app.state.loop, engine.tokenizer.encode("</think>", add_special_tokens=False)
    stop()


@pytest.mark.slow
@pytest.mark.e2e
def test_reasoning_split_streamed_and_structured_output_after_it(thinking):
    import json

    import jsonschema
    import openai

    from turbo import GenerationConfig

    url, loop, end_ids = thinking
    # a small nudge towards "</think>" (its three tokens) so the 135M model ends its reasoning
    kw = dict(model="m", messages=ASK, max_tokens=60, temperature=0, logit_bias={str(t): 4 for t in end_ids},
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}})
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    # the raw reply, from the engine: the same prompt and constraint, held after the reasoning
    raw = loop.submit(loop.engine.chat_template_ids(ASK), GenerationConfig(
        max_new_tokens=60, temperature=0, logit_bias={t: 4 for t in end_ids}, json_schema=ANSWER,
        after_reasoning="open")).result()
    text = raw.text
    assert "</think>" in text and raw.finish_reason == "stop"
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    thought, answer = text.split("</think>", 1)
    assert msg.model_extra["reasoning_content"] == thought and thought.strip()
    assert msg.content == answer.lstrip()
    jsonschema.validate(json.loads(msg.content), ANSWER)  # the schema held after the reasoning, not before it
    assert r.usage.completion_tokens == len(raw.token_ids)  # max_tokens counts both
    chunks = list(c.chat.completions.create(stream=True, **kw))
    streamed_r = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks if ch.choices)
    streamed_c = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert (streamed_r, streamed_c) == (msg.model_extra["reasoning_content"], msg.content)
    # without a constraint the reply is split the same way; a reasoning cut by max_tokens is all reasoning
    cut = c.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0)
    assert cut.choices[0].message.content is None and cut.choices[0].message.model_extra["reasoning_content"]



@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tools_under_a_reasoning_parser_are_served(thinking, choice):
    """Issue 57: with a reasoning parser, every request with tools was 400 ("the constraint does not compile");
    the call grammar now holds after the reasoning."""
    import httpx

    url, _, end_ids = thinking
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather],
        "tool_choice": choice, "max_tokens": 120, "temperature": 0, "logit_bias": {str(t): 4 for t in end_ids}})
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    if choice == "required" and choice0["finish_reason"] != "length":
        assert [c["function"]["name"] for c in choice0["message"]["tool_calls"]] == ["get_weather"]


# --- every constraint after the reasoning: each grammar kind under each reasoning parser --------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a call of get_weather(city="Paris") in each tool-call format (turbo/tool_parsers/)
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "granite": '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "qwen3_xml": '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n'
                 '</tool_call>',
    "pythonic": '[get_weather(city="Paris")]',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}
LARK = 'start: "legs: " NUM\nNUM: /[0-9]+/'
STRUCTURED = {  # kind -> (request fields, an answer that holds, one that does not)
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": ANSWER}}}, '{"answer":4}', '{"answer":"four"}'),
    "response_format json_object": ({"response_format": {"type": "json_object"}}, '{"legs":4}', "four legs"),
    "guided_json": ({"guided_json": ANSWER}, '{"answer":4}', '{"legs":4}'),
    "guided_regex": ({"guided_regex": r"[0-9]+ legs"}, "4 legs", "four legs"),
    "guided_choice": ({"guided_choice": ["four", "six"]}, "four", "five"),
    "guided_grammar (Lark)": ({"guided_grammar": LARK}, "legs: 4", "legs: four"),
    "guided_grammar (GBNF)": ({"guided_grammar": 'root ::= "legs: " [0-9]+'}, "legs: 4", "legs: four"),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": LARK}}, "legs: 4", "legs: four"),
    "structured_outputs regex": ({"structured_outputs": {"regex": "[0-9]+"}}, "4", "four"),
}
TOOL_CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}},
                "auto": "auto"}
# (reasoning parser, rendered prompt's end): each parser with a prompt that opened the block (the reply starts
# inside it) and one that did not (the reply may open it)
PROMPTS = [(name, tail) for name in ("deepseek_r1", "qwen3")
           for tail in ("<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n")]


def _kinds():
    for kind, (fields, good, bad) in STRUCTURED.items():
        yield kind, "hermes", fields, [good], [bad, "It has four legs."]
    for fmt, call in CALLS.items():
        wrong = call.replace("get_weather", "get_wether")  # a call of a tool the request does not have
        for choice, value in TOOL_CHOICES.items():
            free = ["It is sunny in Paris."]
            yield (f"tools {fmt} tool_choice {choice}", fmt, {"tools": [WEATHER], "tool_choice": value},
                   [call] + (free if choice == "auto" else []), [wrong] + ([] if choice == "auto" else free))


@pytest.fixture(scope="module")
def smol_tok(smollm2_path):
    import llguidance.hf

    from turbo.core.startup import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    return tok, llguidance.hf.from_tokenizer(tok)


@pytest.mark.parametrize("name, tail", PROMPTS)
@pytest.mark.parametrize("kind, fmt, fields, goods, bads", list(_kinds()), ids=[k[0] for k in _kinds()])
def test_every_grammar_kind_holds_after_the_reasoning_of_every_parser(smol_tok, name, tail, kind, fmt, fields,
                                                                      goods, bads):
    """A request's constraint (structured outputs, a plain guided_grammar in Lark or GBNF, and the tool-call
    grammar of every format for tool_choice required / named / auto) under a reasoning parser: free text up to
    ``</think>``, then the constraint. Built as the chat route builds it (the request read, the tool constraint, the
    reasoning layer from the prompt, the GenerationConfig) and compiled by llguidance as the engine does; issue 57:
    every Lark grammar was refused with "Expecting value: line 1 column 1"."""
    from types import SimpleNamespace

    import llguidance

    from turbo.core.guided import check_grammar
    from turbo.reasoning_parsers import ReasoningParser
    from turbo.serve import protocol
    from turbo.serve.app import Served
    from turbo.tool_parsers import ToolParser

    tok, lltok = smol_tok
    s = SimpleNamespace(reasoning=ReasoningParser(name), tool_parser=ToolParser(fmt),
                        client=SimpleNamespace(tokenizer=tok))
    req = protocol.read_chat({"model": "m", "messages": ASK, **fields}, "m")
    layers = (req.sampling, Served.tool_constraint(s, req.tools, req.sampling, True))
    opened, after = Served.reasoning_layer(s, tok.encode(f"<|im_start|>user\nHi<|im_end|>\n{tail}"), layers)
    assert opened is tail.endswith("<think>\n") and after == {"after_reasoning": "open" if opened else "optional"}
    gen = protocol.gen_config(2048, {}, *layers, after)
    grammar, _ = check_grammar(gen)  # 400 "the constraint does not compile" before the fix

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lltok, grammar)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    thought = "Four legs, I think.</think>\n\n"
    starts = [thought] if opened else ["<think>" + thought, ""]  # the reply may open the block, or answer at once
    for start in starts:
        for good in goods:
            assert accepts(start + good), (start, good)
        for bad in bads:
            assert not accepts(start + bad), (start, bad)
    if opened:  # the reasoning must end before the answer
        assert not accepts(goods[0])
