"""The scheduler driven by hand-built step outputs (no model, no runner, no torch), as vLLM's scheduler tests do:
admission, preemption, speculative drafts accepted and rejected, and the KV tiers' stores and restores, all as data
in :class:`~turbo.core.scheduler.SchedulerOutput` and :class:`~turbo.core.request.StepOutput`, with exact block ids."""
from __future__ import annotations

from turbo.core.block_manager import BlockManager
from turbo.core.request import StepOutput
from turbo.core.scheduler import KVLoad, KVStore, Scheduler, Sequence, Status


def _prefilled(s: Scheduler, seq: Sequence, token: int) -> None:
    """Admit ``seq``, compute its prompt in one step and give it ``token``."""
    s.add(seq)
    sched = s.schedule()
    assert sched.seqs == [seq] and sched.sampled == [True]
    assert s.update_from_output(sched, StepOutput({0: [token]})) == [0]


def test_the_scheduler_holds_no_callbacks_and_calls_nothing_back():
    s = Scheduler(BlockManager(4, 4), spill_kv=True, restore_kv=True)
    assert [k for k, v in vars(s).items() if callable(v)] == []


def test_admission_by_priority_within_batch_size_and_budget():
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(bm, max_batch_size=2, max_num_batched_tokens=10)
    low, high, third = (Sequence(seq_id=i, token_ids=list(range(10 * i, 10 * i + 6)), priority=p)
                        for i, p in ((1, 1), (2, 0), (3, 0)))
    for q in (low, high, third):
        s.add(q)
    sched = s.schedule()
    # priority 0 first (arrival breaks the tie); the budget of 10 leaves 4 tokens for the second: a prompt chunk
    assert [q.seq_id for q in sched.seqs] == [2, 3] and sched.num_new_tokens == [6, 4]
    assert sched.sampled == [True, False] and sched.drafts == [[], []]
    assert high.block_table == [0, 1] and third.block_table == [2] and low.status == Status.WAITING
    assert s.update_from_output(sched, StepOutput({0: [99]})) == [0]
    assert high.token_ids[-1] == 99 and (high.num_computed, third.num_computed) == (6, 4)
    sched = s.schedule()  # the batch is full (2): the low-priority one still waits
    assert [q.seq_id for q in sched.seqs] == [2, 3] and sched.num_new_tokens == [1, 2]
    assert third.block_table == [2, 3] and low.block_table == []


def test_preemption_frees_the_least_important_and_it_comes_back_from_the_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64, decode_reserve=0)  # the prompts fill it
    a = Sequence(seq_id=1, token_ids=list(range(8)), priority=0)
    b = Sequence(seq_id=2, token_ids=list(range(100, 108)), priority=1)
    s.add(a)
    s.add(b)
    sched = s.schedule()
    assert sched.num_new_tokens == [8, 8] and (a.block_table, b.block_table) == ([0, 1], [2, 3])
    s.update_from_output(sched, StepOutput({0: [8], 1: [108]}))
    sched = s.schedule()  # a's 9th token needs a block: b (less important) is preempted, a takes b's last block
    assert [q.seq_id for q in sched.seqs] == [1] and sched.preempted == [b] and sched.num_new_tokens == [1]
    assert a.block_table == [0, 1, 3] and b.block_table == [] and b.num_computed == 0
    assert b.status == Status.WAITING and b.num_preemptions == 1 and b.token_ids[-1] == 108  # its tokens stay
    s.update_from_output(sched, StepOutput({0: [9]}))
    s.finish(a)  # a ends: its blocks go back; b's first block is still in the prefix cache
    sched = s.schedule()
    assert [q.seq_id for q in sched.seqs] == [2] and b.block_table[0] == 2 and sched.num_new_tokens == [5]
    assert s.update_from_output(sched, StepOutput({0: [109]})) == [0] and b.num_computed == 9


def test_drafts_accepted_extend_the_sequence_and_keep_their_kv():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=16)
    a = Sequence(seq_id=1, token_ids=list(range(6)))
    _prefilled(s, a, 6)
    a.draft_ids = [7, 8, 9]
    sched = s.schedule()
    assert sched.num_new_tokens == [4] and sched.drafts == [[7, 8, 9]] and sched.sampled == [True]
    assert a.block_table == [0, 1, 2] and a.draft_ids == [] and a.token_ids == list(range(7))  # drafts are data
    # the model agreed with 2 drafts and then chose 42: 3 tokens, of which the 2 drafts' KV was computed
    assert s.update_from_output(sched, StepOutput({0: [7, 8, 42]}, num_accepted={0: 2})) == [0]
    assert a.token_ids == list(range(9)) + [42] and a.num_computed == 9 and a.block_table == [0, 1, 2]
    assert bm.block_hash[1] is not None and bm.block_hash[2] is None  # tokens 4..7 full: offered to the cache


