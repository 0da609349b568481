"""Tool-call parsers: a model's reply text split into content and OpenAI tool calls, whole or while it streams.

Used by the HTTP front (:mod:`turbo.serve.tools`, :mod:`turbo.serve.responses`) and by sessions
(:mod:`turbo.session` keeps a reply's calls as a structured assistant turn), so it lives below both.

Three formats (``PARSERS``), as vLLM names them:

- ``hermes`` (Hermes / Qwen, and what :mod:`turbo.serve.tools`' fallback prompt asks for): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the reply;
- ``llama3_json`` (Llama 3.x JSON tool calling): the reply *starts* (after whitespace, optionally after
  ``<|python_tag|>``) with ``{"name": ..., "parameters": {...}}``; several calls are separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects (or one object).

In every format the arguments may be under ``"arguments"`` or ``"parameters"``; other keys of a call are ignored.

One streaming scanner is the only parser: :meth:`ToolParser.parse` runs it over the whole text and joins its deltas
(as the openai client joins a stream), so a streamed reply and the same reply unstreamed always agree. The rules:

- Text outside calls is content. Text that may be the start of a call marker is held back until it is known.
- A call is read once its ``name`` (a JSON string) is read and its arguments have begun with ``{`` (or its object
  closed without arguments: then they are ``{}``), and it counts once its object closes. Only then does it go out:
  first a delta with the call's index, id (``call_`` + 24 hex digits), name and ``"arguments": ""``, then its
  arguments in one piece. A block that is not JSON of that shape (no name, a name that is not a string, arguments
  that are not an object, a syntax error anywhere in the object) stays content, marker included, byte for byte.
- **No half call**: a reply never carries a call whose JSON did not close. At the end of a reply cut by
  ``max_tokens`` (``finish(cut=True)``) the unfinished block is dropped whole: no call, no marker or partial
  marker in the content; the complete calls before it are kept (the finish reason stays ``length``). A reply that
  ends otherwise inside a block (end of sequence, a stop string) gives that block as content, byte for byte.
- Arguments are re-written compactly: the text equals ``json.dumps(json.loads(args), separators=(",", ":"),
  ensure_ascii=False)`` (except that a key given twice is kept twice, a lone UTF-16 surrogate stays ``\\uXXXX``
  and a number too large for a float stays as written).
- Content around calls: a reply without calls keeps its text exactly. With calls, the text before the first call
  loses its trailing whitespace, every later piece is stripped, empty pieces are dropped, and the pieces are joined
  by ``"\\n"``; the content is ``None`` when nothing is left.
- ``max_calls`` (1 when the request says ``parallel_tool_calls: false``) keeps the first calls; later calls are
  read and dropped, text and all.
- A call identical to an earlier one of the reply (same name, same arguments) ends the reply: it and everything
  after it are dropped and :attr:`ToolStreamer.repeated` turns true (the server then stops the generation: a small
  model asked for "one or more" calls can repeat its call until ``max_tokens``).
"""
from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field

from lite.formats import LiteturboError

PARSERS = ("hermes", "llama3_json", "mistral")
from .tool_json import WS, CallObject


# the chat template text that tells which format a model was trained on
_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))


def parser_for_template(template: str) -> str:
    """The format a chat template's text writes calls in (``<tool_call>`` → hermes, ``[TOOL_CALLS]`` → mistral,
    ``<|python_tag|>`` → llama3_json), else hermes (what the fallback prompt of templates without tools asks for)."""
    return next((name for mark, name in _TEMPLATE_MARKS if mark in template), "hermes")


