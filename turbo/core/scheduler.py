"""Persistent-batch scheduler: which sequences compute how many tokens in the next step. Pure Python.

Prefill, chunked prefill and decode are one thing: bring ``num_computed`` up to ``len(token_ids)``
(vLLM v1's formulation). Each step:

1. Running sequences, most important first (lower ``priority`` value, then earlier arrival), get their
   tokens within the step's token budget. When KV blocks run out, idle sessions' caches are evicted first
   (least recently used), then the least important running sequence is preempted: its blocks are freed and
   it goes back to the waiting queue keeping its tokens, to be recomputed later (its output is unchanged).
2. If nothing was preempted, waiting sequences are admitted in (priority, arrival) order while the batch
   size, the token budget and free blocks allow: a sequence is admitted into a running batch only when its whole
   prompt and a decode reserve (a block's worth of tokens by default, never past its ``max_tokens``) fit beside what the running ones still need for theirs, so a
   long prompt is not prefilled only to be preempted for the others' decode blocks; a long prompt is split into chunks across steps. An
   admitted sequence first takes the cached blocks of its longest cached prefix. A sequence whose prompt another
   one is computing (``Sequence.after``: the engine sets it for identical prompts, e.g. the ``n`` choices of one
   request) waits until that prompt is computed, then takes its blocks from the prefix cache.
3. After the runner computed the step and the engine sampled it, :meth:`Scheduler.update_from_output` applies the
   :class:`~turbo.core.request.StepOutput`: it advances the computed tokens, appends each row's new tokens, rolls back
   rejected speculative drafts (their blocks are freed) and offers full blocks to the prefix cache.

Data in, data out: the scheduler calls nothing back. What the engine must carry out between ``schedule()`` and the
run is in the :class:`SchedulerOutput`: the speculative drafts each row verifies (proposed by the engine as
``Sequence.draft_ids``, scheduled when the budget and free blocks allow them without pushing anything out), the KV
to store in the host tier before the blocks it lies in are reused (:class:`KVStore`, one per evicted session when
``spill_kv``), and the KV to load back into blocks allocated at admission (:class:`KVLoad`, from the host tier or
the session's saved file when ``restore_kv``). A load that fails is handed back with :meth:`Scheduler.load_failed`,
which takes the sequence out of the step (it is recomputed from the next step on).
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
    # the K/V of these leading tokens lies in the engine's host tier (set when it was stored there, None when gone)
    host_kv: list[int] | None = field(default=None, compare=False, repr=False)
    # speculative draft tokens proposed for the next step (turbo/core/speculative.py); never part of token_ids
    draft_ids: list[int] = field(default_factory=list, compare=False, repr=False)
    # the length at which the request ends at the latest (prompt + max new tokens), when known: admission reserves
    # decode blocks up to it only
    max_tokens: int | None = field(default=None, compare=False, repr=False)

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
class KVStore:
    """Before anything writes the pool: copy the K/V of ``token_ids`` (lying in ``slots``) of an evicted session
    ``seq`` to the host tier (its blocks are already free in the block manager)."""

    seq: Sequence
    token_ids: list[int]
    slots: list[int]


@dataclass
class KVLoad:
    """Before the run: load the first ``num_tokens`` tokens of ``seq``'s stored K/V from ``tier`` (``"host"`` or
    ``"disk"``) into ``slots`` (blocks allocated at admission; ``seq.num_computed`` already counts them).
    ``num_tokens`` 0: the stored K/V shares nothing with the sequence any more; the engine drops it."""

    seq: Sequence
    tier: str
    num_tokens: int
    slots: list[int]


@dataclass
class SchedulerOutput:
    """The scheduler's output for one step: sequences and how many new tokens each computes (its draft tokens
    included), the drafts per row, which rows get sampled tokens, and the KV moves to carry out first."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]
    drafts: list[list[int]] = field(default_factory=list)  # per row: draft tokens after its last real token
    sampled: list[bool] = field(default_factory=list)  # per row: its real tokens are all computed after the step
    kv_stores: list[KVStore] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.seqs)
        self.drafts = self.drafts or [[] for _ in range(n)]
        self.sampled = self.sampled or [s.num_computed + k >= s.num_tokens for s, k in zip(self.seqs, self.num_new_tokens)]

    @property
    def total_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(self.num_new_tokens)


