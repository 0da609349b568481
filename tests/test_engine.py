"""End-to-end engine behaviour on the embedded SmolLM2 quantized with RTN W4A16 g64."""
from __future__ import annotations

import pytest

from lite.formats import LiteturboError
from turbo import Engine, EngineConfig, GenerationConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_rtn_g64):
    return Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=4096))


def test_greedy_answers_capitals(engine):
    s = engine.session()
    assert "Paris" in s.chat("What is the capital of France?", max_new_tokens=40)
    s2 = engine.session()
    assert "Tokyo" in s2.chat("What is the capital of Japan?", max_new_tokens=40)
    s.close()
    s2.close()


def test_three_turn_session_equals_stateless_and_prefills_only_new_tokens(engine):
    turns = ["What is the capital of France?", "What is the capital of Japan?", "Name one famous dish from there."]
    gen = GenerationConfig(max_new_tokens=48)
    s = engine.session()
    stateful = []
    for i, msg in enumerate(turns):
        history_before = list(s.seq.token_ids)
        computed_before = s.seq.num_computed
        s.chat(msg, gen=gen)
        out = s.last
        stateful.append(out.token_ids)
        prompt_ids = engine.chat_template_ids(s.messages[:-1])
        assert out.prompt_tokens == len(prompt_ids)
        # the prompt extends the previous history: everything already computed was reused
        assert prompt_ids[:computed_before] == history_before[:computed_before]
        assert out.cached_tokens == computed_before
        assert engine.stats()["last_prefill_tokens"] == len(prompt_ids) - computed_before
        if i == 2:
            new_user = engine.encode(msg)
            # only the last reply's end marker, the new user message and the template around it
            assert engine.stats()["last_prefill_tokens"] <= len(new_user) + 12
            assert computed_before > 60
    messages = s.messages
    s.close()
    # stateless: each full conversation on a fresh sequence of an engine without prefix caching
    fresh = Engine(engine.path, EngineConfig(max_kv_tokens=4096, enable_prefix_caching=False))
    for i in range(3):
        conv = messages[: 2 * i + 1]
        ids = fresh.chat_template_ids(conv)
        out = fresh.generate(ids, gen)
        assert out.cached_tokens == 0
        assert out.token_ids == stateful[i], f"turn {i + 1} differs"
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]


def test_streaming_pieces_join_to_reply(engine):
    s = engine.session()
    pieces = list(s.chat("Count from one to five.", stream=True, max_new_tokens=30))
    assert len(pieces) > 1
    assert "".join(pieces) == s.messages[-1]["content"] == s.last.text
    s.reset()
    assert s.messages == [] and s.seq.block_table == []


def test_abandoned_stream_keeps_history_consistent(engine):
    s = engine.session()
    it = s.chat("Tell me a long story about a dragon.", stream=True, max_new_tokens=60, keep_partial=True)
    first = [next(it) for _ in range(3)]
    it.close()  # the client went away; keep_partial: its partial reply is the assistant's turn
    assert s.messages[-1]["role"] == "assistant" and s.messages[-1]["content"] == "".join(first)
    reply = s.chat("Thanks. What is 2 + 2?", max_new_tokens=20)
    assert reply
    it = s.chat("Another story?", stream=True, max_new_tokens=60)
    next(it)
    it.close()  # by default the abandoned turn is rolled back
    assert len(s.messages) == 4 and s.messages[-1]["content"] == reply
    s.close()


def test_stop_strings_and_max_tokens(engine):
    out = engine.generate("The days of the week are Monday, Tuesday,", max_new_tokens=40, stop=["Thursday"])
    assert "Thursday" not in out.text and out.finish_reason == "stop"
    out = engine.generate("Once upon a time", max_new_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_sampling_seeded_is_reproducible(engine):
    g = GenerationConfig(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=123, ignore_eos=True)
    a = engine.generate("My favourite animal is", g)
    b = engine.generate("My favourite animal is", g)
    assert a.token_ids == b.token_ids


def test_bad_prompts_have_clear_errors(engine):
    with pytest.raises(LiteturboError, match="empty"):
        engine.generate("")
    s = engine.session()
    with pytest.raises(LiteturboError, match="empty"):
        s.chat("   ")
    with pytest.raises(LiteturboError, match="context holds"):
        engine.generate(list(range(1, 5000)))
    with pytest.raises(LiteturboError, match="vocabulary"):
        engine.generate([10**7])
    s.close()
    with pytest.raises(LiteturboError, match="closed"):
        s.chat("hello")
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]