def new_call_id() -> str:
    """A tool call id as OpenAI's look: ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def new_call_id_prefix() -> str:
    """A reply's call-id prefix (16 hex digits): its calls get ``call_`` + prefix + the call's index in 8 hex digits,
    so two readers of the same reply (the HTTP front and the session that keeps it) give the same ids."""
    return uuid.uuid4().hex[:16]


def reading(parser: str, max_calls: int | None = None, call_id_prefix: str | None = None) -> dict:
    """How a session turn's reply is read for calls, as plain data (it crosses to the engine process):
    ``{"parser", "max_calls", "call_id_prefix"}``. Unknown ``parser``: LiteturboError."""
    ToolParser(parser)
    return {"parser": parser, "max_calls": max_calls, "call_id_prefix": call_id_prefix or new_call_id_prefix()}


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON text (compact; see the module docs)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        """The call in a chat completion message's ``tool_calls`` list."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolStreamer:
    """Splits a reply into OpenAI chat deltas as it arrives: :meth:`feed` a text piece, get a list of deltas
    (``{"content": ...}`` and ``{"tool_calls": [...]}``); :meth:`finish` at the end of the reply for the rest.

    After :meth:`finish`, ``calls`` holds the calls (:class:`ToolCall`, each complete). ``repeated``: a call repeated
    an earlier one, and the rest was ignored."""

    def __init__(self, fmt: str, max_calls: int | None = None, call_id_prefix: str | None = None) -> None:
        self.fmt, self.max_calls, self.call_id_prefix = fmt, max_calls, call_id_prefix
        self.out: list[list] = []             # deltas to give: ["c", None, parts], ["a", index, parts], ["h", delta]
        self.calls: list[ToolCall] = []
        self.parts: list[list[str]] = []      # each call's argument text
        self.n_calls = 0                      # calls read, dropped ones (over max_calls) included
        self.todo: deque[str] = deque()       # characters to read (a rejected block's text is read again)
        self.mode = "text"                    # text, open, object, after, skip
        self.armed = True                     # may a marker open a block here (llama3_json: only at the start)
        self.hold = ""                        # text that may be the start of a marker
        self.marker, self.raw = "", []        # the block's marker and its text so far (content if it is no call)
        self.head = ""                        # the marker that opened the block (kept after the call is read)
        self.array = False                    # mistral: the calls are in a JSON array
        self.obj: CallObject | None = None
        self.call: ToolCall | None = None     # the announced call being read (None: not yet, or a dropped one)
        self.committed, self.sent, self.tail = False, 0, ""
        self.ws, self.seg_started, self.said = [], False, False  # content: held whitespace; piece begun; any
        self.held_from: int | None = None     # the open call's first entry in `out`: held until its object closes
        self.repeated = False

    # --- output -------------------------------------------------------------------------------------------------

    def _content(self, s: str) -> None:
        self.said = True
        if self.out and self.out[-1][0] == "c":
            self.out[-1][2].append(s)
        else:
            self.out.append(["c", None, [s]])

    def _text(self, s: str) -> None:
        """Content text, under the whitespace rules of the module docs."""
        if self.n_calls and not self.seg_started:
            s = s.lstrip(WS)
        body = s.rstrip(WS)
        if not body:
            self.ws.append(s)
            return
        lead = "\n" if self.n_calls and not self.seg_started and self.said else ""
        self._content(lead + "".join(self.ws) + body)
        self.ws, self.seg_started = [s[len(body):]], True

    def _args(self, s: str) -> None:
        i = len(self.calls) - 1
        self.parts[i].append(s)
        if self.out and self.out[-1][0] == "a" and self.out[-1][1] == i:
            self.out[-1][2].append(s)
        else:
            self.out.append(["a", i, [s]])

    def _take(self) -> list[dict]:
        cut = len(self.out) if self.held_from is None else self.held_from
        out, self.out = self.out[:cut], self.out[cut:]
        if self.held_from is not None:
            self.held_from = 0
        return [d if kind == "h" else {"content": "".join(d)} if kind == "c" else
                {"tool_calls": [{"index": i, "function": {"arguments": "".join(d)}}]} for kind, i, d in
                ((x[0], x[1], x[-1]) for x in out)]

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
        if not self.n_calls and "".join(self.ws):
            self._content("".join(self.ws))
        self.ws, self.mode = [], "done"
        for call, parts in zip(self.calls, self.parts):
            call.arguments = "".join(parts)
        return self._take()

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
        return {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                "llama3_json": ("<|python_tag|>", "{")}[self.fmt]

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
        if self.fmt == "llama3_json" and hold[:len(hold) - keep].strip(WS):
            self.armed = False  # text came first: no llama3 call follows
        self.hold = hold[len(hold) - keep:]
        self._text(hold[:len(hold) - keep])

    def _open_char(self, c: str) -> None:
        """Between a marker (or a separator after a call) and a call's ``{``."""
        self.raw.append(c)
        if c in WS:
            return
        if c == "[" and self.fmt == "mistral" and not self.array and self.marker:
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
        if self.fmt == "llama3_json":
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
            if self.call is not None:
                self._close_call()
            self.call, self.committed = None, False

    def _close_call(self) -> None:
        """The open call's object closed: release its deltas, or end the reply if it repeats an earlier call."""
        i = len(self.calls) - 1
        args = "".join(self.parts[i])
        if any(c.name == self.call.name and "".join(p) == args for c, p in zip(self.calls[:i], self.parts)):
            del self.out[self.held_from:], self.calls[i], self.parts[i]
            self.call, self.repeated, self.mode = None, True, "done"
        self.held_from = None

    def _drop_call(self) -> None:
        """The open call never closed (its JSON broke, or the reply ended): it and its held deltas are gone."""
        del self.out[self.held_from:], self.calls[-1], self.parts[-1]
        self.call, self.held_from, self.n_calls = None, None, self.n_calls - 1

    def _commit(self) -> None:
        obj = self.obj
        self.committed, self.n_calls, self.marker = True, self.n_calls + 1, ""
        self.ws, self.seg_started = [], False
        if not obj.has_args:
            obj.args.append("{}")
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return  # over max_calls: read and dropped
        self.call = ToolCall(obj.name, "") if self.call_id_prefix is None else \
            ToolCall(obj.name, "", f"call_{self.call_id_prefix}{len(self.calls):08x}")
        self.held_from = len(self.out)  # its deltas go out when its object closes
        self.calls.append(self.call)
        self.parts.append([])
        self.out.append(["h", {"tool_calls": [{"index": len(self.calls) - 1, "id": self.call.id, "type": "function",
                                               "function": {"name": self.call.name, "arguments": ""}}]}])

    def _after_char(self, c: str) -> None:
        """After a call's object: its closing tag (hermes), a separator and the next call, or text again."""
        if c in WS and not self.tail:
            return  # whitespace after a call: dropped (the content after a call is stripped anyway)
        self.tail += c
        if self.fmt == "hermes" and "</tool_call>".startswith(self.tail):
            if self.tail == "</tool_call>":
                self.mode, self.tail = "text", ""
            return
        if len(self.tail) == 1 and (self.fmt == "mistral" and self.array and c in ",]" or
                                    self.fmt == "llama3_json" and c in ";{"):
            self.mode, self.raw, self.tail = ("text" if c == "]" else "open"), ([] if c in "]{" else [c]), ""
            return self._open_char(c) if c == "{" else None
        self.armed = self.fmt != "llama3_json"
        self.mode, tail, self.tail = "text", self.tail, ""
        self.todo.extendleft(reversed(tail))

    def _skip_char(self, c: str) -> None:
        """A broken call's rest: dropped (hermes: up to its closing tag)."""
        if self.fmt == "hermes":
            self.tail = (self.tail + c)[-len("</tool_call>"):]
            if self.tail == "</tool_call>":
                self.mode, self.tail = "text", ""


class ToolParser:
    """One format's parser: :meth:`parse` a whole reply, or read one as it streams with :meth:`streamer`."""

    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise LiteturboError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
        self.name = name

    def streamer(self, max_calls: int | None = None, call_id_prefix: str | None = None) -> ToolStreamer:
        """A fresh :class:`ToolStreamer` for one reply (``max_calls``: keep only the first calls;
        ``call_id_prefix``: ids from :func:`new_call_id_prefix`'s rule instead of random ones)."""
        return ToolStreamer(self.name, max_calls, call_id_prefix)

    def parse(self, text: str, max_calls: int | None = None, cut: bool = False,
              call_id_prefix: str | None = None) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole reply: exactly what joining :meth:`streamer`'s deltas gives; content is
        ``None`` when there are calls and no other text. ``cut``: the reply was cut by ``max_tokens``
        (:meth:`ToolStreamer.finish`)."""
        s = self.streamer(max_calls, call_id_prefix)
        content = "".join(d.get("content", "") for d in s.feed(text) + s.finish(cut))
        return (content if content or not s.calls else None), s.calls