class Scheduler:
    """Waiting queue, running batch and idle sessions over one :class:`BlockManager`."""

    def __init__(self, block_manager: BlockManager, max_batch_size: int = 64, max_num_batched_tokens: int = 2048,
                 spill_kv: bool = False, restore_kv: bool = False, decode_reserve: int | None = None) -> None:
        """``decode_reserve``: tokens of decode (``None``: a block's worth; never past ``Sequence.max_tokens``) that
        admission keeps room for per running sequence, beside the blocks its prompt still needs (see :meth:`_fits`;
        0 fills the pool with prompts).
        ``spill_kv``: an evicted session's computed K/V is stored first (a :class:`KVStore` in the next output);
        ``restore_kv``: a sequence admitted without blocks loads its stored K/V back (``Sequence.host_kv``, then
        ``Sequence.disk_kv``) when its tokens still share a prefix with it and the blocks are free."""
        if max_batch_size < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be positive")
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.spill_kv, self.restore_kv = spill_kv, restore_kv
        if decode_reserve is not None and decode_reserve < 0:
            raise ValueError("decode_reserve must be >= 0")
        self.decode_reserve = block_manager.block_size if decode_reserve is None else decode_reserve
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.idle: OrderedDict[int, Sequence] = OrderedDict()  # LRU: oldest first
        self.kv_stores: list[KVStore] = []  # evictions' stores not handed out yet (see take_kv_stores)
        self._loads: dict[int, KVLoad] = {}  # loads planned by the schedule() under way, by sequence id

    # --- lifecycle -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose ``token_ids`` need computing (it may already hold blocks, e.g. a session). Its arrival
        is now: a session's turn queues behind the requests that came before it, whenever the session was opened (a
        preempted sequence keeps its arrival, so it is not overtaken by later ones)."""
        self.idle.pop(seq.seq_id, None)
        seq.arrival = next(_arrivals)
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
        """Free an idle session's KV blocks; its tokens stay and are recomputed on its next turn (or, with
        ``spill_kv``, a :class:`KVStore` asks the engine to keep their K/V first, and admission loads it back)."""
        load = self._loads.pop(seq.seq_id, None)  # planned this step, not carried out: nothing to store
        if self.spill_kv and seq.num_computed > 0 and load is None:
            slots = self.bm.slots(seq.block_table, 0, seq.num_computed)
            self.kv_stores.append(KVStore(seq, seq.token_ids[:seq.num_computed], slots))
        self.bm.free(seq.block_table)
        seq.num_computed = 0

    def take_kv_stores(self) -> list[KVStore]:
        """The stores of the evictions since the last call (or step), to carry out before the pool is written."""
        out, self.kv_stores = self.kv_stores, []
        return out

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

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts (blocks are allocated for them, drafts included)."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        drafts: list[list[int]] = []
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
            d = self._fit_drafts(seq, n, budget - n)
            self.bm.ensure_capacity(seq.block_table, seq.num_computed + n + len(d))
            seqs.append(seq)
            counts.append(n + len(d))
            drafts.append(d)
            budget -= n + len(d)
        preempted = [s for s in self.waiting if s.status == Status.WAITING and s.num_preemptions and s.num_computed == 0]
        did_preempt = sum(s.num_preemptions for s in self.waiting + self.running) > preempted_before
        if not did_preempt:
            budget = self._admit(budget, seqs, counts)
        for seq in self.running + self.waiting:
            seq.draft_ids = []  # proposals are per step
        drafts += [[] for _ in range(len(seqs) - len(drafts))]
        sampled = [s.num_computed + k - len(d) >= s.num_tokens for s, k, d in zip(seqs, counts, drafts)]
        loads, self._loads = list(self._loads.values()), {}
        return SchedulerOutput(seqs, counts, preempted, drafts, sampled, self.take_kv_stores(), loads)

    def _fit_drafts(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The drafts of ``seq`` this step verifies: when its real tokens all fit (``n``), as many as the budget
        allows, and only when the pool holds all of them without evicting anything (drafts never push work out)."""
        d = seq.draft_ids
        if not d or n != seq.num_tokens - seq.num_computed or budget <= 0:
            return []
        if not self.bm.can_allocate(seq.block_table, seq.num_tokens + len(d)):
            return []
        return d[:budget]

    def _admit(self, budget: int, seqs: list[Sequence], counts: list[int]) -> int:
        """Admit waiting sequences in (priority, arrival) order while the batch size, ``budget`` and free blocks
        allow (appending to ``seqs`` and ``counts``; stored K/V to load back goes to ``_loads``); returns the budget
        left."""
        self.waiting.sort(key=lambda s: s.sort_key)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = next((s for s in self.waiting if not s.held), None)
            if seq is None:
                break
            if not seq.block_table:
                load = self._plan_load(seq)
                if load is not None:
                    self._loads[seq.seq_id] = load
                if not seq.block_table:
                    seq.num_computed = self.bm.match_prefix(seq.token_ids, seq.block_table)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._fits(seq, n):
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
        return budget

    def _growth(self, seq: Sequence) -> int:
        """Free blocks ``seq`` will take to compute the rest of its tokens and its decode reserve."""
        end = seq.num_tokens + self.decode_reserve
        if seq.max_tokens is not None:
            end = max(seq.num_tokens, min(end, seq.max_tokens))
        return max(0, self.bm.blocks_needed(end) - len(seq.block_table))

    def _fits(self, seq: Sequence, n: int) -> bool:
        """Whether admitting ``seq`` with ``n`` tokens now keeps the batch clear of preemption: with nothing running,
        its ``n`` tokens fit; else its whole prompt and its decode reserve fit beside what every running sequence
        still needs for its prompt and its reserve (by default each then decodes a block's worth of tokens, or to its
        ``max_tokens``, before it asks for more). Without this, a long prompt admitted into a nearly full pool is
        preempted a few steps later for the running ones' decode blocks, its prefill wasted, and re-admitted, again
        and again (thrash under load)."""
        if not self.running:
            return self.bm.can_allocate(seq.block_table, seq.num_computed + n)
        return self._growth(seq) + sum(self._growth(s) for s in self.running) <= self.bm.num_free

    def _plan_load(self, seq: Sequence) -> KVLoad | None:
        """With ``restore_kv``: blocks for the longest prefix of ``seq``'s stored K/V (host tier first, then its
        saved file) that its tokens still share, idle sessions evicted for them as admission would; the load the
        engine carries out, or ``None`` (no stored K/V, or no room: the prefix cache and recompute serve it). The
        engine clears ``host_kv`` when it takes the host copy."""
        if not self.restore_kv:
            return None
        tier, ids = ("host", seq.host_kv) if seq.host_kv is not None else \
            ("disk", seq.disk_kv[1] if seq.disk_kv is not None else None)
        if ids is None:
            return None
        n = 0
        while n < min(len(ids), seq.num_tokens - 1) and ids[n] == seq.token_ids[n]:
            n += 1
        while n and not self.bm.can_allocate(seq.block_table, n):
            victim = next((s for s in self.idle.values() if s.block_table and s is not seq), None)
            if victim is None:
                break
            self.evict(victim)
        if n == 0:  # it shares nothing: a host copy is dropped
            return KVLoad(seq, tier, 0, []) if tier == "host" else None
        if not self.bm.can_allocate(seq.block_table, n):
            return None
        self.bm.ensure_capacity(seq.block_table, n)
        seq.num_computed = n
        return KVLoad(seq, tier, n, self.bm.slots(seq.block_table, 0, n))

    def load_failed(self, sched: SchedulerOutput, seq: Sequence, tier: str) -> None:
        """The engine could not load ``seq``'s stored K/V (gone, replaced, another shape): take ``seq`` out of
        ``sched``, free its blocks, forget that stored K/V and put it first in the queue, to recompute."""
        if seq in sched.seqs:
            i = sched.seqs.index(seq)
            for lst in (sched.seqs, sched.num_new_tokens, sched.drafts, sched.sampled):
                del lst[i]
        if seq in self.running:
            self.running.remove(seq)
        if seq not in self.waiting:
            self.waiting.insert(0, seq)
        self.bm.free(seq.block_table)
        seq.num_computed, seq.status = 0, Status.WAITING
        if tier == "host":
            seq.host_kv = None
        else:
            seq.disk_kv = None

    def update_from_output(self, sched: SchedulerOutput, out) -> list[int]:
        """Apply the :class:`~turbo.core.request.StepOutput` ``out`` of ``sched``: advance each sequence's computed
        tokens, append the new tokens of the rows that got some (a row's accepted drafts and its next token, as the
        engine kept them after the stop rules), roll back rejected drafts (their KV is not counted and blocks past
        the kept tokens are freed), and offer full blocks to the prefix cache. Returns the rows that got tokens."""
        rows = []
        for row, (seq, n, d) in enumerate(zip(sched.seqs, sched.num_new_tokens, sched.drafts)):
            seq.num_computed += n - len(d)
            new = out.new_token_ids.get(row)
            if new is not None:
                rows.append(row)
                seq.token_ids.extend(new)
                seq.num_computed += min(len(new), out.num_accepted.get(row, 0))  # kept drafts: KV computed
            if d:
                seq.num_computed = self.bm.truncate(seq.block_table, seq.num_computed)
            self.bm.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed)
        return rows

    def evict_if_idle(self, seq: Sequence) -> bool:
        """Free ``seq``'s blocks if it is an idle session (its tokens stay); returns whether it was."""
        if seq.seq_id not in self.idle:
            return False
        self.evict(seq)
        return True