def test_second_turn_while_streaming_is_refused(engine):
    s = engine.session()
    it = s.chat("Name three colors.", stream=True, max_new_tokens=15)
    first = next(it)
    with pytest.raises(LiteturboError, match="still being generated"):
        s.chat("What is 2+2?", max_new_tokens=10)
    rest = "".join(it)
    assert s.messages[-1]["content"] == first + rest
    assert s.chat("What is 2+2?", max_new_tokens=10)  # idle again
    never_started = s.chat("unused", stream=True)
    del never_started  # a stream never iterated holds nothing
    assert s.chat("Thanks!", max_new_tokens=5) is not None
    s.close()


def test_bad_options_are_liteturbo_errors(engine, smollm2_rtn_g64):
    with pytest.raises(LiteturboError, match="unknown backend 'cutlass'"):
        Engine(smollm2_rtn_g64, backend="cutlass")
    with pytest.raises(LiteturboError, match="needs an Ascend NPU|NPU"):
        Engine(smollm2_rtn_g64, backend="ascend", device="cpu")
    with pytest.raises(LiteturboError, match="device"):
        Engine(smollm2_rtn_g64, device="bogus")
    with pytest.raises(LiteturboError, match="Engine option"):
        Engine(smollm2_rtn_g64, bogus=1)
    s = engine.session()
    with pytest.raises(LiteturboError, match="must be a str"):
        s.chat(None)
    with pytest.raises(LiteturboError, match="finite"):
        s.chat("hi", temperature=float("nan"))
    with pytest.raises(LiteturboError, match="generation option"):
        s.chat("hi", foo=1)
    s.close()


def test_min_new_tokens_logprobs_and_penalties(engine):
    out = engine.generate("What is 2+2? Answer briefly.", max_new_tokens=30, min_new_tokens=20, logprobs=3)
    assert len(out.token_ids) >= 20
    assert len(out.logprobs) == len(out.token_ids) and all(len(x) == 3 for x in out.logprobs)
    assert all(lp[0][0] == t for lp, t in zip(out.logprobs, out.token_ids))  # greedy picks the top one
    rep = engine.generate("List: apple, apple, apple, apple,", max_new_tokens=12, ignore_eos=True,
                          repetition_penalty=5.0)
    plain = engine.generate("List: apple, apple, apple, apple,", max_new_tokens=12, ignore_eos=True)
    apple = set(engine.encode(" apple"))
    assert rep.token_ids != plain.token_ids
    assert sum(t in apple for t in rep.token_ids) <= sum(t in apple for t in plain.token_ids)


# --- one reply text, whichever way it is read (issue 10) ------------------------------------------------------
CUT_PROMPT = "Repeat after me: 北京北京北京"  # the reply repeats CJK characters, two byte-level tokens each


@pytest.fixture(scope="module")
def cut_case(engine):
    """``(n, ids)``: the greedy reply ``ids`` to CUT_PROMPT, and the smallest token limit ``n`` that cuts it inside
    a multi-byte character after some complete text."""
    s = engine.session()
    s.chat(CUT_PROMPT, max_new_tokens=12)
    ids = s.last.token_ids
    s.close()
    tok = engine.tokenizer
    cuts = [n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).endswith("\ufffd") and tok.decode(ids[:n])[:-1]]
    assert cuts, f"the reply {tok.decode(ids)!r} has no multi-byte character to cut"
    return cuts[0], ids


def _cut_gens(engine, cut_case):
    """(gen, expected finish reason, expected text) for a reply cut by the token limit, the same with a stop
    string holding text back until the end, and a reply cut by a stop string."""
    n, ids = cut_case
    tok = engine.tokenizer
    kept = tok.decode(ids[:n])[:-1]  # the complete characters before the cut one
    full = tok.decode(ids)
    stop = full[len(kept)]  # the character the limit cut
    return [(GenerationConfig(max_new_tokens=n), "length", kept),
            (GenerationConfig(max_new_tokens=n, stop=[kept[-1] + "#"]), "length", kept),
            (GenerationConfig(max_new_tokens=len(ids), stop=[stop]), "stop", full[:full.index(stop)])]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["length", "length-stop-held", "stop"])
