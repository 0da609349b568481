"""Speculative decoding from history (turbo/core/speculative.py): prompt lookup, the suffix index, recent outputs,
draft-length adaptation and acceptance by hand; the engine's output with drafts equal to the output without, token
for token (float32: greedy, sampled with a seed, with penalties, logprobs and a JSON schema), with stop strings and
token limits inside an accepted run, in a session and beside other requests, and the prefix cache kept clean of
rejected drafts. The distribution test and the batch-invariant 16-bit test are in test_speculative_exact.py."""
from __future__ import annotations

import pytest

from lite.formats import LiteturboError
from turbo import Engine, EngineConfig, GenerationConfig
from turbo.core.speculative import (DraftState, Layout, RecentOutputs, SuffixIndex, accepted, draft, eligible,
                                    propose_ngram, propose_suffix, whitespace_ids)


def test_prompt_lookup_and_acceptance_by_hand():
    h = [5, 6, 7, 8, 9, 1, 2, 6, 7, 8]
    assert propose_ngram(h, 3) == [9, 1, 2]  # "6 7 8" seen before, followed by 9 1 2
    assert propose_ngram([1, 2, 3, 4], 2) == []  # no earlier match
    assert propose_ngram([3, 4, 1, 2, 9, 9, 3, 4], 4) == [1, 2, 9, 9]  # 2-gram when no 3-gram matches
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2]  # the most recent match, cut by the history's end
    assert accepted([4, 5, 6], [4, 5, 9]) == 2 and accepted([1], []) == 0 and accepted([7, 8], [8]) == 0
    # every sampling option may speculate now (verified exactly); 0 is off
    assert eligible(GenerationConfig(speculative=2, temperature=1, logprobs=2)) and not eligible(GenerationConfig())
    with pytest.raises(LiteturboError, match="speculative"):
        GenerationConfig(speculative=17)


def test_suffix_index_takes_the_longest_earlier_match_by_hand():
    # the tail "5 1 2 3 7 8" occurred whole once; "3 7 8" alone more recently: prompt lookup takes the recent 3-gram
    h = [5, 1, 2, 3, 7, 8, 40, 41, 0, 0, 3, 7, 8, 50, 51, 5, 1, 2, 3, 7, 8]
    assert SuffixIndex(h).match(h, 2, own=True) == (6, [40, 41])
    assert propose_ngram(h, 2) == [50, 51]
    h2 = [9, 7, 8, 40, 3, 7, 8, 50, 7, 8]
    assert SuffixIndex(h2).match(h2, 1, own=True) == (2, [50])  # equal lengths: the most recent
    assert SuffixIndex([1, 2]).match([1, 2], 3, own=True) == (0, [])  # its own tail is no match
    # growing in place, then a shorter list (a rolled-back turn) re-indexes
    h3 = [4, 5, 6, 4, 5]
    idx = SuffixIndex(h3)
    assert idx.match(h3, 2, own=True) == (2, [6, 4])
    h3 += [6, 9, 4, 5]
    idx.sync()
    assert idx.match(h3, 3, own=True) == (2, [6, 9, 4])  # two matches of length 2: the most recent
    h4 = [4, 5, 7, 4, 5]
    idx.sync(h4)
    assert idx.match(h4, 3, own=True) == (2, [7, 4, 5])
    # a match running into the tail is a loop: drafted on over its period (prompt lookup stops at the end)
    loop = [9, 1, 2, 3, 1, 2, 3, 1, 2]
    assert SuffixIndex(loop).match(loop, 5, own=True) == (5, [3, 1, 2, 3, 1])
    assert propose_ngram(loop, 5) == [3, 1, 2]
    assert SuffixIndex([5, 7, 7, 7]).match([5, 7, 7, 7], 4, own=True) == (2, [7, 7, 7, 7])
    assert RecentOutputs().match([1, 2], 4) == (0, [])
    r = RecentOutputs()
    r.add([1, 2, 3, 1, 2])
    assert r.match([0, 1, 2], 4) == (2, [3, 1, 2])  # another text's end is no loop of this one


