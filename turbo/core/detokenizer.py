"""Output text of a request: incremental detokenization that never emits a broken UTF-8 character, and
stop-string handling.

The pieces these classes release are the request's whole output text: the engine streams them and joins the
same pieces into ``GenerationOutput.text`` (and a session's history), so every way of reading a reply gives the
same text. When generation runs to its end (finish reason length or stop), :meth:`IncrementalDetokenizer.flush`
releases what is held back except an incomplete multi-byte character (the token limit cut it): that is never
streamed, so it is never part of the text either (no U+FFFD where the model was cut mid-character, and none in
the next turn's prompt). A cancelled or failed request flushes nothing: its text is what was already released.
"""
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
        prefix, full = self._window()
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return self._advance(full[len(prefix):])
        return ""

    def flush(self) -> str:
        """At the end of generation: the text still held back, without its trailing incomplete character.

        Held-back text ends in one U+FFFD, the decoder's replacement for a multi-byte character whose last bytes
        were never generated; that U+FFFD is dropped, and the complete text before it (which may share the
        incomplete character's tokens) is returned. Empty when nothing is held back.
        """
        prefix, full = self._window()
        if full.endswith("\ufffd"):
            full = full[:-1]
        return self._advance(full[len(prefix):]) if len(full) > len(prefix) else ""

    def _window(self) -> tuple[str, str]:
        """(text of the window's already-emitted tokens, text of the whole window)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        return prefix, full

    def _advance(self, piece: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return piece


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
