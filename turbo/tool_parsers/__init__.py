"""Tool-call parsers: a model's reply text split into content and OpenAI tool calls, whole or while it streams.

Used by the HTTP front (:mod:`turbo.serve.tools`, :mod:`turbo.serve.responses`) and by sessions
(:mod:`turbo.session` keeps a reply's calls as a structured assistant turn), so it lives below both.

The formats, one module each, as vLLM names them (:data:`FORMATS`, the registry; :data:`PARSERS` their names):

- JSON call objects after a marker, read as they stream (:mod:`~turbo.tool_parsers.json_calls`): ``hermes``
  (``<tool_call>{...}</tool_call>``), ``llama3_json`` (the reply starts with ``{"name", "parameters"}``), ``mistral``
  (``[TOOL_CALLS]`` + a JSON array), ``granite`` (``<|tool_call|>`` + a JSON array);
- blocks read whole (:mod:`~turbo.tool_parsers.blocks`): ``qwen3_xml`` (Qwen3-Coder's
  ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``, values typed by the tool's
  schema), ``pythonic`` (Llama 3.2 / 4: the reply is a Python list of calls ``[f(a=1), g(b="x")]``), ``deepseek_v3``
  (``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>``).

:func:`parser_for_template` picks the format a chat template writes. One streaming reader per format is the only
parser: :meth:`ToolParser.parse` runs it over the whole text and joins its deltas (as the openai client joins a
stream), so a streamed reply and the same reply unstreamed always agree. The rules every format follows:

- Text outside calls is content. Text that may be the start of a call marker is held back until it is known.
- A call goes out (a delta with the call's index, id (``call_`` + 24 hex digits), name and ``"arguments": ""``, then
  its arguments) only once it is complete: a JSON format's call as soon as its name and the start of its arguments
  are read, held until its object closes; a block format's calls when the block closes. A block that is not calls
  of the format stays content, byte for byte.
- **No half call**: a reply never carries a call that did not complete. At the end of a reply cut by ``max_tokens``
  (``finish(cut=True)``) the unfinished block is dropped whole: no call, no marker or partial marker in the
  content; the complete calls before it are kept (the finish reason stays ``length``; in a block format the unit
  is the block: a pythonic list or a deepseek_v3 block cut before it closes loses all its calls). A reply that ends
  otherwise inside a block (end of sequence, a stop string) gives that block as content, byte for byte.
- Arguments are written compactly: the text equals ``json.dumps(args, separators=(",", ":"), ensure_ascii=False)``
  (JSON formats: except that a key given twice is kept twice, a lone UTF-16 surrogate stays ``\\uXXXX`` and a number
  too large for a float stays as written).
- Content around calls: a reply without calls keeps its text exactly. With calls, the text before the first call
  loses its trailing whitespace, every later piece is stripped, empty pieces are dropped, and the pieces are joined
  by ``"\\n"``; the content is ``None`` when nothing is left.
- ``max_calls`` (1 when the request says ``parallel_tool_calls: false``) keeps the first calls; later calls are
  read and dropped, text and all.
- A call identical to an earlier one of the reply (same name, same arguments) ends the reply: it and everything
  after it are dropped and the streamer's ``repeated`` turns true (the server then stops the generation: a small
  model asked for "one or more" calls can repeat its call until ``max_tokens``).
"""
from __future__ import annotations

from lite.formats import LiteturboError

from . import deepseek_v3, granite, hermes, llama3_json, mistral, pythonic, qwen3_xml
from .call import ToolCall, new_call_id, new_call_id_prefix
from .deltas import DeltaWriter

__all__ = ["FORMATS", "PARSERS", "ToolCall", "ToolParser", "ToolStreamer", "new_call_id", "new_call_id_prefix",
           "parser_for_template", "reading"]

# the registry, in the order chat templates are matched (the more specific marks first: Qwen3-Coder's template
# also writes <tool_call>)
FORMATS = {f.name: f for f in (qwen3_xml.FORMAT, deepseek_v3.FORMAT, granite.FORMAT, pythonic.FORMAT,
                               hermes.FORMAT, mistral.FORMAT, llama3_json.FORMAT)}
PARSERS = tuple(sorted(FORMATS, key=("hermes", "llama3_json", "mistral", "granite", "qwen3_xml", "pythonic",
                                     "deepseek_v3").index))
ToolStreamer = DeltaWriter  # what every format's streamer is (feed, finish, calls, repeated)


def parser_for_template(template: str) -> str:
    """The format a chat template's text writes calls in (the first of :data:`FORMATS` with a ``template_marks``
    entry it contains: a string, or a tuple of strings that must all appear), else hermes (what the fallback prompt
    of templates without tools asks for)."""
    def has(mark) -> bool:
        return all(m in template for m in ((mark,) if isinstance(mark, str) else mark))
    return next((f.name for f in FORMATS.values() if any(has(m) for m in f.template_marks)), "hermes")


def reading(parser: str, max_calls: int | None = None, call_id_prefix: str | None = None) -> dict:
    """How a session turn's reply is read for calls, as plain data (it crosses to the engine process):
    ``{"parser", "max_calls", "call_id_prefix"}``. Unknown ``parser``: LiteturboError."""
    ToolParser(parser)
    return {"parser": parser, "max_calls": max_calls, "call_id_prefix": call_id_prefix or new_call_id_prefix()}


class ToolParser:
    """One format's parser: :meth:`parse` a whole reply, or read one as it streams with :meth:`streamer`. Unknown
    ``name``: LiteturboError listing :data:`PARSERS`."""

    def __init__(self, name: str) -> None:
        if name not in FORMATS:
            raise LiteturboError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
        self.name, self.format = name, FORMATS[name]

    def streamer(self, max_calls: int | None = None, call_id_prefix: str | None = None,
                 tools: dict | None = None) -> DeltaWriter:
        """A fresh streamer for one reply: ``feed(piece)`` → deltas, ``finish(cut=False)`` → the last deltas; then
        ``calls`` and ``repeated``. ``max_calls``: keep only the first calls; ``call_id_prefix``: ids from
        :func:`new_call_id_prefix`'s rule instead of random ones; ``tools``: ``{name: parameters schema}`` of the
        request (qwen3_xml types its parameter values by it; strings without it)."""
        return self.format.streamer(max_calls, call_id_prefix, tools)

    def parse(self, text: str, max_calls: int | None = None, cut: bool = False, call_id_prefix: str | None = None,
              tools: dict | None = None) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole reply: exactly what joining :meth:`streamer`'s deltas gives; content is
        ``None`` when there are calls and no other text. ``cut``: the reply was cut by ``max_tokens``."""
        s = self.streamer(max_calls, call_id_prefix, tools)
        content = "".join(d.get("content", "") for d in s.feed(text) + s.finish(cut))
        return (content if content or not s.calls else None), s.calls