def test_recent_outputs_draft_across_requests_but_not_across_outputs_and_stay_bounded():
    r = RecentOutputs(capacity=40)
    r.add([10, 11, 12, 13, 14])
    r.add([20, 21, 22])
    assert r.match([1, 11, 12], 3) == (2, [13, 14])  # stops at the end of that output
    assert r.match([13, 14], 2) == (0, [])  # nothing after the last token of an output
    st = DraftState()
    # the request's own history has "11 12" followed by 99 but the server's longer match wins
    assert propose_suffix(st, [11, 12, 99, 5, 10, 11, 12], 2, r) == [13, 14]
    assert propose_suffix(DraftState(), [11, 12, 99, 5, 11, 12], 2, r) == [99, 5]  # a tie: its own history
    for i in range(20):
        r.add([100 + i] * 5)
    assert len(r.index.tokens) <= 40 and r.match([104, 104], 1) == (0, [])  # the oldest were dropped
    assert r.match([119, 119], 1) == (2, [119])


def test_draft_length_adapts_to_acceptance():
    st = DraftState(length=2)
    st.update(2, 2, k=8)
    assert st.length == 4  # all kept: two more
    st.update(4, 1, k=8)
    assert st.length == 3  # any other outcome: one less
    st.update(3, 0, k=8)
    st.update(2, 0, k=8)
    st.update(1, 0, k=8)
    assert st.length == 1 and st.paused == 0
    st.update(1, 0, k=8)  # the 4th step in a row with nothing kept: drafting pauses
    assert st.paused > 0
    st.length = 7
    st.update(7, 7, k=8)
    assert st.length == 8  # never above k
    # a short match drafts the current length, a long one the full k
    h = list(range(100, 120)) + [1, 2, 3, 4, 5, 6] + list(range(100, 120))
    st = DraftState(length=2)
    assert propose_suffix(st, h, 6, None) == [1, 2, 3, 4, 5, 6]  # 20 tokens matched
    assert propose_suffix(DraftState(length=2), [7, 8, 1, 2, 3, 9, 7, 8], 6, None) == [1, 2]


W, W2 = 90, 91  # whitespace-only tokens (a line break with indentation, a space)


def test_whitespace_only_tokens_are_matched_as_if_absent_and_the_exact_layout_wins_a_tie():
    skip = frozenset({W, W2})
    compact = [1, 2, 3, 4, 5, 6, 7]  # e.g. {"a": 1, "b": 2} as one line
    out = [0, 1, W, 2, 3, W, 4]  # the same written out over lines
    h = compact + [-1] + out
    assert SuffixIndex(h).match(h, 3, own=True) == (0, [])  # without skip: "3 W 4" is no earlier window
    assert SuffixIndex(h, skip).match(h, 3, own=True) == (4, [5, 6, 7])  # "1 2 3 4" matched, W not counted
    # the context ends inside a run of skip tokens: the draft starts after the source's own ones
    src = [1, 2, W, W2, 3, 4]
    assert SuffixIndex(src, skip).match([8, 1, 2, W], 2) == (2, [3, 4])
    assert SuffixIndex(src, skip).match([8, 1, 2], 2) == (2, [W, W2])  # none written yet: the source's layout
    # equal lengths without skip tokens: the one agreeing with the context's layout wins over the more recent
    h2 = [5, 1, W, 2, 3, 50, 6, 1, 2, 3, 60, 0, 1, W, 2, 3]
    assert SuffixIndex(h2, skip).match(h2, 1, own=True) == (3, [50])
    assert SuffixIndex(h2).match(h2, 1, own=True) == (4, [50])  # without skip, the exact one is the longest


def test_a_draft_takes_the_layout_of_the_request_output():
    skip = frozenset({W, W2})
    lay = Layout(skip)
    lay.learn([70, 71, 1, 2, W, 3, 4], start=2)  # the output so far (from position 2): a line break between 2 and 3
    assert lay.between[(2, 3)] == (W,) and lay.between[(1, 2)] == () and (71, 1) not in lay.between
    assert lay.apply([9, 1], [2, 3, 5]) == [2, W, 3, 5]  # the source had none: the output's inserted
    assert lay.apply([9, 1, 2], [W2, 3, 5]) == [W, 3, 5]  # the source had another: the output's
    assert lay.apply([9, 1, 2, W], [3, 5]) == [3, 5]  # already written by the context
    assert lay.apply([9, 1, 2, W2], [3, 5]) == [3, 5]  # the context wrote another: left to the model
    assert lay.apply([9, 1], [W2, 2, 6, W2, 7]) == [2, 6, W2, 7]  # the output wrote "1 2" with none between
    srv = Layout(skip)
    srv.add([6, W2, W2, 7])  # the server's outputs: used where the request's own output says nothing
    assert lay.apply([9, 4], [6, 7], srv) == [6, W2, W2, 7]
    lay.learn([70, 71, 1, 2, W, 3, 4, 6, 7], start=2)  # the request's own wins once it has written the pair
    assert lay.apply([9, 4], [6, 7], srv) == [6, 7]


