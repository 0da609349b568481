"""Incremental detokenization never emits a broken UTF-8 character; stop strings split across pieces."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from turbo.detokenizer import IncrementalDetokenizer, StopStringMatcher


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
