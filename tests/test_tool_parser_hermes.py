"""The ``hermes`` tool-call parser (turbo/tool_parsers/hermes.py) on published examples (NousResearch's
Hermes-Function-Calling README; Qwen2.5's function-calling docs), whole and streamed alike. The shared rules, the
grammar and the tricky arguments are tests/test_tools.py's."""
from __future__ import annotations

from tool_format_cases import check_published
from turbo.tool_parsers import parser_for_template

PUBLISHED = [
    ('<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
     [("get_stock_fundamentals", {"symbol": "TSLA"})], None),
    ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
     '"date": "2024-10-01"}}\n</tool_call>',
     [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
      ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})], None),
    ("The stock fundamentals data for Tesla (TSLA) are as follows: ...", [],
     "The stock fundamentals data for Tesla (TSLA) are as follows: ..."),
]


def test_published_examples_whole_and_streamed():
    check_published("hermes", PUBLISHED)


def test_chosen_from_the_template():
    assert parser_for_template('For each function call, return a json object ... within <tool_call></tool_call> '
                               'XML tags') == "hermes"
    assert parser_for_template("no tool markup at all") == "hermes"  # the fallback prompt's format
