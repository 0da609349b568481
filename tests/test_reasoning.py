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
