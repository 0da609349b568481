"""The ``deepseek_v3`` tool-call format (DeepSeek-V3 / R1-0528 and V3.1): the calls are one block anywhere in the
reply, between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>`` (the bars are U+FF5C, the low lines U+2581)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"location": "Tokyo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes each call without the type and the fence: ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location":
"Tokyo"}<｜tool▁call▁end｜>``; both are read. The arguments must be a JSON object; a block that is not such calls is
content.
"""
from __future__ import annotations

import json
import re

from .blocks import BlockFormat

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?:(\w+)" + re.escape(SEP) + r"([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```"
                   r"|([^\n]+?)" + re.escape(SEP) + r"(.*?))\s*" + re.escape(CALL_END), re.S)


def _end(block: str) -> int | None:
    return len(block) if block.endswith(CALLS_END) else None


def read(block: str, tools: dict | None) -> list[tuple[str, dict]] | None:
    """The calls of one block, or ``None`` when it is not calls of this format."""
    body = block[len(CALLS_BEGIN):-len(CALLS_END)]
    calls, pos = [], 0
    for m in _CALL.finditer(body):
        if body[pos:m.start()].strip():
            return None
        name, args = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        try:
            args = json.loads(args)
        except ValueError:
            return None
        if not isinstance(args, dict) or not name.strip():
            return None
        calls.append((name.strip(), args))
        pos = m.end()
    return calls if calls and not body[pos:].strip() else None


FORMAT = BlockFormat("deepseek_v3", (CALLS_BEGIN,), _end, read, template_marks=(CALLS_BEGIN,))
