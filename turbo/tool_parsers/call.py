"""One parsed tool call (:class:`ToolCall`) and the ids calls get (``call_`` + 24 hex digits, as OpenAI's look)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    """A tool call id as OpenAI's look: ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def new_call_id_prefix() -> str:
    """A reply's call-id prefix (16 hex digits): its calls get ``call_`` + prefix + the call's index in 8 hex digits,
    so two readers of the same reply (the HTTP front and the session that keeps it) give the same ids."""
    return uuid.uuid4().hex[:16]


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON text (compact:
    ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)``)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        """The call in a chat completion message's ``tool_calls`` list."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
