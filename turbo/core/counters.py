"""The engine core's counters since start: one dataclass, read by :meth:`~turbo.core.engine.EngineCore.stats`."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineCounters:
    """What the steps did since the engine started.

    ``prefill_tokens`` / ``last_prefill_tokens``: prompt tokens computed (not served from a cache), in all and for
    the last request that started; ``decode_tokens`` and ``generated_tokens``: tokens produced after the first and in
    all; ``steps`` and ``busy_seconds``: steps run and their wall time; constrained decoding's ``mask_rows`` (masks
    computed), ``mask_seconds`` (their CPU time, on a worker thread beside the forward) and ``mask_wait_seconds``
    (what the steps waited for them); speculation's ``spec_steps`` (rows that verified drafts), ``spec_drafted`` and
    ``spec_accepted`` (draft tokens verified and kept)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    last_prefill_tokens: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    mask_rows: int = 0
    mask_seconds: float = 0.0
    mask_wait_seconds: float = 0.0
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    def as_dict(self) -> dict:
        """Every counter by name, plus ``generation_tokens_per_s`` (generated tokens per busy second)."""
        d = asdict(self)
        d["generation_tokens_per_s"] = self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0
        return d