def test_reply_text_is_one_text_everywhere(engine, cut_case, case):
    """The smallest case: a token limit that ends the reply inside a multi-byte character. The stream, the
    non-streamed reply, ``GenerationOutput.text`` and the session history are the same text, without U+FFFD, and
    the next turn's prompt carries that text."""
    gen, reason, expected = _cut_gens(engine, cut_case)[case]
    n, ids = cut_case
    tok = engine.tokenizer
    s = engine.session()
    pieces = list(s.chat(CUT_PROMPT, stream=True, gen=gen))
    out = s.last
    assert out.finish_reason == reason
    if reason == "length":
        assert out.token_ids == ids[:n] and tok.decode(out.token_ids).endswith("\ufffd")  # the cut is real
    assert expected and "\ufffd" not in expected
    assert "".join(pieces) == out.text == s.messages[-1]["content"] == expected
    prompt = engine.chat_template_ids([{"role": "user", "content": CUT_PROMPT}])
    assert engine.generate(prompt, gen).text == expected
    s.chat("Thanks.", max_new_tokens=2)
    next_prompt = tok.decode(s.seq.token_ids[:s.last.prompt_tokens])
    assert expected + "<|im_end|>" in next_prompt and "\ufffd" not in next_prompt
    s.close()


def test_cancelled_and_failed_replies_keep_exactly_the_streamed_text(engine, cut_case, monkeypatch):
    """A cancel (the client goes away, or ``Engine.cancel``) or an error ends the text where the stream ended:
    text held back as a possible stop-string start is not added to the output or the history afterwards."""
    n, ids = cut_case
    full = engine.tokenizer.decode(ids)
    hold = GenerationConfig(max_new_tokens=len(ids), stop=[full[0] + "#"])  # always holds one character back
    s = engine.session()
    it = s.chat(CUT_PROMPT, stream=True, gen=hold, keep_partial=True)
    first = next(it)
    it.close()  # the client went away
    assert s.last.finish_reason == "cancelled" and len(s.last.token_ids) > len(first)
    assert s.last.text == s.messages[-1]["content"] == first and full.startswith(first)

    prompt = engine.chat_template_ids([{"role": "user", "content": CUT_PROMPT}])
    req = engine.add_request(prompt, hold)
    streamed = ""
    while not streamed:
        engine.step()
        streamed += req.take_text()
    engine.cancel(req)
    streamed += req.take_text()
    out = engine.output(req)
    assert out.finish_reason == "cancelled" and out.text == streamed == first

    s2 = engine.session()
    it = s2.chat(CUT_PROMPT, stream=True, gen=hold)
    pieces = [next(it)]

    def lost(step):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", lost)
    with pytest.raises(RuntimeError, match="device lost"):
        pieces += list(it)
    monkeypatch.undo()
    assert s2.last.finish_reason == "error"
    assert s2.last.text == s2.messages[-1]["content"] == "".join(pieces) == first
    s.close()
    s2.close()
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]


def test_raw_text_gets_the_tokenizers_bos_and_chat_prompts_only_the_templates(tmp_path):
    """Raw text (generate, add_request, perplexity) is tokenized as the tokenizer does by default: one BOS; a chat
    prompt has the BOS its template writes, and no second one."""
    import math

    from tiny_models import build_key_outlier_model, save_word_tokenizer
    from turbo.perplexity import perplexity, window_nll

    path = build_key_outlier_model(tmp_path / "m")
    save_word_tokenizer(path, 128, bos=True)  # adds <s> (id 2) before every text; its template writes <s>
    e = Engine(path, EngineConfig(dtype="float32", max_kv_tokens=512, block_size=8))
    bos = e.tokenizer.bos_token_id
    assert bos == 2
    text = "the of and to in a is that for the of and to"
    plain = e.encode(text, add_special_tokens=False)
    assert bos not in plain and len(plain) == 13
    assert e.encode(text) == [bos] + plain
    req = e.add_request(text, GenerationConfig(max_new_tokens=1))
    assert req.seq.token_ids == [bos] + plain
    e.cancel(req)
    assert e.generate(text, max_new_tokens=1).prompt_tokens == 14

    chat = e.chat_template_ids([{"role": "user", "content": text}])
    assert chat[0] == bos and chat.count(bos) == 1
    s = e.session()
    s.chat(text, max_new_tokens=1)
    assert s.seq.token_ids[:s.last.prompt_tokens] == chat
    s.close()

    ppl = perplexity(e, text, seqlen=8, max_windows=1, progress=False)["ppl"]
    assert ppl == pytest.approx(math.exp(window_nll(e, [bos] + plain[:7])), rel=1e-6)
    assert ppl != pytest.approx(math.exp(window_nll(e, plain[:8])), rel=1e-3)
