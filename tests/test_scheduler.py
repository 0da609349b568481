"""Scheduler and block manager alone (no torch, no model): exact block ids and no leaks."""
from __future__ import annotations

import random

import pytest

from turbo.core.block_manager import BlockManager, block_hashes
from turbo.core.scheduler import Scheduler, Sequence, Status


def _fake_step(sched: Scheduler, rng: random.Random, vocab: int = 50) -> list[Sequence]:
    """Compute what was scheduled; a sequence whose tokens are all computed gets one new token."""
    step = sched.schedule()
    done = []
    for seq, n in zip(step.seqs, step.num_new_tokens):
        seq.num_computed += n
        sched.bm.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed)
        assert len(seq.block_table) == sched.bm.blocks_needed(seq.num_computed)
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(rng.randrange(vocab))
            done.append(seq)
    return done


def test_prefix_cache_exact_blocks_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a: list[int] = []
    toks = list(range(10))  # 2 full blocks + 2 tokens
    assert bm.match_prefix(toks, a) == 0 and a == []
    bm.ensure_capacity(a, 10)
    assert a == [0, 1, 2]
    bm.register_full_blocks(toks, a, 10)
    assert bm.block_hash[0] == block_hashes(toks, 4)[0] and bm.block_hash[2] is None
    b: list[int] = []
    assert bm.match_prefix(toks[:9] + [99], b) == 8 and b == [0, 1]  # shares both full blocks
    assert bm.ref_count[:3] == [2, 2, 1]
    bm.free(a)
    assert list(bm.free_queue) == [3, 4, 5, 2] and bm.ref_count[:3] == [1, 1, 0]
    bm.free(b)
    assert list(bm.free_queue) == [3, 4, 5, 2, 1, 0]  # last block first: the prefix head is evicted last
    c: list[int] = []
    assert bm.match_prefix(toks, c) == 8 and c == [0, 1]  # still cached after both owners left
    assert list(bm.free_queue) == [3, 4, 5, 2]
    bm.free(c)
    d: list[int] = []
    bm.ensure_capacity(d, 24)  # needs all 6 blocks: the cached ones are evicted (LRU order)
    assert d == [3, 4, 5, 2, 1, 0] and bm.cached == {}
    assert bm.match_prefix(toks, []) == 0


def test_truncate_never_writes_into_a_shared_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    a: list[int] = []
    bm.ensure_capacity(a, 8)
    bm.register_full_blocks(list(range(8)), a, 8)
    # keeping 6 tokens would leave block a[1] half-used and then overwritten: it is dropped instead
    assert bm.truncate(a, 6) == 4 and a == [0]
    b: list[int] = []
    bm.ensure_capacity(b, 3)
    assert bm.truncate(b, 2) == 2 and len(b) == 1  # a private, uncached block may be kept partly


def test_priority_then_fcfs_and_preemption_of_least_important():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    # no decode reserve: both prompts fill the pool, so the first decode block must come from a preemption
    s = Scheduler(bm, max_batch_size=8, max_num_batched_tokens=64, decode_reserve=0)
    low = Sequence(seq_id=1, token_ids=[1] * 7, priority=5)
    high = Sequence(seq_id=2, token_ids=[2] * 7, priority=0)
    s.add(low)
    s.add(high)
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [2, 1] and step.num_new_tokens == [7, 7]
    assert high.block_table == [0, 1] and low.block_table == [2, 3]
    for q, n in zip(step.seqs, step.num_new_tokens):
        q.num_computed += n
        q.token_ids.append(0)
    # both want their 9th token: one more block each, none free -> the low-priority one is preempted
    high.token_ids += [0]
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [2] and low.status == Status.WAITING and low.num_computed == 0
    assert low.num_preemptions == 1 and high.block_table == [0, 1, 3]


