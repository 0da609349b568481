"""Shared checks of the tool-call parser tests (tests/test_tools.py and tests/test_tool_parser_<format>.py): a reply
read whole and streamed in random pieces must agree (as the official openai client joins the stream), and a grammar
of :mod:`turbo.serve.tool_grammar` accepts or refuses a text token by token."""
from __future__ import annotations

import json
import random
import re

from turbo.serve import tools
from turbo.tool_parsers import ToolParser


def compact(v) -> str:
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


def openai_join(deltas: list[dict]):
    """The message the openai client assembles from these deltas (its own stream accumulator)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for i, d in enumerate([{"role": "assistant"}] + deltas + [{}]):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": "stop" if i == len(deltas) + 1 else None}]}))
    return state.get_final_completion().choices[0].message


def stream(fmt: str, text: str, rng: random.Random, max_calls=None, cut=False, tools=None) -> list[dict]:
    """The deltas of ``text`` fed in random pieces (1 to 20 characters)."""
    s = ToolParser(fmt).streamer(max_calls, tools=tools)
    out, i = [], 0
    while i < len(text):
        n = rng.choice((1, 1, 2, 3, 7, 20))
        out += s.feed(text[i:i + n])
        i += n
    return out + s.finish(cut)


def assert_stream_equals_parse(fmt: str, text: str, rng: random.Random, max_calls=None, cut=False, tools=None):
    """``ToolParser(fmt).parse(text)``, checked equal to its stream in random pieces as the openai client joins it,
    with the deltas' shapes checked."""
    content, calls = ToolParser(fmt).parse(text, max_calls, cut=cut, tools=tools)
    deltas = stream(fmt, text, rng, max_calls, cut, tools)
    msg = openai_join(deltas)
    assert (msg.content or None) == (content or None), (text, deltas)
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == \
        [(c.name, c.arguments) for c in calls]
    for d in deltas:  # the shapes: content alone, or one call: a head with id/name, then argument fragments
        assert set(d) in ({"content"}, {"tool_calls"}) and (d.get("content") or d.get("tool_calls"))
        if "tool_calls" in d:
            (c,) = d["tool_calls"]
            assert set(c) in ({"index", "id", "type", "function"}, {"index", "function"})
            if "id" in c:
                assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["function"]["arguments"] == ""
    return content, calls


def check_published(fmt: str, cases, tools=None, seeds=range(3)):
    """Each ``(reply, [(name, arguments dict)], content)`` read whole and streamed alike, giving those calls (with
    arguments written compactly) and that content."""
    for text, want, want_content in cases:
        for seed in seeds:
            content, calls = assert_stream_equals_parse(fmt, text, random.Random(seed), tools=tools)
            assert [(c.name, json.loads(c.arguments)) for c in calls] == want, text
            assert all(c.arguments == compact(json.loads(c.arguments)) for c in calls)
            assert content == want_content, (text, content)


def matcher(lltok, grammar: str):
    import llguidance

    m = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar))
    assert not m.is_error(), m.get_error()
    return m


def consumes(tok, lltok, grammar: str, text: str) -> tuple[bool, bool, bool]:
    """(every token of ``text`` accepted, the grammar complete, nothing more allowed)."""
    m = matcher(lltok, grammar)
    ok = m.consume_tokens(tok.encode(text, add_special_tokens=False)) and not m.is_error()
    return ok, ok and m.is_accepting(), ok and m.is_stopped()


def sample_under(tok, lltok, grammar: str, seed: int, max_tokens: int = 300) -> str:
    """Random tokens among those ``grammar`` allows, until it stops (or ``max_tokens``): the text."""
    import numpy as np

    rng = np.random.default_rng(seed)
    m, ids = matcher(lltok, grammar), []
    while not m.is_stopped() and len(ids) < max_tokens:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:len(tok)])
        t = int(rng.choice(allowed))
        assert m.consume_token(t), m.get_error()
        ids.append(t)
    assert not m.is_error()
    return tok.decode(ids) if m.is_stopped() else None


def grammar(tool_list: list[dict], choice, parallel: bool, fmt: str) -> str:
    return tools.call_grammar(tools.read_tools(tool_list, choice, parallel), fmt)
