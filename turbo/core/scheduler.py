"""Persistent-batch scheduler: which sequences compute how many tokens in the next step. Pure Python.

Prefill, chunked prefill and decode are one thing: bring ``num_computed`` up to ``len(token_ids)``
(vLLM v1's formulation). Each step:

1. Running sequences, most important first (lower ``priority`` value, then earlier arrival), get their
   tokens within the step's token budget. When KV blocks run out, idle sessions' caches are evicted first
   (least recently used), then the least important running sequence is preempted: its blocks are freed and
   it goes back to the waiting queue keeping its tokens, to be recomputed later (its output is unchanged).
2. If nothing was preempted, waiting sequences are admitted in (priority, arrival) order while the batch
   size, the token budget and free blocks allow; a long prompt is split into chunks across steps. An
   admitted sequence first takes the cached blocks of its longest cached prefix. A sequence whose prompt another
   one is computing (``Sequence.after``: the engine sets it for identical prompts, e.g. the ``n`` choices of one
   request) waits until that prompt is computed, then takes its blocks from the prefix cache.
3. After the runner computed the step, :meth:`Scheduler.update_from_output` advances the computed tokens, offers
   full blocks to the prefix cache and says which sequences get a sampled token.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from .block_manager import BlockManager


class Status(Enum):
    """Where a sequence is."""

    WAITING = "waiting"
    RUNNING = "running"
    IDLE = "idle"  # a session between turns, possibly holding KV blocks
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass
class Sequence:
    """Token history of one request or session, and its KV blocks. Tokens ``[:num_computed]`` are cached."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    arrival: int = field(default_factory=lambda: next(_arrivals))
    num_preemptions: int = 0
    # an identical prompt being prefilled: this one waits for it, then reuses its blocks from the prefix cache
    after: "Sequence | None" = field(default=None, compare=False, repr=False)
    # where a saved copy of this session's KV lies: (kv.safetensors, the token ids it holds), the disk tier
    disk_kv: tuple | None = field(default=None, compare=False, repr=False)
    num_drafts: int = 0  # speculative draft tokens at the end of token_ids, not verified yet (turbo/core/speculative.py)

    @property
    def held(self) -> bool:
        """Whether this sequence waits for ``after`` to compute the prompt they share (see ``after``)."""
        a = self.after
        if a is None or a.status not in (Status.WAITING, Status.RUNNING) or a.num_computed >= self.num_tokens - 1:
            self.after = None
            return False
        return True

    @property
    def num_tokens(self) -> int:
        """Tokens in the history (computed or not)."""
        return len(self.token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival)