def test_admission_keeps_a_decode_block_per_running_sequence_so_a_long_prompt_is_not_prefilled_to_be_preempted():
    """The thrash this reserve prevents: 2 sequences decoding in a pool of 8 blocks of 4; a prompt of 20 tokens
    (5 blocks) arrives. Filling the pool with it (reserve 0) preempts it at the next block boundary of the running
    ones, its prefill wasted; with the default reserve it waits until it fits beside their next blocks."""
    for reserve, admitted in ((0, True), (None, False)):  # None: a block (4 tokens)
        bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
        s = Scheduler(bm, max_batch_size=8, max_num_batched_tokens=64, decode_reserve=reserve)
        a, b = Sequence(seq_id=1, token_ids=[1] * 4), Sequence(seq_id=2, token_ids=[2] * 4)
        s.add(a)
        s.add(b)
        step = s.schedule()
        assert step.seqs == [a, b]  # nothing ran: both admitted (2 blocks + 2 reserved <= 8)
        for q in (a, b):
            q.num_computed, q.token_ids = 4, q.token_ids + [0]
        long = Sequence(seq_id=3, token_ids=[3] * 20)
        s.add(long)
        step = s.schedule()
        # a and b need a 2nd block now (2 + 2 taken); 4 free: 5 for the prompt fit neither way, 4 + 1 reserve...
        assert (long in step.seqs) is False and bm.num_free == 4
        long.token_ids = [3] * 12  # ...a 12-token prompt: 3 blocks fit beside a reserve of 0, not beside 1 + 2
        step = s.schedule()
        assert (long in step.seqs) is admitted, reserve
        if admitted:  # a and b each want a 3rd block at their 9th token: 1 free -> the newest (long) is preempted
            for q in (a, b):
                q.num_computed, q.token_ids = q.num_tokens, q.token_ids + [0] * 4
            long.num_computed = 12
            s.schedule()
            assert long.num_preemptions == 1 and long.num_computed == 0


def test_a_session_turn_queues_behind_requests_that_came_before_it_however_old_the_session():
    """A session's Sequence lives across turns: its place in the queue is its turn's arrival, not the session's
    creation (else every turn of an old session overtakes whatever waits, and requests starve: the soak's 120 s
    waits)."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(bm, max_batch_size=1, max_num_batched_tokens=64)
    session = Sequence(seq_id=1, token_ids=[1] * 3)  # opened first
    s.add(session)
    step = s.schedule()
    session.num_computed, session.token_ids = 3, session.token_ids + [0]
    s.finish(session, keep_cache=True)  # its turn ended; it idles
    fresh = Sequence(seq_id=2, token_ids=[2] * 3)
    s.add(fresh)  # a request, then the session's next turn
    session.token_ids += [5]
    s.add(session)
    assert [q.seq_id for q in s.schedule().seqs] == [2]  # batch of 1: the earlier request goes first
    assert session.status == Status.WAITING and step.seqs == [session]


@pytest.mark.parametrize("seed", [0, 1])
def test_1000_random_requests_with_cancellations_and_sessions_free_every_block(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=40, block_size=4)
    s = Scheduler(bm, max_batch_size=16, max_num_batched_tokens=48)
    live: dict[int, tuple[Sequence, int, bool]] = {}  # seq_id -> (seq, tokens to generate, is_session)
    sessions: list[Sequence] = []
    next_id, submitted = 0, 0
    while submitted < 1000 or live:
        for _ in range(rng.randint(0, 4)):
            if submitted >= 1000:
                break
            if sessions and rng.random() < 0.3:  # a new turn of an idle session
                seq = sessions.pop(rng.randrange(len(sessions)))
                keep = bm.truncate(seq.block_table, min(seq.num_computed, seq.num_tokens - 1))
                seq.num_computed = keep
                seq.token_ids = seq.token_ids + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
                live[seq.seq_id] = (seq, rng.randint(1, 6), True)
            else:
                prefix = [7] * rng.choice([0, 4, 8])  # shared prefixes exercise the prefix cache
                seq = Sequence(seq_id=next_id, priority=rng.randint(0, 2),
                               token_ids=prefix + [rng.randrange(50) for _ in range(rng.randint(1, 30))])
                next_id += 1
                live[seq.seq_id] = (seq, rng.randint(1, 6), rng.random() < 0.2)
            s.add(seq)
            submitted += 1
        for seq in _fake_step(s, rng):
            if seq.seq_id not in live:
                continue
            _, left, is_session = live[seq.seq_id]
            if left <= 1:
                del live[seq.seq_id]
                s.finish(seq, keep_cache=is_session)
                if is_session:
                    sessions.append(seq)
            else:
                live[seq.seq_id] = (seq, left - 1, is_session)
        for sid in [k for k in live if rng.random() < 0.02]:  # random cancellations
            seq, _, is_session = live.pop(sid)
            s.finish(seq, keep_cache=is_session)
            if is_session:
                sessions.append(seq)
        if rng.random() < 0.05 and s.idle:  # evict an idle session's cache
            s.evict(next(iter(s.idle.values())))
        assert sum(1 for r in bm.ref_count if r > 0) + bm.num_free == bm.num_blocks
    for seq in sessions:
        s.finish(seq)
    assert not s.running and not s.waiting
    assert bm.num_free == bm.num_blocks and all(r == 0 for r in bm.ref_count)
    assert bm.hit_tokens > 0
