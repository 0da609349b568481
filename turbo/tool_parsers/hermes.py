"""The ``hermes`` tool-call format (Hermes 2 Pro, Qwen2.5, Qwen3, and what :mod:`turbo.serve.tools`' fallback prompt
asks for): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the reply.

Published example (NousResearch Hermes-Function-Calling; vLLM's ``hermes`` parser)::

    <tool_call>
    {"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}
    </tool_call>
"""
from .json_calls import JsonFormat

FORMAT = JsonFormat("hermes", ("<tool_call>",), close="</tool_call>", template_marks=("<tool_call>",))
