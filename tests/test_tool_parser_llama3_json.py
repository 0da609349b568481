"""The ``llama3_json`` tool-call parser (turbo/tool_parsers/llama3_json.py) on published examples (Meta's Llama 3.1
/ 3.2 prompt-format docs: JSON based tool calling), whole and streamed alike. The shared rules and the grammar are
tests/test_tools.py's."""
from __future__ import annotations

from tool_format_cases import check_published
from turbo.tool_parsers import parser_for_template

PUBLISHED = [
    ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
     [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})], None),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})],
     None),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', [("a", {"x": 1}), ("b", {})], None),
    ('The answer is {"name": "a", "parameters": {}}', [], 'The answer is {"name": "a", "parameters": {}}'),
]


def test_published_examples_whole_and_streamed():
    check_published("llama3_json", PUBLISHED)


def test_chosen_from_the_template():
    assert parser_for_template("{{- '<|python_tag|>' + tool_call.name }} Environment: ipython") == "llama3_json"
