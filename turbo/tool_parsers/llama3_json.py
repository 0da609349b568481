"""The ``llama3_json`` tool-call format (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the reply *starts* (after
whitespace, optionally after ``<|python_tag|>``) with ``{"name": ..., "parameters": {...}}``; several calls are
separated by ``;``. Text before it means the reply has no call.

Published example (Meta's Llama 3.1 model card, "JSON based tool calling")::

    {"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}
"""
from .json_calls import JsonFormat

FORMAT = JsonFormat("llama3_json", ("<|python_tag|>",), start_only=True, template_marks=("<|python_tag|>",))
