"""The paged decode attention kernel (``backends/triton/attention.py``) against float64, on fresh random inputs.

Without a GPU it runs in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``): the interpreter multiplies in
float32, but every number the GPU path computes differently from plain attention is exercised: the GQA group padded
to 16 rows, int4/int8 rows read as uint32 words with the magic-number codes (offset folded into the zero point),
bfloat16 queries scaled into float16 for int8, P rounded to the operand type, per-token scales folded into the
scores and into P, the zero points' share, exp2, the split-KV partials and their combine kernel, block tables that
straddle tiles. Outputs start as NaN (``kernels.POISON``), so an element the kernel
fails to write shows.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import KVCacheSpec, get_backend  # noqa: E402
from backends.kv_cache import PagedKVCache  # noqa: E402
from backends.types import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KVH = 2
# relative to the output's largest element: the 16-bit paths round P (and the output) to the query's type, and the
# interpreter rounds float32 -> bfloat16 by truncation (biased, unlike a GPU's round to nearest); float32: the codes'
# magic-number offset (128) cancels against the zero point's share, costing a few bits of float32
TOL = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    from backends.triton import kernels

    monkeypatch.setattr(kernels, "POISON", True)
    return kernels


def _attn():
    from backends.triton import attention

    return attention


def _cache(kv_dtype: str, block_size: int, n_blocks: int, head_dim: int, seed: int, kvh: int = KVH) -> PagedKVCache:
    """A one-layer pool filled with random keys (with a few outlier channels, as real keys have) and values through
    the reference write (the layout the Triton backend uses)."""
    cache = PagedKVCache(KVCacheSpec(kv_dtype, n_blocks, block_size, 1, kvh, head_dim), DEVICE, torch.float32)
    g = torch.Generator().manual_seed(seed)
    n = n_blocks * block_size
    k = torch.randn(n, kvh, head_dim, generator=g) * 2
    k[..., :3] *= 4
    v = torch.randn(n, kvh, head_dim, generator=g)
    cache.write(0, k.to(DEVICE), v.to(DEVICE), torch.arange(n, device=DEVICE))
    return cache


def _tables(ctxs, block_size, n_blocks, seed):
    """Random, non-adjacent block tables for sequences of ``ctxs`` tokens, as an int32 [B, max_blocks] tensor."""
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for c in ctxs:
        nblk = -(-c // block_size)
        tables.append(perm[used:used + nblk])
        used += nblk
    bt = torch.zeros(len(ctxs), max(len(t) for t in tables) + 1, dtype=torch.int32)  # a spare column: stride != width
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return tables, bt


def _reference(q, k_all, v_all, table, ctx, block_size, scale):
    """float64 attention of ``q [H, D]`` over the first ``ctx`` tokens of a sequence (grouped query heads)."""
    slots = (torch.tensor(table).unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[:ctx]
    keys, vals = k_all[slots], v_all[slots]  # [ctx, KVH, D]
    h, kvh = q.shape[0], keys.shape[1]
    kk = keys.repeat_interleave(h // kvh, 1)
    vv = vals.repeat_interleave(h // kvh, 1)
    s = torch.einsum("hd,thd->ht", q.double(), kk) * scale
    return torch.einsum("ht,thd->hd", torch.softmax(s, -1), vv)


def _quant(cache):
    return (cache.k_scale[0], cache.k_zero[0], cache.v_scale[0], cache.v_zero[0]) if cache.spec.quantized \
        else (None,) * 4


def _run_and_check(kv, dtype, group, head_dim, block_size, ctxs, seed, launches, block_n=None):
    attn = _attn()
    n_blocks = sum(-(-c // block_size) for c in ctxs) + 3
    cache = _cache(kv, block_size, n_blocks, head_dim, seed)
    k_all, v_all = (t.double().cpu() for t in cache.read(0, torch.arange(n_blocks * block_size, device=DEVICE)))
    tables, bt = _tables(ctxs, block_size, n_blocks, seed + 1)
    h = KVH * group
    t_rows = len(ctxs) + 2
    rows = [i for i in range(t_rows) if i not in (1, t_rows - 2)]  # rows 1 and t_rows - 2 must stay NaN
    q = torch.randn(t_rows, h, head_dim, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    kv_bits = cache.spec.bits if cache.spec.quantized else 16
    scale = head_dim ** -0.5
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    for partition, split in launches:
        out = torch.full((t_rows, h, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        attn.decode_attention(q.to(DEVICE), out, cache.k[0], cache.v[0], *_quant(cache), i32(rows),
                              i32(list(range(len(ctxs)))), i32(ctxs), bt.to(DEVICE), block_size, scale, kv_bits,
                              max_ctx=max(ctxs), partition=partition, split=split, block_n=block_n)
        got = out.cpu()
        for r, c, table in zip(rows, ctxs, tables):
            ref = _reference(q[r], k_all, v_all, table, c, block_size, scale)
            assert torch.isfinite(got[r]).all(), ("an output element was not written", kv, r, partition)
            err = ((got[r].double() - ref).abs().max() / ref.abs().max()).item()
            assert err < TOL[dtype], (kv, dtype, group, head_dim, block_size, r, c, partition, split, err)
        untouched = sorted(set(range(t_rows)) - set(rows))
        assert torch.isnan(got[untouched]).all()


# every GQA group 1-8, head dims 64 and 128, block sizes 64 (a tile inside one block) and 16 (tiles straddle blocks),
# query dtypes float32 / bfloat16 / float16, contexts ragged (not multiples of the block size or the tile)
CASES = [(1, 64, 64, torch.float32), (2, 128, 16, torch.bfloat16), (3, 64, 16, torch.float16),
         (4, 128, 64, torch.float32), (5, 64, 64, torch.bfloat16), (6, 128, 16, torch.float32),
         (7, 64, 16, torch.bfloat16), (8, 128, 64, torch.float16)]


@pytest.mark.e2e
@pytest.mark.parametrize("kv", ["16bit", "int8", "int4"])
@pytest.mark.parametrize("group,head_dim,block_size,dtype", CASES)
def test_decode_attention_matches_float64(kv, group, head_dim, block_size, dtype):
    if kv == "16bit":  # the cache holds the model's dtype (bfloat16 for float32 queries)
        kv = {torch.float32: "bfloat16", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    seed = group * 10 + head_dim
    # one program per (row, KV head); partitions of 64 tokens merged by the combine kernel; and one partition
    # forced through the split path (what batch_invariant does)
    _run_and_check(kv, dtype, group, head_dim, block_size, [1, 37, 93, 150], seed,
                   [(None, None), (64, None), (256, True)])


@pytest.mark.parametrize("kv,head_dim,group,dtype", [
    ("int4", 36, 3, torch.float32), ("int4", 16, 20, torch.float32), ("int8", 48, 2, torch.float32),
    ("int8", 30, 5, torch.bfloat16), ("float32", 40, 17, torch.float32), ("int4", 40, 4, torch.bfloat16)])
@pytest.mark.e2e
def test_decode_attention_odd_shapes(kv, head_dim, group, dtype):
    """Head dims that are not powers of two (rows that are not whole uint32 words: int4 with D = 36, int8 with
    D = 30 take the byte path; D = 16: the tile padded to 16 channels), GQA groups above 16 (two head blocks per KV
    head), and a small tile."""
    _run_and_check(kv, dtype, group, head_dim, 8, [5, 29, 40], group + head_dim, [(None, None), (16, None)],
                   block_n=16)


def test_decode_attention_rejects_split_without_partition():
    attn = _attn()
    cache = _cache("int4", 16, 2, 16, 0)
    q = torch.zeros(1, KVH, 16)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError):
        attn.decode_attention(q, torch.empty_like(q), cache.k[0], cache.v[0], *_quant(cache), i32([0]), i32([0]),
                              i32([3]), i32([[0]]), 16, 0.25, 4, max_ctx=3, partition=None, split=True)


@pytest.mark.parametrize("kv", ["bfloat16", "int4"])
def test_batch_invariant_row_alone_equals_row_in_batch(kv):
    """With ``batch_invariant`` a row's output is bit-for-bit the same alone and inside a batch of longer and
    shorter rows (the partition, the tiles and the path do not depend on the batch), through the backend."""
    bs, d, group = 16, 32, 4
    ctxs = [70, 5, 130, 33]
    n_blocks = sum(-(-c // bs) for c in ctxs) + 2
    cache = _cache(kv, bs, n_blocks, d, 7)
    tables, _ = _tables(ctxs, bs, n_blocks, 8)
    be = get_backend("triton", DEVICE, batch_invariant=True, attention_partition=64)
    q = torch.randn(len(ctxs), KVH * group, d, generator=torch.Generator().manual_seed(9))

    def step(idx):
        meta = AttentionMetadata(torch.zeros(len(idx), dtype=torch.long, device=DEVICE), list(range(len(idx) + 1)),
                                 [ctxs[i] for i in idx], [tables[i] for i in idx], bs)
        return be.attention(q[idx].to(DEVICE), cache, 0, meta, d ** -0.5).cpu()

    batch = step([0, 1, 2, 3])
    assert torch.isfinite(batch).all()
    for i in range(len(ctxs)):
        assert torch.equal(step([i])[0], batch[i]), i
    assert torch.equal(step([2, 0])[1], batch[0])


def test_backend_kernel_switch_old_and_new_agree():
    """``attention_kernel = "old"`` still reaches today's kernel (the static report's baseline); both agree."""
    bs, d, group = 8, 32, 3
    ctxs = [9, 21]
    n_blocks = sum(-(-c // bs) for c in ctxs) + 2
    cache = _cache("int4", bs, n_blocks, d, 11)
    tables, _ = _tables(ctxs, bs, n_blocks, 12)
    q = torch.randn(2, KVH * group, d, generator=torch.Generator().manual_seed(13))
    outs = {}
    for which in ("decode", "old"):
        be = get_backend("triton", DEVICE)
        be.attention_kernel = which
        meta = AttentionMetadata(torch.zeros(2, dtype=torch.long, device=DEVICE), [0, 1, 2], ctxs, tables, bs)
        outs[which] = be.attention(q.to(DEVICE), cache, 0, meta, d ** -0.5).cpu()
    assert torch.isfinite(outs["decode"]).all()
    assert (outs["decode"] - outs["old"]).abs().max().item() < 1e-4