def test_drafts_rejected_are_rolled_back_and_their_blocks_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=16)
    a = Sequence(seq_id=1, token_ids=list(range(7)))
    _prefilled(s, a, 7)  # 8 tokens, 7 computed
    a.draft_ids = [1, 2, 3]
    sched = s.schedule()
    assert sched.num_new_tokens == [4] and a.block_table == [0, 1, 2] and bm.num_free == 5
    assert s.update_from_output(sched, StepOutput({0: [5]}, num_accepted={0: 0})) == [0]
    assert a.token_ids == list(range(7)) + [7, 5] and a.num_computed == 8
    assert a.block_table == [0, 1] and bm.num_free == 6  # the drafts' block went back
    assert bm.block_hash[1] is not None  # tokens 4..7 (real) are full and cached; no draft ever is


def test_drafts_fit_the_budget_and_never_push_anything_out():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=3)
    a = Sequence(seq_id=1, token_ids=[1, 2, 3])
    _prefilled(s, a, 4)
    a.draft_ids = [5, 6, 7, 8]
    sched = s.schedule()
    assert sched.drafts == [[5, 6]] and sched.num_new_tokens == [3]  # a budget of 3: the real token + 2 drafts
    assert a.block_table == [0, 1]


def test_drafts_never_evict_an_idle_session():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=16)
    idle = Sequence(seq_id=2, token_ids=list(range(50, 58)))
    _prefilled(s, idle, 0)
    s.finish(idle, keep_cache=True)  # a session holding 2 blocks (8 tokens computed)
    a = Sequence(seq_id=1, token_ids=[1, 2, 3])
    _prefilled(s, a, 4)  # the last free block
    a.draft_ids = [5, 6, 7, 8]  # would need a second block
    sched = s.schedule()
    assert sched.drafts == [[]] and sched.num_new_tokens == [1] and idle.block_table == [0, 1]
    assert a.block_table == [2] and sched.kv_stores == []


def test_eviction_asks_the_engine_to_store_the_kv_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64, spill_kv=True)
    sess = Sequence(seq_id=1, token_ids=list(range(6)))
    _prefilled(s, sess, 6)
    s.finish(sess, keep_cache=True)
    new = Sequence(seq_id=2, token_ids=list(range(100, 112)))  # needs 3 blocks: the session's must go
    s.add(new)
    sched = s.schedule()
    assert sched.seqs == [new] and sess.block_table == [] and sess.num_computed == 0
    assert sched.kv_stores == [KVStore(sess, list(range(6)), [0, 1, 2, 3, 4, 5])]
    assert s.take_kv_stores() == []  # handed out once
    assert s.evict_if_idle(sess) is True and s.take_kv_stores() == []  # nothing computed: nothing to store


def test_a_session_stored_in_the_host_tier_is_loaded_back_at_admission():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64, spill_kv=True, restore_kv=True)
    sess = Sequence(seq_id=1, token_ids=list(range(6)))
    _prefilled(s, sess, 6)
    s.finish(sess, keep_cache=True)
    assert s.evict_if_idle(sess) and s.take_kv_stores()[0].token_ids == list(range(6))
    sess.host_kv = list(range(6))  # the engine kept it (HostTier.put sets this)
    sess.token_ids += [50, 51]  # the next turn
    s.add(sess)
    sched = s.schedule()
    load = KVLoad(sess, "host", 6, bm.slots(sess.block_table, 0, 6))
    assert sched.kv_loads == [load] and sched.num_new_tokens == [3] and sess.num_computed == 6
    assert len(sess.block_table) == 3 and load.slots == [4 * sess.block_table[0] + i for i in range(4)] + \
        [4 * sess.block_table[1], 4 * sess.block_table[1] + 1]


def test_a_failed_load_takes_the_sequence_out_and_it_recomputes_from_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64, restore_kv=True)
    sess = Sequence(seq_id=1, token_ids=list(range(6)))
    _prefilled(s, sess, 6)
    s.finish(sess, keep_cache=True)
    s.evict_if_idle(sess)
    sess.disk_kv = ("kv.safetensors", list(range(7)), (0, 0))  # its saved file holds all 7 tokens
    sess.token_ids += [60]
    s.add(sess)
    sched = s.schedule()
    assert [(ld.tier, ld.num_tokens) for ld in sched.kv_loads] == [("disk", 7)] and sched.num_new_tokens == [1]
    s.load_failed(sched, sess, "disk")  # the file was replaced
    assert sched.seqs == [] and sched.num_new_tokens == [] and sess.block_table == [] and sess.disk_kv is None
    assert s.waiting == [sess] and sess.status == Status.WAITING and bm.num_free == 8
    sched = s.schedule()
    assert sched.kv_loads == [] and sess.num_computed == 4 and sched.num_new_tokens == [4]  # block 0 was cached


def test_a_stored_copy_that_shares_nothing_is_dropped():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, restore_kv=True)
    seq = Sequence(seq_id=1, token_ids=[9, 9, 9])
    seq.host_kv = [1, 2, 3]
    s.add(seq)
    sched = s.schedule()
    assert sched.kv_loads == [KVLoad(seq, "host", 0, [])] and sched.num_new_tokens == [3]
