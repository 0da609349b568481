"""The model runner: owns the model's weights and the backend's KV cache object (16-bit, int8 or int4, see
:mod:`backends.kv_cache`) and computes one :class:`~turbo.core.request.StepInput` into logits. It never reads
scheduler state: the step's plain input is all it sees.

The step plan (token ids, positions, KV slots, logits rows, and for attention each row's sequence and context and the
zero-padded block tables) reaches the device through :class:`StepBuffers`: host buffers written in place (pinned on
CUDA) and one non-blocking copy per dtype, so the forward itself never copies from pageable memory or waits for the
host. On CUDA, decode steps replay CUDA graphs (:mod:`turbo.core.cuda_graphs`) unless ``enforce_eager``.
"""
from __future__ import annotations

import torch

from backends import KVCacheSpec, KVQuantParams
from backends.types import AttentionMetadata

from .cuda_graphs import DecodeGraphs
from .model import LlamaModel
from .request import StepInput


class StepBuffers:
    """Host → device path of the step plan. On CUDA, per dtype two alternating pinned host buffers, each written in
    place only after its previous copy finished (a CUDA event), and one non-blocking copy per call into a device
    buffer whose views are returned; elsewhere plain tensors on the device. Buffers grow on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._rings: dict[torch.dtype, list[dict]] = {}
        self._turn = 0

    def upload(self, dtype: torch.dtype, parts: list[list[int]]) -> list[torch.Tensor]:
        """One device tensor of ``dtype`` per list in ``parts`` (views of one buffer on CUDA)."""
        if not self.pinned:
            return [torch.tensor(p, dtype=dtype, device=self.device) for p in parts]
        flat = [x for p in parts for x in p]
        ring = self._rings.setdefault(dtype, [{}, {}])
        slot = ring[self._turn % 2]
        self._turn += 1
        n = max(len(flat), 1)
        if slot.get("host") is None or slot["host"].numel() < n:
            size = max(n, 2 * (slot["host"].numel() if slot.get("host") is not None else 256))
            slot["host"] = torch.empty(size, dtype=dtype, pin_memory=True)
            slot["dev"] = torch.empty(size, dtype=dtype, device=self.device)
            slot["event"] = None
        if slot["event"] is not None:
            slot["event"].synchronize()  # the copy that last read this host buffer has finished
        host, dev = slot["host"][:len(flat)], slot["dev"][:len(flat)]
        host.numpy()[:] = flat
        dev.copy_(host, non_blocking=True)
        slot["event"] = torch.cuda.Event()
        slot["event"].record()
        out, at = [], 0
        for p in parts:
            out.append(dev[at:at + len(p)])
            at += len(p)
        return out


def row_plan(step: StepInput, block_size: int) -> tuple[list[int], list[int], list[list[int]]]:
    """(sequence of each query row, keys each row sees, block tables zero-padded to the longest needed) of a step."""
    row_seq, row_ctx, nblocks = [], [], []
    for b, ctx in enumerate(step.context_lens):
        t = step.query_start[b + 1] - step.query_start[b]
        row_seq += [b] * t
        row_ctx += range(ctx - t + 1, ctx + 1)
        nblocks.append(-(-ctx // block_size))
    width = max(nblocks, default=1)
    tables = [list(bt[:n]) + [0] * (width - n) for bt, n in zip(step.block_tables, nblocks)]
    return row_seq, row_ctx, tables


class ModelRunner:
    """Owns the model weights and the KV cache object; runs :class:`StepInput` batches.

    ``graphs``: capture decode steps as CUDA graphs (see :class:`~turbo.core.cuda_graphs.DecodeGraphs`) for contexts
    up to ``max_context`` tokens and batches up to ``max_batch``."""

    def __init__(self, model: LlamaModel, spec: KVCacheSpec, kv_params: KVQuantParams | None = None,
                 graphs: bool = False, max_context: int = 0, max_batch: int = 0) -> None:
        self.model, self.block_size = model, spec.block_size
        self.kv_cache = model.backend.allocate_kv_cache(spec, model.dtype, kv_params)
        self.buffers = StepBuffers(model.backend.device)
        self.graphs = DecodeGraphs(self, max_context, max_batch) if graphs else None

    @property
    def kv_bytes(self) -> int:
        """Bytes the KV pool holds (values and scales)."""
        return self.kv_cache.nbytes

    # what a tensor-parallel runner (turbo.core.tp.group.ParallelRunner) changes: at one rank nothing dies and the
    # KV cache is this one
    dead: str | None = None

    def export_kv(self, slots: list[int]) -> dict[str, torch.Tensor]:
        """The stored K/V of cache ``slots`` (see :meth:`backends.kv_cache.PagedKVCache.export`), on the CPU."""
        return self.kv_cache.export(torch.tensor(slots, dtype=torch.long))

    def import_kv(self, kv: dict[str, torch.Tensor], slots: list[int]) -> None:
        """Write what :meth:`export_kv` returned into ``slots``. Raises ``ValueError`` for a missing or misshaped
        tensor (nothing written then)."""
        self.kv_cache.load(kv, torch.tensor(slots, dtype=torch.long, device=self.model.backend.device))

    def close(self) -> None:
        """Release what the runner holds outside this process (nothing at one rank)."""

    def run(self, step: StepInput) -> torch.Tensor:
        """float32 logits ``[len(step.logits_rows), vocab]``."""
        self.model.check_positions(max(step.positions))  # on the host: the forward never synchronizes
        if self.graphs is not None and self.graphs.covers(step):
            return self.graphs.run(step)
        ids, pos, meta, rows = self.prepare(step)
        return self.model.forward(ids, pos, self.kv_cache, meta, rows)

    def prepare(self, step: StepInput, max_context: int | None = None):
        """(token ids, positions, :class:`AttentionMetadata`, logits rows) of ``step`` on the device, the step plan
        uploaded through :attr:`buffers`."""
        row_seq, row_ctx, tables = row_plan(step, self.block_size)
        ids, pos, slots, rows = self.buffers.upload(
            torch.long, [step.token_ids, step.positions, step.slot_mapping, step.logits_rows])
        width = len(tables[0]) if tables else 1
        seq_t, ctx_t, table_t = self.buffers.upload(torch.int32, [row_seq, row_ctx, [x for t in tables for x in t]])
        meta = AttentionMetadata(
            slot_mapping=slots, query_start=step.query_start, context_lens=step.context_lens,
            block_tables=step.block_tables, block_size=self.block_size, row_seq=seq_t, row_ctx=ctx_t,
            block_table=table_t.view(len(tables), width), max_context=max_context or max(row_ctx, default=1))
        return ids, pos, meta, rows
