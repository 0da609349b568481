"""The ``mistral`` tool-call parser (turbo/tool_parsers/mistral.py) on published examples (Mistral's function-calling
docs and vLLM's mistral parser tests), whole and streamed alike. The shared rules and the grammar are
tests/test_tools.py's."""
from __future__ import annotations

from tool_format_cases import check_published
from turbo.tool_parsers import parser_for_template

PUBLISHED = [
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"})], None),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}, {"name": "mul", "arguments": {"a": 2, "b": 5}}]',
     [("add", {"a": 3, "b": 4}), ("mul", {"a": 2, "b": 5})], None),
    ('[TOOL_CALLS] {"name": "one", "arguments": {}}', [("one", {})], None),
]


def test_published_examples_whole_and_streamed():
    check_published("mistral", PUBLISHED)


def test_chosen_from_the_template():
    assert parser_for_template("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
