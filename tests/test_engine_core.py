"""The engine core's public API (turbo/core): what sessions and the loop build on, the scheduler's post-step update, the
step data, start-up, and the rule that turbo/core imports nothing above it.

The model is a tiny random float32 Llama (2 layers, vocabulary 128) whose greedy output depends on its context, so a
wrong KV cache or a lost token shows in the generated ids.
"""
from __future__ import annotations

import ast
import math
import random
import threading
from pathlib import Path

import pytest
import torch

from lite.formats import LiteturboError
from turbo.config import EngineConfig, GenerationConfig
from turbo.core.block_manager import BlockManager, block_hashes
from turbo.core.detokenizer import IncrementalDetokenizer, StopStringMatcher
from turbo.core.engine import EngineCore
from turbo.core.request import GenerationOutput, Request, StepOutput, step_input
from turbo.core.scheduler import Scheduler, SchedulerOutput, Sequence, Status
from turbo.core.startup import EngineParts, start
from turbo.errors import InvalidRequest

BS = 8  # tokens per KV block of the test engines
CFG = dict(dtype="float32", max_kv_tokens=256, block_size=BS, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """Weights large enough that greedy decoding follows the context (no single token dominates); EOS id 1."""
    from tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("core") / "tiny", initializer_range=0.2, eos_token_id=1,
                            bos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def core(tiny_path):
    """The engine most tests share: 32 blocks of 8 tokens, 16 tokens per step (longer prompts are chunked)."""
    return EngineCore(tiny_path, EngineConfig(**CFG))


@pytest.fixture(scope="module")
def twin(tiny_path):
    """A second engine over the same weights (the target of import_kv)."""
    return EngineCore(tiny_path, EngineConfig(**CFG))


@pytest.fixture(scope="module")
def ref(tiny_path):
    """Stateless reference runs: no prefix cache, so every prompt is computed from scratch."""
    return EngineCore(tiny_path, EngineConfig(**CFG, enable_prefix_caching=False))


@pytest.fixture(autouse=True)
def _no_leaks(request):
    """Every test that uses a shared engine leaves it with no request and every block free."""
    yield
    leaks = []
    for name in ("core", "twin", "ref"):
        if name in request.fixturenames:
            e = request.getfixturevalue(name)
            st = e.stats()
            if (st["running"], st["waiting"], st["idle_sessions"]) != (0, 0, 0) or e.requests \
                    or st["blocks_free"] != st["blocks_total"]:
                leaks.append((name, st))
                # clean up, so that a failing test does not fail the ones after it
                for r in list(e.requests.values()):
                    e.cancel(r)
                for seq in list(e.scheduler.idle.values()):
                    e.drop_sequence(seq)
    assert leaks == []


def _ids(seed: int, n: int) -> list[int]:
    """``n`` token ids of ordinary words (ids 2..127: no [UNK], no EOS), different per seed."""
    rng = random.Random(seed)
    return [rng.randrange(2, 128) for _ in range(n)]


def _greedy(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, ignore_eos=True, **kw)


def _run(e: EngineCore, ids: list[int], gen: GenerationConfig) -> GenerationOutput:
    """A plain (stateless) request driven with add_request / step."""
    req = e.add_request(ids, gen)
    while not req.finished:
        e.step()
    return e.output(req)


def _turn(e: EngineCore, seq: Sequence, ids: list[int], gen: GenerationConfig) -> GenerationOutput:
    """One session turn on ``seq`` (as turbo.session does): keep the KV cache after it, drive it to its end."""
    req = e.add_request(ids, gen, seq=seq)
    req.keep_cache = True
    *_, out = e.drive(req)
    return out


def _blocks(n_tokens: int) -> int:
    return math.ceil(n_tokens / BS)


# --- the import rule ---------------------------------------------------------------------------------------------
FORBIDDEN = ("turbo.engine", "turbo.session", "turbo.loop", "turbo.serve", "turbo.engine_proc", "turbo.router",
             "turbo.remote", "turbo.cli", "turbo.plan")


def _imports(source: str, package: str) -> set[str]:
    """Every module an import statement in ``source`` (a module of ``package``) may load, with relative imports
    resolved and ``from X import name`` also counted as ``X.name`` (``from .. import engine`` imports a module)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[:len(parts) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_import_resolver_catches_every_spelling():
    """The checker below is not vacuous: each spelling of an upward import is resolved to the module it loads."""
    src = ("from ..engine import Engine\nfrom .. import session\nimport turbo.loop\nfrom turbo.serve.app import x\n"
           "from turbo import cli\ndef f():\n    from ...turbo.plan import y\n")
    found = {m for m in _imports(src, "turbo.core") if _under(m, FORBIDDEN)}
    assert {"turbo.engine", "turbo.session", "turbo.loop", "turbo.serve.app", "turbo.cli"} <= found
    assert _imports("from .scheduler import Sequence\nfrom ..config import EngineConfig\n", "turbo.core") == {
        "turbo.core.scheduler", "turbo.core.scheduler.Sequence", "turbo.config", "turbo.config.EngineConfig"}


def test_core_imports_nothing_above_it():
    """turbo/core imports, of turbo, only itself, turbo.config and turbo.errors; of lite, only lite.formats; never
    the engine, session, loop, serve, cli or plan layers (lazy imports inside functions included)."""
    root = Path(__file__).resolve().parents[1]
    core_dir = root / "turbo" / "core"
    files = sorted(core_dir.rglob("*.py"))
    assert len(files) >= 10
    bad = []
    for f in files:
        package = ".".join(f.parent.relative_to(root).parts)
        for mod in _imports(f.read_text(), package):
            if _under(mod, FORBIDDEN):
                bad.append(f"{f.relative_to(root)}: {mod}")
            elif _under(mod, ("turbo",)) and not _under(mod, ("turbo.core", "turbo.config", "turbo.errors")):
                bad.append(f"{f.relative_to(root)}: {mod}")
            elif _under(mod, ("lite",)) and not _under(mod, ("lite.formats",)):
                bad.append(f"{f.relative_to(root)}: {mod}")
    assert bad == []


# --- sequences and prompts -----------------------------------------------------------------------------------------
def test_new_sequence_is_fresh_and_its_id_unique(core):
    seqs = [core.new_sequence(priority=p % 3) for p in range(40)]
    req = core.add_request(_ids(1, 5), _greedy(1))  # add_request draws from the same ids
    ids = [s.seq_id for s in seqs] + [req.seq.seq_id]
    assert len(set(ids)) == len(ids)
    assert [s.priority for s in seqs[:4]] == [0, 1, 2, 0]
    s = seqs[0]
    assert (s.token_ids, s.num_computed, s.block_table, s.status) == ([], 0, [], Status.WAITING)
    assert s.token_ids is not seqs[1].token_ids and s.block_table is not seqs[1].block_table
    core.cancel(req)


def test_check_prompt_refusals(core):
    assert core.session_len == 256 and core.vocab_size == 128
    assert core.check_prompt([5] * 255) is None
    assert core.check_prompt([0, 127]) is None
    cases = [
        (([],), "the prompt is empty: give at least one token of text"),
        (([5, 128],), "token id 128 is outside the vocabulary (size 128)"),
        (([-1, 5],), "token id -1 is outside the vocabulary (size 128)"),
        (([5, 3.0],), "token id 3.0 is outside the vocabulary"),
        (([5] * 256,), "the prompt has 256 tokens but the context holds 256; shorten the prompt"),
        (([5] * 256, True), "the session would reach 256 tokens but session_len is 256; reset the session"),
    ]
    for args, msg in cases:
        with pytest.raises(InvalidRequest) as ei:
            core.check_prompt(*args)
        assert str(ei.value).startswith(msg), (args[0][:3], str(ei.value))
        assert isinstance(ei.value, LiteturboError) and ei.value.status == 400
    # add_request refuses through the same check and queues nothing
    before = core.stats()
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        core.add_request([5, 999], _greedy(1))
    assert core.num_waiting == 0 and core.requests == {} and core.stats()["blocks_free"] == before["blocks_free"]


# --- drive ---------------------------------------------------------------------------------------------------------
def test_drive_yields_pieces_then_the_output_and_equals_a_stepped_run(core, ref):
    ids = _ids(2, 40)  # 40 tokens at 16 per step: two prompt chunks, then the step that samples
    c0 = core.stats()
    req = core.add_request(ids, _greedy(6))
    items = list(core.drive(req, every_step=True))
    out = items[-1]
    pieces = items[:-1]
    assert isinstance(out, GenerationOutput) and all(isinstance(p, str) for p in pieces)
    assert len(pieces) == 2 + 6  # every_step: one item per step, "" for the two chunk steps
    assert pieces[:2] == ["", ""] and all(pieces[2:])
    assert "".join(pieces) == out.text
    assert (len(out.token_ids), out.finish_reason, out.prompt_tokens, out.cached_tokens) == (6, "length", 40, 0)
    assert req.seq.token_ids == ids + out.token_ids
    c1 = core.stats()
    assert c1["steps"] - c0["steps"] == 8
    assert c1["prefill_tokens"] - c0["prefill_tokens"] == 40 and c1["last_prefill_tokens"] == 40
    assert c1["decode_tokens"] - c0["decode_tokens"] == 5
    assert c1["generated_tokens"] - c0["generated_tokens"] == 6
    # the same request stepped by hand (another engine, no prefix cache) gives the same ids and text
    plain = _run(ref, ids, _greedy(6))
    assert plain.token_ids == out.token_ids and plain.text == out.text
    # without every_step, text-less steps yield nothing
    again = list(ref.drive(ref.add_request(ids, _greedy(6))))
    assert all(again[:-1]) and "".join(again[:-1]) == out.text and again[-1].token_ids == out.token_ids


def test_drive_consumer_that_stops_early_cancels_and_frees_blocks(core):
    total = core.stats()["blocks_total"]
    req = core.add_request(_ids(3, 20), _greedy(50))
    it = core.drive(req)
    first = next(it)
    assert isinstance(first, str) and first
    assert core.stats()["running"] == 1 and core.stats()["blocks_free"] == total - _blocks(21)
    it.close()  # the consumer goes away
    assert req.finished and req.finish_reason == "cancelled"
    st = core.stats()
    assert st["running"] == 0 and st["blocks_free"] == total
    out = core.output(req)
    assert out.finish_reason == "cancelled" and out.text == first and len(out.token_ids) == 1
    assert req.seq.block_table == [] and req.seq.num_computed == 0


def test_drive_reraises_the_requests_error_and_frees_it_while_others_go_on(core, ref):
    good = core.add_request(_ids(40, 6), _greedy(3))
    # every token banned for the first step (stop ids under min_new_tokens): this request's sampling fails alone
    bad = core.add_request(_ids(41, 6), GenerationConfig(max_new_tokens=3, stop_token_ids=list(range(128)),
                                                          min_new_tokens=1))
    it = core.drive(bad)
    with pytest.raises(LiteturboError, match=rf"request {bad.seq.seq_id}: the logits are NaN or all -inf"):
        next(it)
    assert bad.finish_reason == "error" and bad.seq.block_table == []
    assert core.output(bad).finish_reason == "error" and core.output(bad).token_ids == []
    assert not good.finished and len(good.output_ids) == 1  # sampled in the same step
    assert core.stats()["blocks_free"] == core.stats()["blocks_total"] - _blocks(7)
    *_, out = core.drive(good)
    assert out.finish_reason == "length" and out.token_ids == _run(ref, _ids(40, 6), _greedy(3)).token_ids


# --- session sequences: drop, evict, continue ----------------------------------------------------------------------
def test_session_keeps_its_blocks_and_drop_sequence_frees_them(core):
    total = core.stats()["blocks_total"]
    seq = core.new_sequence()
    out = _turn(core, seq, _ids(4, 21), _greedy(5))
    # the last sampled token is not computed yet: 21 + 5 - 1 tokens in the cache
    assert seq.num_computed == 25 and seq.token_ids[21:] == out.token_ids
    assert len(seq.block_table) == _blocks(25) and seq.status == Status.IDLE
    st = core.stats()
    assert st["idle_sessions"] == 1 and st["running"] == 0 and st["blocks_free"] == total - _blocks(25)
    core.drop_sequence(seq)
    st = core.stats()
    assert st["idle_sessions"] == 0 and st["blocks_free"] == total
    assert (seq.block_table, seq.num_computed, seq.status) == ([], 0, Status.FINISHED)


def test_next_turn_reuses_the_resident_session_cache(core, ref):
    seq = core.new_sequence()
    _turn(core, seq, _ids(5, 19), _greedy(4))
    kept = seq.num_computed
    assert kept == 22
    ids2 = seq.token_ids + _ids(6, 7)
    out2 = _turn(core, seq, ids2, _greedy(5))
    assert out2.cached_tokens == kept  # the whole computed history, partial last block included
    assert out2.token_ids == _run(ref, ids2, _greedy(5)).token_ids
    core.drop_sequence(seq)


def test_evict_idle_only_frees_an_idle_session_and_keeps_its_tokens(core, ref):
    total = core.stats()["blocks_total"]
    assert core.evict_idle(core.new_sequence()) is False  # unknown to the scheduler
    # a running request is not idle: nothing is freed
    req = core.add_request(_ids(7, 10), _greedy(3))
    core.step()
    assert req.seq.status == Status.RUNNING and req.seq.block_table
    table = list(req.seq.block_table)
    assert core.evict_idle(req.seq) is False
    assert req.seq.block_table == table and req.seq.num_computed == 10
    core.cancel(req)
    # an idle session is evicted: blocks freed, tokens kept
    seq = core.new_sequence()
    _turn(core, seq, _ids(8, 30), _greedy(4))
    tokens, computed = list(seq.token_ids), seq.num_computed
    assert computed == 33 and core.stats()["blocks_free"] == total - _blocks(33)
    assert core.evict_idle(seq) is True
    assert seq.num_computed == 0 and seq.block_table == [] and seq.token_ids == tokens
    assert core.stats()["blocks_free"] == total
    # its next turn recomputes what was evicted (full blocks still come from the prefix cache): nothing is lost
    ids2 = tokens + _ids(9, 6)
    out2 = _turn(core, seq, ids2, _greedy(5))
    assert out2.cached_tokens == computed // BS * BS == 32
    assert out2.token_ids == _run(ref, ids2, _greedy(5)).token_ids
    core.drop_sequence(seq)


# --- KV export / import --------------------------------------------------------------------------------------------
def test_export_then_import_into_a_second_engine_continues_identically(core, twin, ref):
    assert core.kv_storage == twin.kv_storage == "float32"
    seq = core.new_sequence()
    _turn(core, seq, _ids(10, 27), _greedy(6))
    n = seq.num_computed
    assert n == 32
    kv = core.export_kv(seq)
    assert sorted(kv) == ["k.0", "k.1", "v.0", "v.1"]
    assert all(t.shape == (n, 2, 16) and t.dtype == torch.float32 and t.device.type == "cpu" for t in kv.values())
    assert all(t.abs().sum() > 0 for t in kv.values())

    seq2 = twin.new_sequence()
    seq2.token_ids = list(seq.token_ids)
    total = twin.stats()["blocks_total"]
    assert twin.import_kv(seq2, kv, n) is None
    assert seq2.num_computed == n and len(seq2.block_table) == _blocks(n) and seq2.status == Status.IDLE
    st = twin.stats()
    assert st["idle_sessions"] == 1 and st["blocks_free"] == total - _blocks(n)
    again = twin.export_kv(seq2)
    assert all(torch.equal(again[k], kv[k]) for k in kv)

    ids2 = seq.token_ids + _ids(11, 5)
    a = _turn(core, seq, ids2, _greedy(6, logprobs=3))
    b = _turn(twin, seq2, ids2, _greedy(6, logprobs=3))
    assert a.cached_tokens == b.cached_tokens == n  # the imported history was not recomputed
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids == _run(ref, ids2, _greedy(6)).token_ids
    core.drop_sequence(seq)
    twin.drop_sequence(seq2)


def test_import_kv_of_another_shape_or_nan_returns_why_and_holds_nothing(core, twin):
    seq = core.new_sequence()
    _turn(core, seq, _ids(12, 12), _greedy(2))
    n = seq.num_computed
    kv = core.export_kv(seq)
    core.drop_sequence(seq)
    total = twin.stats()["blocks_total"]
    for bad, word in (({**kv, "v.1": kv["v.1"][:3]}, "v.1"), ({k: v for k, v in kv.items() if k != "k.0"}, "k.0"),
                      ({**kv, "k.1": kv["k.1"] * float("nan")}, "NaN")):
        seq2 = twin.new_sequence()
        seq2.token_ids = list(seq.token_ids)
        why = twin.import_kv(seq2, bad, n)
        assert isinstance(why, str) and word in why
        assert seq2.block_table == [] and seq2.num_computed == 0
        st = twin.stats()
        assert st["blocks_free"] == total and st["idle_sessions"] == 0


def test_import_kv_with_no_room_returns_why_and_holds_nothing(tiny_path, core):
    small = EngineCore(tiny_path, EngineConfig(dtype="float32", max_kv_tokens=32, block_size=BS))
    assert small.stats()["blocks_total"] == 4 and small.session_len == 32
    src = core.new_sequence()
    _turn(core, src, _ids(13, 15), _greedy(2))
    n = src.num_computed
    assert n == 16
    kv = core.export_kv(src)
    core.drop_sequence(src)
    # a running request holds 3 of the 4 blocks: 16 tokens (2 blocks) do not fit
    hog = small.add_request(_ids(14, 20), _greedy(5))
    small.step()
    assert small.stats()["blocks_free"] == 1 and small.stats()["running"] == 1
    seq = small.new_sequence()
    seq.token_ids = list(src.token_ids)
    assert small.import_kv(seq, kv, n) == "the KV pool has no room for it now"
    assert seq.block_table == [] and seq.num_computed == 0
    st = small.stats()
    assert st["blocks_free"] == 1 and st["idle_sessions"] == 0 and st["running"] == 1
    assert len(hog.seq.block_table) == 3 and hog.seq.num_computed == 20
    small.cancel(hog)
    assert small.import_kv(seq, kv, n) is None  # with room, the same sequence loads
    assert small.stats()["blocks_free"] == 2 and seq.num_computed == 16
    small.drop_sequence(seq)
    assert small.stats()["blocks_free"] == 4


# --- the queue and the lock ----------------------------------------------------------------------------------------
def test_num_waiting_counts_requests_queued_beyond_the_batch(core):
    reqs = [core.add_request(_ids(20 + i, 10), _greedy(3)) for i in range(3)]
    assert core.num_waiting == 3 == core.stats()["waiting"]
    core.step()  # 16 tokens: the first prompt whole, 6 of the second; the third waits
    assert core.num_waiting == 1 and core.stats()["running"] == 2
    assert [r.seq.num_computed for r in reqs] == [10, 6, 0]
    core.cancel(reqs[2])
    assert core.num_waiting == 0 and core.stats()["running"] == 2
    for r in reqs[:2]:
        core.cancel(r)


def test_lock_is_reentrant_and_guards_add_request(core):
    done = threading.Event()
    got = []

    def reenter():
        with core.lock:  # as the loop does: add and cancel while holding the lock
            r = core.add_request(_ids(30, 4), _greedy(1))
            got.append(core.num_waiting)
            core.cancel(r)
        done.set()

    t = threading.Thread(target=reenter, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set() and got == [1]

    other = threading.Thread(target=lambda: got.append(core.add_request(_ids(31, 4), _greedy(1))), daemon=True)
    with core.lock:
        other.start()
        other.join(0.3)
        assert other.is_alive() and core.num_waiting == 0  # blocked on the lock held here
    other.join(10)
    assert not other.is_alive() and core.num_waiting == 1
    core.cancel(got[-1])


# --- the scheduler's update and the step data (pure Python) --------------------------------------------------------
def test_update_from_output_advances_appends_registers_and_returns_rows_with_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=10)
    a = Sequence(seq_id=1, token_ids=list(range(6)))
    b = Sequence(seq_id=2, token_ids=list(range(100, 109)))
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [1, 2] and step.num_new_tokens == [6, 4]
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert step.sampled == [True, False]  # a is complete after the step; b computes a prompt chunk
    assert s.update_from_output(step, StepOutput({0: [7]})) == [0]
    assert (a.num_computed, b.num_computed) == (6, 4) and a.token_ids[-1] == 7
    ha, hb = block_hashes(a.token_ids, 4), block_hashes(b.token_ids, 4)
    assert bm.block_hash[:3] == [ha[0], None, hb[0]] and bm.cached == {ha[0]: 0, hb[0]: 2}
    step = s.schedule()
    assert [q.seq_id for q in step.seqs] == [1, 2] and step.num_new_tokens == [1, 5]
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    assert s.update_from_output(step, StepOutput({0: [8], 1: [9]})) == [0, 1]
    assert (a.num_computed, b.num_computed) == (7, 9) and (a.num_tokens, b.num_tokens) == (8, 10)
    assert bm.block_hash[1] is None and bm.block_hash[3] == hb[1] and bm.block_hash[4] is None
    assert bm.cached == {ha[0]: 0, hb[0]: 2, hb[1]: 3}
    assert s.update_from_output(SchedulerOutput([], [], []), StepOutput()) == []


def test_evict_if_idle_frees_only_an_idle_sequence():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(bm)
    seq = Sequence(seq_id=1, token_ids=list(range(6)))
    assert s.evict_if_idle(seq) is False  # never added
    s.add(seq)
    s.update_from_output(s.schedule(), StepOutput())
    assert seq.status == Status.RUNNING and seq.block_table == [0, 1]
    assert s.evict_if_idle(seq) is False and seq.block_table == [0, 1] and bm.num_free == 2
    seq.token_ids.append(9)
    s.finish(seq, keep_cache=True)
    assert seq.status == Status.IDLE and bm.num_free == 2
    assert s.evict_if_idle(seq) is True
    assert seq.block_table == [] and seq.num_computed == 0 and seq.token_ids == [0, 1, 2, 3, 4, 5, 9]
    assert list(bm.free_queue) == [2, 3, 1, 0]


def test_step_input_lays_out_tokens_slots_and_logits_rows():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(seq_id=1, token_ids=[10, 11, 12, 13, 14, 15], block_table=[5, 2])
    b = Sequence(seq_id=2, token_ids=[20, 21, 22, 23, 24], num_computed=4, block_table=[7, 0])
    si = step_input(SchedulerOutput([a, b], [6, 1], []), bm)
    assert si.token_ids == [10, 11, 12, 13, 14, 15, 24]
    assert si.positions == [0, 1, 2, 3, 4, 5, 4]
    assert si.slot_mapping == [20, 21, 22, 23, 8, 9, 0]
    assert si.query_start == [0, 6, 7] and si.context_lens == [6, 5]
    assert si.block_tables == [[5, 2], [7, 0]] and si.logits_rows == [5, 6]
    # a row with 2 drafts: its last real token and the drafts are computed, and all three rows' logits returned
    si = step_input(SchedulerOutput([b], [3], [], drafts=[[30, 31]]), bm)
    assert si.token_ids == [24, 30, 31] and si.positions == [4, 5, 6] and si.slot_mapping == [0, 1, 2]
    assert si.context_lens == [7] and si.logits_rows == [0, 1, 2]


def _request(tok, prompt: list[int], gen: GenerationConfig, stop_ids=frozenset({1})) -> Request:
    seq = Sequence(seq_id=0, token_ids=list(prompt))
    return Request(seq=seq, gen=gen, prompt_len=len(prompt), stop_ids=set(stop_ids),
                   detok=IncrementalDetokenizer(tok), stopper=StopStringMatcher(gen.stop), rng=None)


def test_request_append_token_end_and_output(core):
    tok = core.tokenizer
    the, of, and_ = tok.convert_tokens_to_ids(["the", "of", "and"])
    prompt = [5, 6, 7]
    # length: a one-character stop string holds back one character until the end releases it
    r = _request(tok, prompt, GenerationConfig(max_new_tokens=2, stop=["zz"]))
    assert r.append_token(the, [(the, -0.5)], 256) is None
    assert r.take_text() == "th" and r.t_first is not None
    assert r.append_token(of, None, 256) == "length"
    assert r.text == "the o" and r.output_ids == [the, of] and r.seq.token_ids == prompt  # the scheduler appends
    r.end("length")
    assert r.finished and r.text == "the of" and r.take_text() == "e of"
    out = r.output()
    assert (out.text, out.token_ids, out.finish_reason, out.prompt_tokens, out.cached_tokens) == (
        "the of", [the, of], "length", 3, 0)
    assert out.logprobs == [[(the, -0.5)]]
    # cancelled: what was held back is dropped
    r = _request(tok, prompt, GenerationConfig(max_new_tokens=5, stop=["zz"]))
    r.append_token(the, None, 256)
    r.append_token(of, None, 256)
    r.end("cancelled")
    assert r.output().text == "the o" and r.output().finish_reason == "cancelled"
    # a stop string cuts the text before it
    r = _request(tok, prompt, GenerationConfig(max_new_tokens=5, stop=["of"]))
    assert r.append_token(the, None, 256) is None
    assert r.append_token(of, None, 256) == "stop"
    r.end("stop")
    assert r.output().text == "the "
    # a stop id ends the request and adds no text
    r = _request(tok, prompt, GenerationConfig(max_new_tokens=5))
    assert r.append_token(the, None, 256) is None
    assert r.append_token(1, None, 256) == "stop"
    r.end("stop")
    assert r.output().text == "the" and r.output().token_ids == [the, 1]
    # the context: session_len tokens in the sequence
    r = _request(tok, prompt, GenerationConfig(max_new_tokens=50))
    assert r.append_token(the, None, 5) is None
    assert r.append_token(and_, None, 5) == "length"


# --- start-up ------------------------------------------------------------------------------------------------------
def test_start_builds_parts_consistent_with_the_engines_stats(tiny_path):
    cfg = EngineConfig(dtype="float32", max_kv_tokens=250, block_size=BS, max_num_batched_tokens=16,
                       max_batch_size=3)
    p = start(cfg, tiny_path)
    assert isinstance(p, EngineParts)
    assert p.path.resolve() == tiny_path.resolve()
    assert p.block_manager.num_blocks == 32 and p.block_manager.block_size == BS  # 250 tokens rounded up
    assert p.scheduler.bm is p.block_manager
    assert (p.scheduler.max_batch_size, p.scheduler.max_num_batched_tokens) == (3, 16)
    assert p.session_len == 256 and p.dtype == torch.float32 and p.model.dtype == torch.float32
    assert p.kv_cache_dtype == "float32" and p.kv_params is None
    assert p.runner.kv_cache.storage_key() == "float32"
    assert p.runner.kv_bytes == 32 * BS * 512  # 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes per token
    assert p.eos_token_ids == {1} and p.tokenizer.eos_token_id == 1
    assert p.model.cfg.vocab_size == 128 and p.backend.device.type == "cpu"
    assert p.workspace_bytes > 0

    e = EngineCore(tiny_path, cfg)
    st = e.stats()
    assert st["blocks_total"] == st["blocks_free"] == p.block_manager.num_blocks
    assert st["block_size"] == BS and st["kv_pool_tokens"] == 256
    assert st["kv_cache_bytes"] == p.runner.kv_bytes and st["kv_bytes_per_token"] == 512
    assert st["kv_cache_dtype"] == "float32" and st["kv_calibrated"] is False
    assert (e.session_len, e.vocab_size, e.kv_storage, e.eos_token_ids) == (256, 128, "float32", {1})
    assert e.workspace_bytes == p.workspace_bytes

    q = start(EngineConfig(dtype="float32", max_kv_tokens=256, block_size=BS, session_len=100,
                           kv_cache_dtype="int8"), tiny_path)
    assert q.session_len == 100 and q.kv_cache_dtype == "int8" and q.runner.kv_cache.storage_key() == "int8"
    assert q.runner.kv_cache.spec.bytes_per_token() == 2 * 2 * 2 * (16 + 3)  # int8 codes + scale/zero bytes
    with pytest.raises(LiteturboError, match=r"session_len=300 needs 300 tokens of KV cache but the pool"):
        start(EngineConfig(dtype="float32", max_kv_tokens=256, block_size=BS, session_len=300), tiny_path)
