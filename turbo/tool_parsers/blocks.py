"""The streaming reader of the formats whose calls are read a whole block at a time: qwen3_xml, pythonic and
deepseek_v3 (each a :class:`BlockFormat` in its own module). Their calls are not one JSON object that can be
announced as it streams (XML-style parameters typed by the tool's schema, a Python list of calls, markers between
name and arguments), so a block is held from its opening marker until it is complete and then read whole: its calls
go out together, or, when it is not calls of the format, its text goes out as content byte for byte. Content outside
blocks streams as it comes (text that may start a marker is held back until it is known). The rules shared with the
JSON formats (``max_calls``, a repeated call ending the reply, whitespace around calls, a block cut by
``max_tokens`` dropped whole) are :mod:`turbo.tool_parsers`' and :class:`~turbo.tool_parsers.deltas.DeltaWriter`'s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .deltas import WS, DeltaWriter


@dataclass(frozen=True)
class BlockFormat:
    """A block call format: ``name`` (the parser's), ``markers`` that open a block, ``end(block)`` (the length of
    the complete block at the start of ``block``, which begins with a marker, or ``None`` while it is incomplete),
    ``read(block, tools)`` (the block's calls as ``[(name, arguments dict)]``, or ``None`` when it is not calls of
    this format; ``tools``: ``{name: parameters schema}`` of the request, or ``None``), ``start_only`` (a block may
    only start the reply, after whitespace), ``trailer`` (text dropped right after a block, e.g. a closing special
    token), ``template_marks`` (chat-template text that names this format)."""

    name: str
    markers: tuple[str, ...]
    end: Callable[[str], int | None]
    read: Callable[[str, dict | None], list[tuple[str, dict]] | None]
    start_only: bool = False
    trailer: str = ""
    template_marks: tuple = ()  # strings, or tuples of strings that must all appear

    def streamer(self, max_calls: int | None = None, call_id_prefix: str | None = None,
                 tools: dict | None = None) -> "BlockStreamer":
        """A fresh reader of one reply (``tools``: ``{name: parameters schema}``, for formats that type values)."""
        return BlockStreamer(self, max_calls, call_id_prefix, tools)


def compact(args: dict) -> str:
    """Arguments as the call's JSON text: ``json.dumps(args, separators=(",", ":"), ensure_ascii=False)``."""
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


class BlockStreamer(DeltaWriter):
    """Splits a reply into OpenAI chat deltas as it arrives (:meth:`feed` a text piece, :meth:`finish` at the end),
    reading :class:`BlockFormat` blocks whole. After :meth:`finish`, ``calls`` holds the calls."""

    def __init__(self, fmt: BlockFormat, max_calls: int | None = None, call_id_prefix: str | None = None,
                 tools: dict | None = None) -> None:
        super().__init__(max_calls, call_id_prefix)
        self.fmt, self.tools = fmt, tools
        self.mode = "text"        # text, block, trailer, done
        self.armed = True         # may a marker open a block here (start_only: only at the start)
        self.hold = ""            # text that may be the start of a marker (or, in "trailer", of the trailer)
        self.block: list[str] = []

    def feed(self, piece: str) -> list[dict]:
        """The deltas that ``piece`` (the reply's next text) completes."""
        todo = piece
        while todo and self.mode != "done":
            todo = {"text": self._text_mode, "block": self._block_mode, "trailer": self._trailer_mode}[self.mode](todo)
        return self._take()

    def finish(self, cut: bool = False) -> list[dict]:
        """The deltas left at the end of the reply. ``cut`` (the reply was cut by ``max_tokens``): an unfinished
        block and a held partial marker are dropped; otherwise they are content."""
        if self.mode == "block":
            if not cut:
                self._text("".join(self.block))
            self.block = []
        elif self.mode in ("text", "trailer") and not cut:
            self._text(self.hold)
        self.hold, self.mode = "", "done"
        return self._end()

    # --- modes: each reads from the start of ``s`` and returns what it did not read -----------------------------

    def _markers(self) -> tuple[str, ...]:
        return self.fmt.markers if self.armed else ()

    def _text_mode(self, s: str) -> str:
        hold = self.hold + s
        markers = self._markers()
        if not markers:
            self.hold = ""
            self._text(hold)
            return ""
        if self.fmt.start_only:  # only whitespace may come before the block
            lead = len(hold) - len(hold.lstrip(WS))
            rest = hold[lead:]
            if rest and not any(m.startswith(rest[:len(m)]) for m in markers):
                self.armed, self.hold = False, ""
                self._text(hold)
                return ""
        at = min(((i, m) for m in markers if (i := hold.find(m)) >= 0), default=None)
        if at is not None:
            i, m = at
            self._text(hold[:i])
            self.hold, self.mode, self.block = "", "block", [m]
            return hold[i + len(m):]
        keep = max((k for m in markers for k in range(1, min(len(hold), len(m) - 1) + 1)
                    if m.startswith(hold[-k:])), default=0)
        self.hold = hold[len(hold) - keep:]
        self._text(hold[:len(hold) - keep])
        return ""

    def _block_mode(self, s: str) -> str:
        for j, c in enumerate(s):
            self.block.append(c)
            text = "".join(self.block) if c in self._END_CHARS else None
            n = self.fmt.end(text) if text is not None else None
            if n is None:
                continue
            rest = text[n:] + s[j + 1:]
            self._read_block(text[:n])
            return rest
        return ""

    # the characters a block can end with (no format's block ends otherwise): `end` is only tried after them
    _END_CHARS = frozenset(">]")

    def _read_block(self, block: str) -> None:
        self.block = []
        calls = self.fmt.read(block, self.tools)
        if self.fmt.start_only:
            self.armed = False
        if calls is None:  # not calls of this format: content, byte for byte
            self.mode = "text"
            self._text(block)
            return
        self.mode = "trailer" if self.fmt.trailer else "text"
        for name, args in calls:
            if self._begin_call(name) is not None:
                self._args(compact(args))
            if not self._close_call():
                self.mode = "done"  # it repeated an earlier call: the rest is ignored
                return

    def _trailer_mode(self, s: str) -> str:
        """Right after a block: the format's trailer (if it comes, after whitespace) is dropped."""
        hold = self.hold + s
        body = hold.lstrip(WS)
        t = self.fmt.trailer
        if body.startswith(t):
            self.hold, self.mode = "", "text"
            return body[len(t):]
        if t.startswith(body):
            self.hold = hold
            return ""
        self.hold, self.mode = "", "text"
        return hold
