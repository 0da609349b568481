"""Reasoning parsers: a thinking model's reply split into its reasoning (``reasoning_content``) and its answer
(``content``), whole or while it streams.

Two formats, as vLLM names them, both with ``<think>`` / ``</think>`` markers (``REASONING_PARSERS``):

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the chat template's generation prompt usually ends with
  ``<think>\\n``, so the reply starts inside the reasoning and ends it with ``</think>``;
- ``qwen3`` (Qwen3, QwQ): the reply itself opens ``<think>``, unless the template already did (thinking turned on)
  or closed an empty block (``enable_thinking=False``).

One rule reads both, from where the prompt left off (``prompt_open``: the rendered prompt's last ``<think>`` comes
after its last ``</think>``, :func:`prompt_opens_reasoning`): a reply that starts inside the reasoning, or that opens
it with ``<think>`` after leading whitespace, gives everything up to ``</think>`` as reasoning and the rest (leading
whitespace dropped) as content; a reasoning that never closes (cut by ``max_tokens``) is all reasoning and no
content; any other reply is all content. Markers are not part of either text. :meth:`ReasoningParser.split` runs the
streaming reader (:class:`ReasoningStreamer`) over the whole text, so streamed and whole replies always agree; the
streamer holds back text that may be the start of a marker until it is known.

It lives below the HTTP front and sessions (sessions drop past reasoning from the history they keep, as the
templates of these models do).
"""
from __future__ import annotations

from lite.formats import LiteturboError

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a reasoning block (its last ``<think>`` after its last ``</think>``)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def parser_for_template(template: str) -> str | None:
    """The reasoning format a chat template writes, or ``None`` when it does not think (no ``<think>`` in it): qwen3
    for a template with Qwen3's ``enable_thinking`` switch, else deepseek_r1. (Both are read by the same rule, from
    where the rendered prompt leaves off; the name is what is reported.)"""
    if OPEN not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"


class ReasoningParser:
    """A reasoning format (``name`` in :data:`REASONING_PARSERS`; an unknown one raises ``LiteturboError``)."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise LiteturboError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
        self.name = name

    def streamer(self, prompt_open: bool) -> "ReasoningStreamer":
        """A reader of one streamed reply (``prompt_open``: the prompt opened the reasoning block)."""
        return ReasoningStreamer(prompt_open)

    def split(self, text: str, prompt_open: bool) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole reply (``None`` for a part it does not have)."""
        s = self.streamer(prompt_open)
        deltas = s.feed(text) + s.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        return (reasoning if s.reasoned else None), (content if s.answered or not s.reasoned else None)


class ReasoningStreamer:
    """Reads a reply piece by piece: :meth:`feed` returns the deltas ready (``{"reasoning_content": str}`` or
    ``{"content": str}``), :meth:`finish` the rest. ``reasoned``: the reply had a reasoning block; ``answered``: text
    came after it."""

    def __init__(self, prompt_open: bool) -> None:
        self.mode = "think" if prompt_open else "start"  # start -> think -> gap -> answer, or start -> answer
        self.buf = ""
        self.reasoned = prompt_open
        self.answered = False

    def feed(self, piece: str) -> list[dict]:
        """The deltas that ``piece`` makes ready (text that may start a marker is held back)."""
        self.buf += piece
        out: list[dict] = []
        while True:
            if self.mode == "start":  # leading whitespace, then <think> or the answer
                head = self.buf.lstrip()
                if not head:
                    return out
                if head.startswith(OPEN):
                    self.buf, self.mode, self.reasoned = head[len(OPEN):], "think", True
                    continue
                if OPEN.startswith(head):
                    return out  # maybe the marker: wait
                self.mode = "answer"
                continue
            if self.mode == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    if i:
                        out.append({"reasoning_content": self.buf[:i]})
                    self.buf, self.mode = self.buf[i + len(CLOSE):], "gap"
                    continue
                keep = _partial_suffix(self.buf, CLOSE)
                if len(self.buf) > keep:
                    out.append({"reasoning_content": self.buf[:len(self.buf) - keep]})
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if self.mode == "gap":  # whitespace between </think> and the answer is dropped
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.mode = "answer"
                continue
            if self.buf:
                out.append({"content": self.buf})
                self.answered = True
                self.buf = ""
            return out

    def finish(self) -> list[dict]:
        """The deltas held back, at the end of the reply (a marker start that never completed is text)."""
        if not self.buf:
            return []
        text, self.buf = self.buf, ""
        if self.mode == "think":
            return [{"reasoning_content": text}]
        if self.mode == "gap":
            text = text.lstrip()
            if not text:
                return []
        self.answered = True
        return [{"content": text}]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
