"""The streaming reader of the formats whose calls are JSON objects ``{"name": ..., "arguments": {...}}`` after a
marker: hermes, llama3_json, mistral and granite (each a :class:`JsonFormat` in its own module). One character-level
scanner (:class:`~turbo.tool_parsers.json_object.CallObject` reads each call object) emits a call as soon as its
name and the start of its arguments are read, and holds it until its object closes (the rules:
:mod:`turbo.tool_parsers`).

- A marker (``JsonFormat.markers``) opens a block; with ``array`` a JSON array of calls may follow it (mistral,
  granite), else one object (hermes: closed by ``close``, ``</tool_call>``; llama3_json: objects separated by ``;``).
- ``start_only`` (llama3_json): a call block may only start the reply (after whitespace); ``{`` is itself a marker.
- In every format the arguments may be under ``"arguments"`` or ``"parameters"``; other keys of a call are ignored.
- A block that is not JSON of that shape (no name, a name that is not a string, arguments that are not an object, a
  syntax error anywhere in the object) stays content, marker included, byte for byte, and what follows the marker is
  read again as text.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .deltas import WS, DeltaWriter
from .json_object import CallObject


@dataclass(frozen=True)
class JsonFormat:
    """A JSON call format: ``name`` (the parser's), ``markers`` that open a call block, ``close`` (the tag after each
    call, or ``""``), ``array`` (a JSON array of calls may follow the marker), ``start_only`` (a block may only
    start the reply; ``{`` opens one too, calls separated by ``;``), ``template_marks`` (chat-template text that
    names this format, :func:`turbo.tool_parsers.parser_for_template`)."""

    name: str
    markers: tuple[str, ...]
    close: str = ""
    array: bool = False
    start_only: bool = False
    template_marks: tuple = ()  # strings, or tuples of strings that must all appear

    def streamer(self, max_calls: int | None = None, call_id_prefix: str | None = None,
                 tools: dict | None = None) -> "JsonCallStreamer":
        """A fresh reader of one reply (``tools`` is not needed: the arguments are JSON already)."""
        return JsonCallStreamer(self, max_calls, call_id_prefix)


class JsonCallStreamer(DeltaWriter):
    """Splits a reply into OpenAI chat deltas as it arrives: :meth:`feed` a text piece, get a list of deltas
    (``{"content": ...}`` and ``{"tool_calls": [...]}``); :meth:`finish` at the end of the reply for the rest.

    After :meth:`finish`, ``calls`` holds the calls (:class:`ToolCall`, each complete). ``repeated``: a call repeated
    an earlier one, and the rest was ignored."""

    def __init__(self, fmt: JsonFormat, max_calls: int | None = None, call_id_prefix: str | None = None) -> None:
        super().__init__(max_calls, call_id_prefix)
        self.fmt = fmt
        self.todo: deque[str] = deque()       # characters to read (a rejected block's text is read again)
        self.mode = "text"                    # text, open, object, after, skip, done
        self.armed = True                     # may a marker open a block here (start_only: only at the start)
        self.hold = ""                        # text that may be the start of a marker
        self.marker, self.raw = "", []        # the block's marker and its text so far (content if it is no call)
        self.head = ""                        # the marker that opened the block (kept after the call is read)
        self.array = False                    # the calls are in a JSON array
        self.obj: CallObject | None = None
        self.committed, self.sent, self.tail = False, 0, ""

    # --- input --------------------------------------------------------------------------------------------------

    def feed(self, piece: str) -> list[dict]:
        """The deltas that ``piece`` (the reply's next text) completes."""
        self.todo.extend(piece)
        self._drain()
        return self._take()

    def finish(self, cut: bool = False) -> list[dict]:
        """The deltas left at the end of the reply: held text, a block that never became a call. ``cut``: the reply
        was cut by ``max_tokens``, so an unfinished block (and a held partial marker) is dropped, not content."""
        while self.mode == "open" and self.marker or self.mode == "object":
            if self.committed and self.call is None:
                break  # a call over max_calls, dropped anyway
            if self.call is not None:
                self._drop_call()
            if cut:
                self.mode, self.marker, self.raw, self.obj, self.hold = "text", "", [], None, ""
                break
            self._reject()
            self._drain()
        if self.mode == "text":
            hold, self.hold = self.hold, ""
            if not cut:
                self._text(hold)
        self.mode = "done"
        return self._end()

    def _drain(self) -> None:
        while self.todo:
            c = self.todo.popleft()
            if self.mode == "done":  # after a repeated call: ignored
                self.todo.clear()
                return
            {"text": self._text_char, "open": self._open_char, "object": self._object_char,
             "after": self._after_char, "skip": self._skip_char}[self.mode](c)

    def _markers(self) -> tuple[str, ...]:
        if not self.armed:
            return ()
        return self.fmt.markers + (("{",) if self.fmt.start_only else ())

    def _text_char(self, c: str) -> None:
        hold, markers = self.hold + c, self._markers()
        for m in markers:
            if hold.endswith(m):
                self.hold = ""
                self._text(hold[:-len(m)])
                self.mode, self.marker, self.raw, self.array, self.head = "open", m, [m], False, m
                if m == "{":  # llama3_json: the call's own brace
                    self.marker, self.raw, self.head = "", [], ""
                    self._open_char(c)
                return
        keep = max((k for m in markers for k in range(1, min(len(hold), len(m) - 1) + 1)
                    if m.startswith(hold[-k:])), default=0)
        if self.fmt.start_only and hold[:len(hold) - keep].strip(WS):
            self.armed = False  # text came first: no llama3 call follows
        self.hold = hold[len(hold) - keep:]
        self._text(hold[:len(hold) - keep])

    def _open_char(self, c: str) -> None:
        """Between a marker (or a separator after a call) and a call's ``{``."""
        self.raw.append(c)
        if c in WS:
            return
        if c == "[" and self.fmt.array and not self.array and self.marker:
            self.array = True
            return
        if c != "{":
            return self._reject()
        self.obj, self.committed, self.call, self.sent = CallObject(), False, None, 0
        self.mode = "object"
        self.obj.feed(c)

    def _reject(self) -> None:
        """The block is no call: its marker is content, the rest is read again as text."""
        head = self.marker or self.head
        rest = "".join(self.raw)[len(head):]
        self.mode, self.marker, self.raw, self.obj, self.head, self.committed = "text", "", [], None, "", False
        if self.fmt.start_only:
            self.armed = False
        self._text(head)
        self.todo.extendleft(reversed(rest))

    def _object_char(self, c: str) -> None:
        self.raw.append(c)
        obj = self.obj
        obj.feed(c)
        if obj.state == "bad":
            if self.committed and self.call is None:  # a call over max_calls: dropped anyway
                self.mode, self.tail = "skip", c
                return
            if self.call is not None:
                self._drop_call()
            return self._reject()
        if not self.committed and obj.name is not None and (obj.has_args or obj.state == "done"):
            self._commit()
        if self.call is not None and len(obj.args) > self.sent:
            self._args("".join(obj.args[self.sent:]))
            self.sent = len(obj.args)
        if obj.state == "done":
            if not self.committed:
                return self._reject()
            self.mode, self.tail, self.raw, self.marker, self.head = "after", "", [], "", ""
            if self.call is not None and not self._close_call():
                self.mode = "done"  # it repeated an earlier call: the rest is ignored
            self.call, self.committed = None, False

    def _commit(self) -> None:
        obj = self.obj
        self.committed, self.marker = True, ""
        if not obj.has_args:
            obj.args.append("{}")
        self._begin_call(obj.name)

    def _after_char(self, c: str) -> None:
        """After a call's object: its closing tag (hermes), a separator and the next call, or text again."""
        if c in WS and not self.tail:
            return  # whitespace after a call: dropped (the content after a call is stripped anyway)
        self.tail += c
        if self.fmt.close and self.fmt.close.startswith(self.tail):
            if self.tail == self.fmt.close:
                self.mode, self.tail = "text", ""
            return
        if len(self.tail) == 1 and (self.array and c in ",]" or self.fmt.start_only and c in ";{"):
            self.mode, self.raw, self.tail = ("text" if c == "]" else "open"), ([] if c in "]{" else [c]), ""
            return self._open_char(c) if c == "{" else None
        self.armed = not self.fmt.start_only
        self.mode, tail, self.tail = "text", self.tail, ""
        self.todo.extendleft(reversed(tail))

    def _skip_char(self, c: str) -> None:
        """A broken call's rest: dropped (with a closing tag: up to it)."""
        if self.fmt.close:
            self.tail = (self.tail + c)[-len(self.fmt.close):]
            if self.tail == self.fmt.close:
                self.mode, self.tail = "text", ""