@dataclass
class ScheduledStep:
    """The scheduler's output for one step: sequences and how many new tokens each computes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]

    @property
    def total_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(self.num_new_tokens)


class Scheduler:
    """Waiting queue, running batch and idle sessions over one :class:`BlockManager`."""

    def __init__(self, block_manager: BlockManager, max_batch_size: int = 64, max_num_batched_tokens: int = 2048) -> None:
        if max_batch_size < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be positive")
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.idle: OrderedDict[int, Sequence] = OrderedDict()  # LRU: oldest first
        # the engine's KV host tier (turbo/core/kv_tier.py): on_evict(seq) before a session's blocks are freed,
        # on_admit(seq) -> bool when a sequence without blocks is admitted (True: it loaded its KV back)
        self.on_evict = None
        self.on_admit = None

    # --- lifecycle -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose ``token_ids`` need computing (it may already hold blocks, e.g. a session)."""
        self.idle.pop(seq.seq_id, None)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, keep_cache: bool = False) -> None:
        """Take ``seq`` out of the batch. ``keep_cache``: it is a session; keep its blocks while memory allows."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if keep_cache:
            seq.status = Status.IDLE
            self.idle[seq.seq_id] = seq
        else:
            self.bm.free(seq.block_table)
            seq.num_computed = 0
            seq.status = Status.FINISHED
            self.idle.pop(seq.seq_id, None)

    def evict(self, seq: Sequence) -> None:
        """Free an idle session's KV blocks; its tokens stay and are recomputed on its next turn (or, with a host
        tier, ``on_evict`` keeps their KV first and ``on_admit`` loads it back)."""
        if self.on_evict is not None and seq.num_computed > 0:
            self.on_evict(seq)
        self.bm.free(seq.block_table)
        seq.num_computed = 0

    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    # --- the step ------------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, num_tokens: int, protected: set[int]) -> bool:
        """Free blocks until ``seq`` can hold ``num_tokens``: idle sessions (LRU) first, then preempt the
        least important running sequence not in ``protected``. False if ``seq`` itself had to go."""
        while not self.bm.can_allocate(seq.block_table, num_tokens):
            victim_idle = next((s for s in self.idle.values() if s.block_table), None)
            if victim_idle is not None:
                self.evict(victim_idle)
                continue
            victim_wait = self._waiting_with_blocks(exclude=seq)
            if victim_wait is not None:  # a session turn not admitted yet still holds its history's blocks
                self.evict(victim_wait)
                continue
            candidates = [s for s in self.running if s.seq_id not in protected and s is not seq]
            if not candidates:
                return False
            self.preempt(max(candidates, key=lambda s: s.sort_key))
        return True

    def _waiting_with_blocks(self, exclude: Sequence) -> Sequence | None:
        """The least important waiting sequence (other than ``exclude``) that holds KV blocks."""
        holders = [s for s in self.waiting if s is not exclude and s.block_table]
        return max(holders, key=lambda s: s.sort_key) if holders else None

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and send it back to waiting (recompute later)."""
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        """Pick this step's sequences and token counts (blocks are allocated for them)."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted_before = sum(s.num_preemptions for s in self.waiting + self.running)
        self.running.sort(key=lambda s: s.sort_key)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted for a more important one this step
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n <= 0:
                continue
            if not self._make_room(seq, seq.num_computed + n, {s.seq_id for s in seqs}):
                self.preempt(seq)
                continue
            self.bm.ensure_capacity(seq.block_table, seq.num_computed + n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        preempted = [s for s in self.waiting if s.status == Status.WAITING and s.num_preemptions and s.num_computed == 0]
        did_preempt = sum(s.num_preemptions for s in self.waiting + self.running) > preempted_before
        if not did_preempt:
            self.waiting.sort(key=lambda s: s.sort_key)
            while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
                seq = next((s for s in self.waiting if not s.held), None)
                if seq is None:
                    break
                if not seq.block_table and not (self.on_admit is not None and self.on_admit(seq)):
                    seq.num_computed = self.bm.match_prefix(seq.token_ids, seq.block_table)
                n = min(seq.num_tokens - seq.num_computed, budget)
                if not self.bm.can_allocate(seq.block_table, seq.num_computed + n):
                    # only idle caches may be given up for a new request; never running work
                    victim = next((s for s in self.idle.values() if s.block_table), None)
                    if victim is None and not self.running and not seqs:
                        # nothing runs that could ever free blocks: other waiting session turns give up
                        # their cached history (recomputed when admitted) rather than deadlock
                        victim = self._waiting_with_blocks(exclude=seq)
                    if victim is None:
                        break
                    self.evict(victim)
                    continue
                self.bm.ensure_capacity(seq.block_table, seq.num_computed + n)
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        return ScheduledStep(seqs, counts, preempted)

    def update_from_output(self, sched: ScheduledStep) -> list[int]:
        """After the runner computed ``sched``: advance each sequence's computed tokens and offer its full blocks to
        the prefix cache. Returns the rows (indices into ``sched.seqs``) whose tokens are now all computed: those
        get a sampled token (the others computed a prompt chunk)."""
        ready = []
        for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            seq.num_computed += n
            # unverified draft tokens are never offered to the prefix cache
            self.bm.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed - seq.num_drafts)
            if seq.num_computed >= seq.num_tokens:
                ready.append(row)
        return ready

    def evict_if_idle(self, seq: Sequence) -> bool:
        """Free ``seq``'s blocks if it is an idle session (its tokens stay); returns whether it was."""
        if seq.seq_id not in self.idle:
            return False
        self.evict(seq)
        return True