def test_compact_json_restated_indented_drafts_the_indented_tokens(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    skip = whitespace_ids(tok)
    assert {tok.convert_tokens_to_ids(t) for t in ("Ċ", "ĠĠ")} <= skip
    assert tok.encode("city")[0] not in skip and len(skip) < 1000
    compact = '{"tool": "get_weather", "city": "Lisbon", "date": "2026-12-06", "temperature_c": 17, "wind_kmh": 22}'
    indented = '{\n  "tool": "get_weather",\n  "city": "Lisbon",\n  "date": "2026-12-06",\n  "temperature_c": 17,'
    prompt, out = tok.encode(compact), tok.encode(indented)
    cut = len(tok.encode('{\n  "tool": "get_weather",\n  "city": "Lis'))
    assert out[:cut] == tok.encode('{\n  "tool": "get_weather",\n  "city": "Lis')
    seq = prompt + out[:cut]
    # prompt lookup: the last tokens ("L is") are followed by "bon", "\",", " \"" in the compact source; the model
    # writes a line break there; the suffix drafter with the output's layout drafts the indented continuation
    want = out[cut:cut + 8]
    st = DraftState(length=8)
    assert propose_suffix(st, seq, 8, None, skip, output_start=len(prompt)) == want
    assert propose_ngram(seq, 8) != want
    # without skip tokens it matches the same compact source but keeps its layout
    assert propose_suffix(DraftState(length=8), seq, 8, None) != want


def test_drafts_end_at_a_stop_token():
    class Seq:  # a decoding sequence: every token computed but the last
        from turbo.core.scheduler import Status
        status, token_ids = Status.RUNNING, [1, 2, 3, 7, 9, 5, 1, 2, 3]
        num_tokens, num_computed = 9, 8

    class Req:
        seq, gen, output_ids = Seq(), GenerationConfig(speculative=4, max_new_tokens=50), [3]
        draft_state, guide, stop_ids, prompt_len = DraftState(), None, {9}, 8
    assert draft(Req(), 4096, "ngram") == [7, 9]  # 7 9 5 1 without the tokens after the stop 9
    assert draft(Req(), 4096, "suffix") == [7, 9]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16))


TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the great "
        "lens, and wrote the weather in his log: wind from the west, clouds low, a fishing boat returning late.")


def _ids(engine, msg):
    return engine.chat_template_ids([{"role": "user", "content": msg}])


@pytest.mark.e2e
@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_tokens_equal_without_drafts(engine, k):
    p = _ids(engine, "Repeat this text exactly:\n\n" + TEXT)
    want = engine.generate(p, GenerationConfig(max_new_tokens=60))
    c0 = engine.counters.as_dict()
    got = engine.generate(p, GenerationConfig(max_new_tokens=60, speculative=k))
    assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
    steps = engine.counters.spec_steps - c0["spec_steps"]
    acc = engine.counters.spec_accepted - c0["spec_accepted"]
    assert steps > 0 and acc > steps // 2  # the text repeats the prompt: most drafts are kept


@pytest.mark.e2e
def test_stops_and_limits_inside_an_accepted_run_and_batched_with_others(engine):
    p = _ids(engine, "Repeat this text exactly:\n\n" + TEXT)
    ref = engine.generate(p, GenerationConfig(max_new_tokens=60))
    stop = ref.text.split()[8]  # a word in the middle of a copied run
    for gen in (GenerationConfig(max_new_tokens=23), GenerationConfig(max_new_tokens=60, stop=[stop])):
        want = engine.generate(p, gen)
        got = engine.generate(p, GenerationConfig(**{**gen.__dict__, "speculative": 4}))
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert len(engine.generate(p, GenerationConfig(max_new_tokens=23, speculative=4)).token_ids) == 23
    # beside a sampled request and a plain greedy one, in one batch
    other = _ids(engine, "Write a haiku.")
    outs = engine.generate([p, other, other], GenerationConfig(max_new_tokens=40, speculative=3))
    alone = [engine.generate(x, GenerationConfig(max_new_tokens=40)) for x in (p, other)]
    assert outs[0].token_ids == alone[0].token_ids and outs[1].token_ids == alone[1].token_ids


