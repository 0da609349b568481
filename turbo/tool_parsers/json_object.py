"""The JSON scanner under the tool-call parsers (:mod:`turbo.tool_parsers`): one call object read character by
character as it streams, re-written compactly (``json.dumps(..., separators=(",", ":"), ensure_ascii=False)``), with
the call's ``name`` and its arguments' text picked out. Pure Python, no state beyond one object.
"""
from __future__ import annotations

import json
import re

ARGS_KEYS = ("arguments", "parameters")
WS = " \t\n\r"
_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_UNESCAPE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


def _canon(c: str) -> str:
    """One decoded string character as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    if c in _SHORT:
        return _SHORT[c]
    if c < " " or "\ud800" <= c <= "\udfff":  # a lone surrogate stays escaped, so the text stays valid UTF-8
        return "\\u%04x" % ord(c)
    return c


class CallObject:
    """Scans one JSON object character by character (fed from its ``{``), re-writing it compactly, and keeps what a
    call needs: ``name`` (decoded, once its string closed) and the arguments' compact text in ``args`` (pieces).

    ``state``: "open", "done" (the object closed) or "bad" (``why`` says what broke)."""

    def __init__(self) -> None:
        self.stack: list[str] = []        # the open containers, "{" or "["
        self.expect = "value"             # value, value|end, key, key|end, colon, comma|end
        self.tok, self.buf = None, ""     # a string / number / literal being read
        self.esc: str | None = None       # an escape after its backslash
        self.high: int | None = None      # a high surrogate escape waiting for its low half
        self.in_key, self.is_key, self.key, self.key_raw = False, False, None, []  # a key; a call's own key
        self.role: str | None = None      # what the top-level value being read is: "name", "args" or None
        self.name_raw: list[str] = []
        self.name: str | None = None
        self.args: list[str] = []
        self.has_args = False
        self.state, self.why = "open", ""

    def bad(self, why: str) -> None:
        self.state, self.why = "bad", why

    def _put(self, s: str) -> None:
        if self.is_key:
            self.key_raw.append(s)
        elif self.role == "args":
            self.args.append(s)
        elif self.role == "name":
            self.name_raw.append(s)

    def feed(self, c: str) -> None:
        """One character; call only while ``state == "open"``."""
        if self.tok == "str":
            return self._str_char(c)
        if self.tok == "lit":
            return self._lit_char(c)
        if self.tok == "num":
            if c in "0123456789+-.eE":
                self.buf += c
                return
            self._end_number()
            if self.state != "open":
                return
        if c in WS:
            return
        self._structure(c)

    def _structure(self, c: str) -> None:
        e = self.expect
        if e in ("value", "value|end"):
            return self._close(c) if c == "]" and e == "value|end" else self._value(c)
        if e in ("key", "key|end"):
            if c == "}" and e == "key|end":
                return self._close(c)
            if c != '"':
                return self.bad(f"expected a key string, got {c!r}")
            self.tok, self.in_key, self.is_key, self.key_raw = "str", True, len(self.stack) == 1, []
            return self._put('"')
        if e == "colon":
            if c != ":":
                return self.bad(f"expected ':', got {c!r}")
            self.expect = "value"
            return self._put(":")
        if c == ",":
            self.expect = "key" if self.stack[-1] == "{" else "value"
            return self._put(",")
        if c in "}]":
            return self._close(c)
        self.bad(f"expected ',' or a closing bracket, got {c!r}")

    def _value(self, c: str) -> None:
        if not self.stack:
            if c != "{":
                return self.bad("a call must be a JSON object")
        elif len(self.stack) == 1 and self.stack[0] == "{":  # a value of the call object: what is it?
            if self.key == "name" and self.name is None and not self.name_raw:
                if c != '"':
                    return self.bad("'name' is not a string")
                self.role = "name"
            elif self.key in ARGS_KEYS and not self.has_args:
                if c != "{":
                    return self.bad(f"'{self.key}' is not a JSON object")
                self.role, self.has_args = "args", True
        if c in "{[":
            self.stack.append(c)
            self.expect = "key|end" if c == "{" else "value|end"
            self._put(c)
        elif c == '"':
            self.tok = "str"
            self._put(c)
        elif c == "-" or c.isdigit():
            self.tok, self.buf = "num", c
        elif c in _LITERALS:
            self.tok, self.buf = "lit", c
        else:
            self.bad(f"{c!r} cannot start a JSON value")

    def _close(self, c: str) -> None:
        if (c == "}") != (self.stack[-1] == "{"):
            return self.bad(f"{c!r} does not close {self.stack[-1]!r}")
        self._put(c)
        self.stack.pop()
        self._end_value()

    def _end_value(self) -> None:
        if not self.stack:
            self.state = "done"
            return
        self.expect = "comma|end"
        if len(self.stack) == 1 and self.role is not None:
            if self.role == "name":
                self.name = json.loads("".join(self.name_raw))
            self.role = None

    def _str_char(self, c: str) -> None:
        if self.esc is not None:
            self.esc += c
            return self._escape()
        if c == "\\":
            self.esc = ""
        elif c < " ":
            self.bad("a raw control character inside a JSON string")
        else:
            self._flush_high()
            self._put(_canon(c) if c != '"' else c)
            if c == '"':
                self._end_string()

    def _end_string(self) -> None:
        self.tok = None
        if self.in_key:
            if self.is_key:
                self.key, self.is_key = json.loads("".join(self.key_raw)), False
            self.in_key, self.expect = False, "colon"
        else:
            self._end_value()

    def _escape(self) -> None:
        e = self.esc
        if e[0] != "u":
            if e[0] not in _UNESCAPE:
                return self.bad(f"the escape \\{e[0]} is not JSON")
            self.esc = None
            self._flush_high()
            return self._put(_canon(_UNESCAPE[e[0]]))
        if e[-1] not in "0123456789abcdefABCDEF" and len(e) > 1:
            return self.bad(f"the escape \\{e} is not JSON")
        if len(e) < 5:
            return
        cp, self.esc = int(e[1:], 16), None
        if 0xD800 <= cp < 0xDC00:
            self._flush_high()
            self.high = cp
        elif 0xDC00 <= cp < 0xE000 and self.high is not None:
            self._put(chr(0x10000 + ((self.high - 0xD800) << 10) + (cp - 0xDC00)))
            self.high = None
        else:
            self._flush_high()
            self._put(_canon(chr(cp)))

    def _flush_high(self) -> None:
        if self.high is not None:
            self._put("\\u%04x" % self.high)
            self.high = None

    def _lit_char(self, c: str) -> None:
        word = _LITERALS[self.buf[0]]
        if c != word[len(self.buf)]:
            return self.bad(f"{self.buf + c!r} is not a JSON value")
        self.buf += c
        if self.buf == word:
            self._put(word)
            self.tok = None
            self._end_value()

    def _end_number(self) -> None:
        s, self.tok = self.buf, None
        if not _NUMBER.match(s):
            return self.bad(f"{s!r} is not a JSON number")
        try:
            v = int(s) if not any(x in s for x in ".eE") else float(s)
        except ValueError:  # more digits than Python reads
            return self.bad(f"the number {s[:20]}... is too long")
        self._put(s if v in (float("inf"), float("-inf")) else repr(v))
        self._end_value()
