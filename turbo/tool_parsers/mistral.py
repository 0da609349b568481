"""The ``mistral`` tool-call format (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small): ``[TOOL_CALLS]`` then a
JSON array of ``{"name": ..., "arguments": {...}}`` objects (or one object).

Published example (mistral-common's tool-call tokenization; vLLM's ``mistral`` parser tests)::

    [TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]
"""
from .json_calls import JsonFormat

FORMAT = JsonFormat("mistral", ("[TOOL_CALLS]",), array=True, template_marks=("[TOOL_CALLS]",))
