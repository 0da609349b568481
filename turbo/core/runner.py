"""The model runner: owns the model's weights and the backend's KV cache object (16-bit, int8 or int4, see
:mod:`backends.kv_cache`) and computes one :class:`~turbo.core.request.StepInput` into logits. It never reads
scheduler state: the step's plain input is all it sees.
"""
from __future__ import annotations

import torch

from backends import KVCacheSpec, KVQuantParams
from backends.types import AttentionMetadata

from .model import LlamaModel
from .request import StepInput


class ModelRunner:
    """Owns the model weights and the KV cache object; runs :class:`StepInput` batches."""

    def __init__(self, model: LlamaModel, spec: KVCacheSpec, kv_params: KVQuantParams | None = None) -> None:
        self.model, self.block_size = model, spec.block_size
        self.kv_cache = model.backend.allocate_kv_cache(spec, model.dtype, kv_params)

    @property
    def kv_bytes(self) -> int:
        """Bytes the KV pool holds (values and scales)."""
        return self.kv_cache.nbytes

    def run(self, step: StepInput) -> torch.Tensor:
        """float32 logits ``[len(step.logits_rows), vocab]``."""
        dev = self.model.backend.device
        self.model.check_positions(max(step.positions))  # on the host: the forward never synchronizes
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            query_start=step.query_start, context_lens=step.context_lens, block_tables=step.block_tables,
            block_size=self.block_size,
        )
        return self.model.forward(
            torch.tensor(step.token_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            self.kv_cache, meta, torch.tensor(step.logits_rows, dtype=torch.long, device=dev),
        )
