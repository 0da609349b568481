"""The ``granite`` tool-call format (IBM Granite 3.0 / 3.1 instruct): ``<|tool_call|>`` (3.0, a special token) or
``<tool_call>`` (3.1, text) then a JSON array of ``{"name": ..., "arguments": {...}}`` objects; no closing tag.

Published example (vLLM's ``tests/entrypoints/openai/tool_parsers/test_granite_tool_parser.py``)::

    <|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]

Unlike vLLM's parser, a bare JSON array with no marker is not read as calls, and text before the marker is kept as
content (vLLM reads such a reply as no calls).
"""
from .json_calls import JsonFormat

# Granite 3.0 writes the special token, 3.1 the string; Phi-4-mini's template has <|tool_call|> too, so the template
# must also use Granite's role tokens
FORMAT = JsonFormat("granite", ("<|tool_call|>", "<tool_call>"), array=True,
                    template_marks=(("<|tool_call|>", "<|start_of_role|>"),))