def test_rejected_drafts_never_reach_the_prefix_cache(engine):
    p = _ids(engine, "Continue this story in your own words:\n\n" + TEXT)
    first = engine.generate(p, GenerationConfig(max_new_tokens=48, speculative=6))
    # the whole conversation again: the cached blocks must hold exactly these tokens' KV
    again = engine.generate(p + first.token_ids[:-1], GenerationConfig(max_new_tokens=8))
    fresh = Engine(engine.path, EngineConfig(dtype="float32", max_kv_tokens=4096, block_size=16,
                                             enable_prefix_caching=False))
    want = fresh.generate(p + first.token_ids[:-1], GenerationConfig(max_new_tokens=8))
    assert again.cached_tokens > len(p) and again.token_ids == want.token_ids


@pytest.mark.e2e
def test_a_session_speculates_turn_after_turn(engine):
    s = engine.session()
    plain = engine.session()
    for msg in ("Repeat exactly: " + TEXT, "Now repeat it once more."):
        assert s.chat(msg, max_new_tokens=50, speculative=3) == plain.chat(msg, max_new_tokens=50)
    s.close()
    plain.close()


def test_the_server_default_and_the_request_field(engine):
    import httpx

    from conftest import serve_in_thread
    from turbo.serve.app import create_app

    url, stop = serve_in_thread(create_app(engine, model_name="s", api_keys="", speculative=3))
    try:
        body = {"messages": [{"role": "user", "content": "Repeat this text exactly:\n\n" + TEXT}], "max_tokens": 40,
                "temperature": 0}
        c0 = engine.counters.spec_steps
        on = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        c1 = engine.counters.spec_steps
        off = httpx.post(f"{url}/v1/chat/completions", json=dict(body, speculative=0), timeout=60).json()
        assert c1 > c0 and engine.counters.spec_steps == c1  # the default drafts; speculative=0 turns it off
        assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'liteturbo_speculative{figure="tokens_per_step"}' in metrics
        bad = httpx.post(f"{url}/v1/chat/completions", json=dict(body, speculative=99), timeout=30)
        assert bad.status_code == 400 and "speculative" in bad.text
        # the Responses and Anthropic Messages APIs take the field too
        c2 = engine.counters.spec_steps
        r = httpx.post(f"{url}/v1/responses", json={"input": body["messages"][0]["content"], "max_output_tokens": 20,
                                                     "temperature": 0, "speculative": 4, "store": False}, timeout=60)
        assert r.status_code == 200, r.text
        m = httpx.post(f"{url}/v1/messages", json={"messages": body["messages"], "max_tokens": 20, "temperature": 0,
                                                    "speculative": 4}, timeout=60)
        assert m.status_code == 200, m.text
        assert engine.counters.spec_steps > c2
        bad = httpx.post(f"{url}/v1/messages", json={"messages": body["messages"], "max_tokens": 20,
                                                      "speculative": -1}, timeout=30)
        assert bad.status_code == 400 and "speculative" in bad.text
    finally:
        stop()


def test_a_step_shares_its_draft_budget_most_likely_kept_first():
    from types import SimpleNamespace

    from turbo.core.speculative import share_budget
    reqs = [SimpleNamespace(draft_state=DraftState(rate=r)) for r in (0.2, 0.9, 0.5)]
    drafts = {0: [1] * 8, 1: [2] * 8, 2: [3] * 8}
    share_budget(reqs, drafts, num_running=3, rows=16)  # 13 draft rows beside the 3 real ones
    # by value 0.9^j and 0.5^j: 0.9^1..0.9^6 (0.53) rank above 0.5^1; then 0.5, 0.9^7 (0.48), 0.9^8, 0.5^2 (0.25) ...
    assert [len(drafts[i]) for i in range(3)] == [1, 8, 4]
    drafts = {0: [1] * 8}
    share_budget(reqs[:1], drafts, num_running=90, rows=80)  # a batch past the budget drafts nothing
    assert drafts[0] == []


def test_a_grammar_drafts_its_forced_tokens_and_cuts_refused_drafts(engine):
    from turbo.core.guided import Guide
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    g = Guide(GenerationConfig(json_schema=schema), engine.tokenizer, engine.vocab_size)
    forced = g.forced_tokens()
    assert engine.tokenizer.decode(forced) == '{"name'  # the schema's first key is certain
    free = engine.tokenizer.encode("hello world")
    assert g.valid_prefix(free) == 0 and g.valid_prefix(forced + free) == len(forced)
    for t in forced:  # nothing was consumed by the checks
        g.consume(t)
