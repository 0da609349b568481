"""The torch reference backend's attention plans over the paged KV cache, derived once per step and reused by every
layer: the C++ kernel's inputs (:func:`paged_rows`), the SDPA / batched-decode jobs (:func:`attention_plan`), and
the ``batch_invariant`` attention that runs every query row alone (:func:`rowwise_attention`).
"""
from __future__ import annotations

import torch

from .kv_cache import PagedKVCache
from .types import AttentionMetadata


def paged_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the C++ ``paged_attention`` for a step: block tables int32 ``[num_seqs, max_blocks]`` (zero-padded),
    the sequence of every query row and the number of tokens it sees (causal: a row at position ``p`` sees ``p + 1``),
    int32 ``[T]`` each (the runner's device step plan when the metadata carries it)."""
    if meta.row_seq is not None:
        return meta.block_table, meta.row_seq, meta.row_ctx
    bs = meta.block_size
    nblocks = [(c + bs - 1) // bs for c in meta.context_lens]
    width = max(nblocks, default=1)
    tables = torch.tensor([list(meta.block_tables[b][:n]) + [0] * (width - n) for b, n in enumerate(nblocks)],
                          dtype=torch.int32)
    row_seq, row_len = [], []
    for b in range(meta.num_seqs):
        t, ctx = meta.query_start[b + 1] - meta.query_start[b], meta.context_lens[b]
        row_seq += [b] * t
        row_len += range(ctx - t + 1, ctx + 1)
    return tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32)


def attention_plan(meta: AttentionMetadata, bs: int, device: torch.device):
    """Per step: (single-sequence jobs, batched-decode job or None) for the torch path (no C++ extension, an
    int8/int4 cache; not ``batch_invariant``, which runs :func:`rowwise_attention`)."""
    singles, dec = [], []
    for b in range(meta.num_seqs):
        qs, qe = meta.query_start[b], meta.query_start[b + 1]
        t, ctx = qe - qs, meta.context_lens[b]
        table = torch.tensor(meta.block_tables[b][:(ctx + bs - 1) // bs], dtype=torch.long)
        slots = (table.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:ctx]
        if t == 1:
            dec.append((qs, slots))
            continue
        mask = None
        if t < ctx:  # query j sits at position ctx - t + j and sees keys 0 .. ctx - t + j
            rows = torch.arange(t, device=device).unsqueeze(1) + (ctx - t)
            mask = torch.arange(ctx, device=device).unsqueeze(0) <= rows
        singles.append((qs, qe, slots.to(device), mask, t == ctx))
    decode = None
    # one decode row: SDPA on its exact context, no mask (`python bench/kernel_choices.py`: 50 vs 68 us at 64 tokens
    # of context, but 115 vs 73 us at 192: the matmul path wins for longer chats; not re-tuned yet)
    if len(dec) == 1:
        qs, slots = dec[0]
        singles.append((qs, qs + 1, slots.to(device), None, False))
    elif dec:
        length = max(len(sl) for _, sl in dec)
        idx = torch.empty(len(dec), length, dtype=torch.long)
        pad = torch.zeros(1, len(dec), 1, length, dtype=torch.bool)  # True = padding, masked out
        for i, (_, sl) in enumerate(dec):
            idx[i, :len(sl)] = sl
            idx[i, len(sl):] = sl[-1]  # pad with one of the row's own (written, finite) slots
            pad[0, i, 0, len(sl):] = True
        rows = torch.tensor([qs for qs, _ in dec], dtype=torch.long)
        decode = (rows.to(device), idx.to(device), pad.to(device))
    return singles, decode


def rowwise_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                       scale: float) -> torch.Tensor:
    """``batch_invariant`` attention: every query row ``[H, D]`` alone over exactly the keys it sees (a row at
    position ``p`` sees ``p + 1``), in float32, with the same operations and shapes whatever else the step holds (batched
    decode, chunked prefill, a recompute after preemption), so a token's numbers never depend on its batch: a
    GEMM's result may depend on its other dimensions (a padded reduction length changes bf16 blocking on some CPUs).
    K/V come from ``cache.gather`` in the space of ``cache.attention_query``. ``q [T, H, D]`` → ``[T, H, D]``."""
    plan = meta.scratch.get("torch_rowwise")
    if plan is None:
        bs, plan = meta.block_size, []
        for b in range(meta.num_seqs):
            qs, qe, ctx = meta.query_start[b], meta.query_start[b + 1], meta.context_lens[b]
            table = torch.tensor(meta.block_tables[b][:(ctx + bs - 1) // bs], dtype=torch.long)
            slots = (table.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:ctx]
            plan.append((qs, qe - qs, ctx, slots.to(q.device)))
        meta.scratch["torch_rowwise"] = plan
    t, h, d = q.shape
    out = q.new_empty(q.shape)
    for qs, rows, ctx, slots in plan:
        kb, vb = cache.gather(layer, slots)  # [KVH, ctx, D]
        # float32 throughout: exact for 16-bit inputs, and on a CPU small float32 matmuls are far cheaper than
        # bfloat16 ones (the bit-exact batching test in tests/test_batching.py took minutes with bf16 rows)
        kb, vb = kb.float(), vb.float()
        kvh = kb.shape[0]
        qf = q[qs:qs + rows].float()
        for j in range(rows):
            n = ctx - rows + j + 1
            k, v = kb[:, :n].contiguous(), vb[:, :n].contiguous()
            scores = torch.matmul(qf[j].view(kvh, h // kvh, d), k.transpose(-1, -2)).mul_(scale)  # [KVH, G, n]
            out[qs + j] = torch.matmul(torch.softmax(scores, dim=-1), v).reshape(h, d)
    return out
