"""Decode steps through the CUDA-graph path's padded static buffers (turbo/core/cuda_graphs.py), run eagerly on the
CPU (``capture=False``): the logits of the real rows equal the plain step's, padded rows (repeats of row 0) write
nothing but the step's own slots, and buckets are chosen as documented. The capture itself needs a GPU (tests marked
``gpu``)."""
from __future__ import annotations

import pytest
import torch
from backends import KVCacheSpec, get_backend
from turbo.core.block_manager import BlockManager
from turbo.core.cuda_graphs import DecodeGraphs
from turbo.core.model import LlamaModel
from turbo.core.request import StepInput
from turbo.core.runner import ModelRunner

from conftest import usable_backends
from tiny_models import build_tiny_llama

BS, NUM_BLOCKS = 4, 24


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-graphs"), seed=1, intermediate_size=96,
                            max_position_embeddings=128, rms_norm_eps=1e-5)


def _step(seqs, bm, n_new):
    """StepInput computing the next ``n_new[i]`` tokens of each (token_ids, block_table, num_computed) in seqs."""
    ids, pos, slots, qs, ctx, tables, rows = [], [], [], [0], [], [], []
    for (toks, table, done), n in zip(seqs, n_new):
        bm.ensure_capacity(table, done + n)
        ids += toks[done:done + n]
        pos += range(done, done + n)
        slots += bm.slots(table, done, done + n)
        qs.append(qs[-1] + n)
        ctx.append(done + n)
        tables.append(list(table))
        rows.append(qs[-1] - 1)
    return StepInput(ids, pos, slots, qs, ctx, tables, rows)


def _cache_tensors(cache):
    return [t.clone() for t in (*cache.k, *cache.v)]


@pytest.mark.parametrize("backend", [b for b in ("torch", "triton") if b in usable_backends("cpu")])
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_padded_decode_equals_plain_step(tiny_path, backend, kv):
    be = get_backend(backend, "cpu")
    model = LlamaModel.from_pretrained(tiny_path, be, torch.float32)
    c = model.cfg
    runner = ModelRunner(model, KVCacheSpec(kv, NUM_BLOCKS, BS, c.num_layers, c.num_kv_heads, c.head_dim))
    graphs = DecodeGraphs(runner, max_context=40, max_batch=8, capture=False)
    bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, c.vocab_size, (n,), generator=g).tolist(), [], 0) for n in (5, 11, 2)]
    runner.run(_step(seqs, bm, [len(s[0]) - 1 for s in seqs]))  # prefill all but the last token
    seqs = [(t, tb, len(t) - 1) for t, tb, _ in seqs]
    step = _step(seqs, bm, [1, 1, 1])
    assert graphs.covers(step)
    before = _cache_tensors(runner.kv_cache)
    padded = graphs.run(step)  # bucket 4: one padded row
    after = _cache_tensors(runner.kv_cache)
    ids, pos, meta, rows = runner.prepare(step)
    plain = runner.model.forward(ids, pos, runner.kv_cache, meta, rows)
    assert padded.shape == plain.shape == (3, c.vocab_size)
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    # only the three decode slots changed: the padded row repeats row 0
    changed = set()
    for b, a in zip(before, after):  # [KVH, slots, ...]
        diff = (b != a).reshape(b.shape[0], b.shape[1], -1).any(-1).any(0)
        changed |= set(torch.nonzero(diff).flatten().tolist())
    assert changed and changed <= set(step.slot_mapping)


def test_buckets_and_bounds(tiny_path):
    be = get_backend("torch", "cpu")
    model = LlamaModel.from_pretrained(tiny_path, be, torch.float32)
    c = model.cfg
    runner = ModelRunner(model, KVCacheSpec("float32", NUM_BLOCKS, BS, c.num_layers, c.num_kv_heads, c.head_dim))
    graphs = DecodeGraphs(runner, max_context=16, max_batch=20, capture=False)
    assert graphs.buckets == [1, 2, 4, 8, 16, 20]
    one = StepInput([3], [4], [4], [0, 1], [5], [[0, 1]], [0])
    assert graphs.covers(one)
    assert not graphs.covers(StepInput([3, 4], [4, 5], [4, 5], [0, 2], [6], [[0, 1]], [1]))  # a 2-token chunk
    assert not graphs.covers(StepInput([3], [16], [16], [0, 1], [17], [[0, 1, 2, 3, 4]], [0]))  # past max_context


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_decode_graph_replays_equal_eager(tiny_path):
    from turbo import Engine, EngineConfig

    outs = {}
    for eager in (True, False):
        e = Engine(tiny_path, EngineConfig(device="cuda", dtype="float32", max_kv_tokens=512, enforce_eager=eager))
        outs[eager] = [o.token_ids for o in e.generate(["the of and", "to in a is that"], max_new_tokens=8,
                                                       ignore_eos=True)]
        if not eager:
            assert e.runner.graphs is not None and e.runner.graphs.replays > 0
    assert outs[True] == outs[False]
