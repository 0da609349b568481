"""Incremental detokenization never emits a broken UTF-8 character; stop strings split across pieces."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from turbo.core.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.mark.parametrize("text", ["北京是中华人民共和国的首都，也是全国的政治、文化中心。", "Café naïve 🙂 日本語 mixed ✓ text"])
def test_pieces_are_whole_characters_and_join_to_decode(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # byte-level BPE splits CJK characters over several tokens, so holding back matters here
    assert len(ids) > len(text) // 2
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    held = sum(1 for p in pieces if p == "")
    assert held > 0  # at least one token ended mid-character and was held back


def test_stop_string_split_across_pieces():
    m = StopStringMatcher(["<END>"])
    out = "".join(m.feed(p) for p in ["Hello wor", "ld <E", "N", "D> ignored"])
    assert out == "Hello world " and m.stopped
    assert m.flush() == ""
    m2 = StopStringMatcher(["<END>"])
    out2 = "".join(m2.feed(p) for p in ["no stop <E", "ND> here"]) 
    assert out2 == "no stop " and m2.stopped
    m3 = StopStringMatcher(["xyz"])
    out3 = "".join(m3.feed(p) for p in ["ab", "cx", "y"]) + m3.flush()
    assert out3 == "abcxy" and not m3.stopped


def test_flush_drops_only_an_incomplete_last_character(tok):
    """At the end of generation the held-back text is released without its incomplete last character: the text is
    what was streamed, never a U+FFFD (which a re-decode of all ids would give)."""
    star = tok("🌟", add_special_tokens=False)["input_ids"]
    assert len(star) == 3  # one character over three byte-level tokens
    d = IncrementalDetokenizer(tok)
    pieces = [d.add(i) for i in star + star[:2]]
    assert pieces == ["", "", "🌟", "", ""] and tok.decode(star + star[:2]) == "🌟\ufffd"
    assert d.flush() == ""
    # a token holding a complete character (a space) and the first byte of another: the space is kept
    space_byte = next(i for i in range(tok.vocab_size) if tok.decode([i]) == " \ufffd")
    d = IncrementalDetokenizer(tok)
    ids = tok("北", add_special_tokens=False)["input_ids"] + [space_byte]
    pieces = [d.add(i) for i in ids]
    assert "".join(pieces) == "北" and pieces[-1] == ""
    assert d.flush() == " " and d.flush() == ""
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in star][-1] == "🌟" and d.flush() == ""  # nothing held: nothing to release
