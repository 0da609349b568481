"""CUDA graphs of decode steps: one graph per batch-size bucket, replayed with the step's plan copied into its
static input buffers. At batch 1 on a GPU a decode step is launch-bound (~26 kernels per layer); a replay issues
them as one graph launch.

A decode step of ``B`` sequences (each computing one token, every context at most ``max_context`` tokens) runs in
the smallest bucket ``b >= B``; rows ``B..b-1`` are padding that repeats row 0 exactly (its token, position, KV slot,
context and block table): every kernel computes a row from that row's inputs alone, so a padded row writes the very
bytes row 0 writes to row 0's slot, reads what row 0 reads, and needs no memory of its own; its logits are dropped.
The graph is captured at a bucket's first use, on that step's inputs (the warm-up runs compute the step itself,
which the replay then repeats), with the attention kernels launched for ``max_context`` tokens (rows read only their
own context). Only backends whose decode path reads nothing but the device step plan (``graph_safe_decode``) are
captured; a capture that fails turns graphs off with a warning and the engine runs eagerly. ``capture=False`` runs
the same padded static path eagerly (tests on CPU).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from backends.types import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Bucket:
    """Static inputs of one bucket (device tensors the graph reads) and its pinned staging buffers."""

    size: int
    ids: torch.Tensor  # int64 [b]
    pos: torch.Tensor  # int64 [b]
    slots: torch.Tensor  # int64 [b]
    rows: torch.Tensor  # int64 [b]: 0..b-1
    row_seq: torch.Tensor  # int32 [b]: 0..b-1
    row_ctx: torch.Tensor  # int32 [b]
    table: torch.Tensor  # int32 [b, W]
    host64: torch.Tensor  # [3b] ids, positions, slots
    host32: torch.Tensor  # [b + b*W] contexts, tables
    event: torch.cuda.Event | None = None
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class DecodeGraphs:
    """Decode steps of ``runner`` (a :class:`~turbo.core.runner.ModelRunner`) through per-bucket static buffers and,
    with ``capture``, CUDA graphs. ``max_context``: longest context served (tokens); ``max_batch``: largest batch."""

    def __init__(self, runner, max_context: int, max_batch: int, capture: bool = True) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.max_context = max_context
        self.width = -(-max_context // self.block_size)
        self.buckets = [b for b in BUCKETS if b < max_batch] + [min(max_batch, BUCKETS[-1])]
        self.capture = capture
        self.enabled = max_context > 0 and max_batch > 0
        self._static: dict[int, _Bucket] = {}
        self._pool = None
        self.replays = 0

    def covers(self, step) -> bool:
        """Whether ``step`` is a decode step this object runs: one token per sequence, batch and contexts within
        the captured bounds."""
        return (self.enabled and len(step.token_ids) == len(step.context_lens) <= self.buckets[-1]
                and max(step.context_lens) <= self.max_context)

    def run(self, step) -> torch.Tensor:
        """float32 logits ``[B, vocab]`` of the decode ``step``."""
        n = len(step.context_lens)
        b = next(x for x in self.buckets if x >= n)
        st = self._static.get(b) or self._make(b)
        self._fill(st, step)
        if not self.capture:
            logits = self._forward(st, real=step)
            return logits[:n]
        if st.graph is None:
            try:
                self._capture(st)
            except Exception as e:  # noqa: BLE001 - eager is always correct
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decode runs eagerly "
                              f"(enforce_eager=True hides this warning)", stacklevel=2)
                self.enabled = False
                return self.runner.model.forward(*self._eager_inputs(step))
        st.graph.replay()
        self.replays += 1
        return st.out[:n]

    # --- static buffers --------------------------------------------------------------------------------------
    def _make(self, b: int) -> _Bucket:
        dev = self.runner.model.backend.device
        pin = dev.type == "cuda"

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        st = _Bucket(b, zeros(b, dtype=torch.long), zeros(b, dtype=torch.long), zeros(b, dtype=torch.long),
                     torch.arange(b, device=dev), torch.arange(b, dtype=torch.int32, device=dev),
                     zeros(b, dtype=torch.int32), zeros(b, self.width, dtype=torch.int32),
                     torch.zeros(3 * b, dtype=torch.long, pin_memory=pin),
                     torch.zeros(b + b * self.width, dtype=torch.int32, pin_memory=pin))
        self._static[b] = st
        return st

    def _padded(self, step, b: int) -> tuple[list[int], list[int]]:
        """Host values of the bucket's inputs (padded rows repeat row 0): (ids + positions + slots, contexts + flat
        tables)."""
        pad, bs, w = b - len(step.context_lens), self.block_size, self.width
        v64 = [x for xs in (step.token_ids, step.positions, step.slot_mapping) for x in (*xs, *[xs[0]] * pad)]
        v32 = list(step.context_lens) + [step.context_lens[0]] * pad
        rows = []
        for bt, ctx in zip(step.block_tables, step.context_lens):
            k = -(-ctx // bs)
            rows.append(list(bt[:k]) + [0] * (w - k))
        for r in rows + [rows[0]] * pad:
            v32 += r
        return v64, v32

    def _fill(self, st: _Bucket, step) -> None:
        b = st.size
        v64, v32 = self._padded(step, b)
        if st.event is not None:
            st.event.synchronize()  # the previous step's copies out of the staging buffers are done
        st.host64.numpy()[:] = v64
        st.host32.numpy()[:] = v32
        nb = st.host64.device.type == "cpu" and st.ids.device.type == "cuda"
        st.ids.copy_(st.host64[:b], non_blocking=nb)
        st.pos.copy_(st.host64[b:2 * b], non_blocking=nb)
        st.slots.copy_(st.host64[2 * b:], non_blocking=nb)
        st.row_ctx.copy_(st.host32[:b], non_blocking=nb)
        st.table.copy_(st.host32[b:].view(b, self.width), non_blocking=nb)
        if nb:
            st.event = torch.cuda.Event()
            st.event.record()

    def _meta(self, st: _Bucket, real=None) -> AttentionMetadata:
        """The bucket's metadata over its static tensors. ``real``: the step, for host lists that match the padded
        rows (eager replay of the padded path); without it (capture), placeholder lists of the right length."""
        b, bs = st.size, self.block_size
        if real is not None:
            pad = b - len(real.context_lens)
            ctx = list(real.context_lens) + [real.context_lens[0]] * pad
            tables = [list(t) for t in real.block_tables] + [list(real.block_tables[0])] * pad
        else:
            ctx, tables = [self.max_context] * b, [[0] * self.width] * b
        return AttentionMetadata(slot_mapping=st.slots, query_start=list(range(b + 1)), context_lens=ctx,
                                 block_tables=tables, block_size=bs, row_seq=st.row_seq, row_ctx=st.row_ctx,
                                 block_table=st.table, max_context=self.max_context)

    def _forward(self, st: _Bucket, real=None) -> torch.Tensor:
        r = self.runner
        return r.model.forward(st.ids, st.pos, r.kv_cache, self._meta(st, real), st.rows)

    def _eager_inputs(self, step):
        ids, pos, meta, rows = self.runner.prepare(step)
        return ids, pos, self.runner.kv_cache, meta, rows

    def _capture(self, st: _Bucket) -> None:
        """Capture the bucket's graph on the inputs already in its buffers (the step being run)."""
        if not getattr(self.runner.model.backend, "graph_safe_decode", False):
            raise RuntimeError(f"the {self.runner.model.backend.name} backend's decode path is not graph-safe")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the kernels and settles the allocator; each computes this very step
                self._forward(st)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self._forward(st)
        st.graph, st.out = g, out
