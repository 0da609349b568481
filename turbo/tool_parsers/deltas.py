"""The output side of every tool-call streamer: content and calls as OpenAI chat deltas, under the rules all formats
share (the package docstring, :mod:`turbo.tool_parsers`, states them): content whitespace around calls, a call held
until it is complete, ``max_calls``, a repeated call ending the reply.

A format's streamer (:class:`~turbo.tool_parsers.json_calls.JsonCallStreamer`,
:class:`~turbo.tool_parsers.blocks.BlockStreamer`) reads characters and calls :meth:`DeltaWriter._text` for content,
:meth:`DeltaWriter._begin_call` / :meth:`DeltaWriter._args` / :meth:`DeltaWriter._close_call` for a call (or
:meth:`DeltaWriter._drop_call` when it never completes); :meth:`DeltaWriter._take` hands out what may go out now.
"""
from __future__ import annotations

from .call import ToolCall

WS = " \t\n\r"


class DeltaWriter:
    """Deltas of one reply (``{"content": ...}`` and ``{"tool_calls": [...]}``), built as a streamer reads it.

    ``calls``: the calls read (:class:`ToolCall`; arguments complete after the streamer's ``finish``);
    ``repeated``: a call repeated an earlier one and the rest of the reply was ignored."""

    def __init__(self, max_calls: int | None = None, call_id_prefix: str | None = None) -> None:
        self.max_calls, self.call_id_prefix = max_calls, call_id_prefix
        self.out: list[list] = []             # deltas to give: ["c", None, parts], ["a", index, parts], ["h", delta]
        self.calls: list[ToolCall] = []
        self.parts: list[list[str]] = []      # each call's argument text
        self.n_calls = 0                      # calls read, dropped ones (over max_calls) included
        self.call: ToolCall | None = None     # the announced call being read (None: not yet, or a dropped one)
        self.ws, self.seg_started, self.said = [], False, False  # content: held whitespace; piece begun; any
        self.held_from: int | None = None     # the open call's first entry in `out`: held until it completes
        self.repeated = False

    def _content(self, s: str) -> None:
        self.said = True
        if self.out and self.out[-1][0] == "c":
            self.out[-1][2].append(s)
        else:
            self.out.append(["c", None, [s]])

    def _text(self, s: str) -> None:
        """Content text, under the whitespace rules: a reply without calls keeps its text exactly; with calls, the
        text before the first call loses its trailing whitespace, later pieces are stripped and joined by ``\\n``."""
        if self.n_calls and not self.seg_started:
            s = s.lstrip(WS)
        body = s.rstrip(WS)
        if not body:
            self.ws.append(s)
            return
        lead = "\n" if self.n_calls and not self.seg_started and self.said else ""
        self._content(lead + "".join(self.ws) + body)
        self.ws, self.seg_started = [s[len(body):]], True

    def _begin_call(self, name: str) -> ToolCall | None:
        """A call named ``name`` begins: it counts, the content piece before it ends, and (within ``max_calls``) it
        is announced (index, id, name, ``"arguments": ""``), held until :meth:`_close_call`. Returns the call, or
        ``None`` when it is over ``max_calls`` (read and dropped)."""
        self.n_calls += 1
        self.ws, self.seg_started = [], False
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self.call = None
            return None
        self.call = ToolCall(name, "") if self.call_id_prefix is None else \
            ToolCall(name, "", f"call_{self.call_id_prefix}{len(self.calls):08x}")
        self.held_from = len(self.out)
        self.calls.append(self.call)
        self.parts.append([])
        self.out.append(["h", {"tool_calls": [{"index": len(self.calls) - 1, "id": self.call.id, "type": "function",
                                               "function": {"name": name, "arguments": ""}}]}])
        return self.call

    def _args(self, s: str) -> None:
        """More of the open call's arguments text."""
        i = len(self.calls) - 1
        self.parts[i].append(s)
        if self.out and self.out[-1][0] == "a" and self.out[-1][1] == i:
            self.out[-1][2].append(s)
        else:
            self.out.append(["a", i, [s]])

    def _close_call(self) -> bool:
        """The open call is complete: release its deltas, or, when it repeats an earlier call of the reply, drop it
        and set ``repeated`` (the streamer then ignores the rest). Returns whether it was kept."""
        kept = True
        if self.call is not None:
            i = len(self.calls) - 1
            args = "".join(self.parts[i])
            if any(c.name == self.call.name and "".join(p) == args for c, p in zip(self.calls[:i], self.parts)):
                del self.out[self.held_from:], self.calls[i], self.parts[i]
                self.repeated, kept = True, False
        self.call, self.held_from = None, None
        return kept

    def _drop_call(self) -> None:
        """The open call never completed (its text broke, or the reply ended): it and its held deltas are gone."""
        if self.call is not None:
            del self.out[self.held_from:], self.calls[-1], self.parts[-1]
        self.call, self.held_from, self.n_calls = None, None, self.n_calls - 1

    def _take(self) -> list[dict]:
        """The deltas that may go out now (an open call's are held)."""
        cut = len(self.out) if self.held_from is None else self.held_from
        out, self.out = self.out[:cut], self.out[cut:]
        if self.held_from is not None:
            self.held_from = 0
        return [d if kind == "h" else {"content": "".join(d)} if kind == "c" else
                {"tool_calls": [{"index": i, "function": {"arguments": "".join(d)}}]} for kind, i, d in
                ((x[0], x[1], x[-1]) for x in out)]

    def _end(self) -> list[dict]:
        """The reply ended (its open call already dropped or closed): trailing whitespace of a reply without calls,
        the calls' arguments joined, the last deltas."""
        if not self.n_calls and "".join(self.ws):
            self._content("".join(self.ws))
        self.ws = []
        for call, parts in zip(self.calls, self.parts):
            call.arguments = "".join(parts)
        return self._take()
