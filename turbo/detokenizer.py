"""Incremental detokenization that never emits a broken UTF-8 character, plus stop-string handling."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text pieces.

    Decodes a short window of recent tokens and emits only text that is final: a piece ending in U+FFFD
    (an incomplete multi-byte character split across tokens) is held back until the next token completes it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        """Append one token; return the newly final text (maybe empty)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""


class StopStringMatcher:
    """Hold back streamed text that may be the start of a stop string; cut the text at a full match."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add text; return what can be released. After a match, ``stopped`` is True and the rest is dropped."""
        if self.stopped:
            return ""
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        release = len(self.pending) - self.hold
        if release <= 0:
            return ""
        out, self.pending = self.pending[:release], self.pending[release:]
        return out

    def flush(self) -> str:
        """Release what is held back at the end of generation."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
