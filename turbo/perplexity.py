"""Perplexity through turbo's own model (so quantized checkpoints are scored by the kernels that run them).

Protocol (GPTQ, Frantar et al. 2023, Sec. 4; AWQ's ``eval``): tokenize the whole text once as raw text (with
the tokenizer's own special tokens, as ``Engine.encode``: a BOS at the very start where it adds one), cut it into
non-overlapping windows of ``seqlen`` tokens (the remainder is dropped), score every next-token prediction
inside each window, ``PPL = exp(mean over windows of the mean NLL)``.

Each window is computed in chunks of 512 tokens through the engine's paged KV cache: every token's attention
reads all earlier tokens' keys and values (its own chunk's included) back from the cache object, so with an
int8/int4 cache the score measures the quantized cache, not a 16-bit shortcut.
"""
from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from lite.formats import LiteturboError

from .core import StepInput
from .engine import Engine


def window_logits(engine: Engine, ids: list[int], chunk: int = 512):
    """Yield ``(logits [n, vocab], targets [n] int64)`` of one window, chunk by chunk over the paged KV cache (each
    chunk's attention reads the earlier chunks' keys and values back from the cache); the window's blocks are freed
    when the generator finishes or is closed."""
    table: list[int] = []
    bm = engine.block_manager
    try:
        bm.ensure_capacity(table, len(ids))
        for start in range(0, len(ids) - 1, chunk):
            end = min(start + chunk, len(ids))
            step = StepInput(token_ids=ids[start:end], positions=list(range(start, end)),
                             slot_mapping=bm.slots(table, start, end), query_start=[0, end - start],
                             context_lens=[end], block_tables=[table],
                             logits_rows=list(range(end - start)))
            targets = torch.tensor(ids[start + 1:end + 1], dtype=torch.long)
            yield engine.runner.run(step)[: len(targets)], targets
    finally:
        bm.free(table)


def window_nll(engine: Engine, ids: list[int], chunk: int = 512) -> float:
    """Mean next-token NLL (nats) of one window, computed in chunks over the paged KV cache."""
    total, n = 0.0, 0
    for logits, targets in window_logits(engine, ids, chunk):
        total += float(torch.nn.functional.cross_entropy(logits, targets.to(logits.device), reduction="sum"))
        n += len(targets)
    return total / n


def perplexity(engine: Engine, text: str, seqlen: int = 2048, max_windows: int | None = None,
               progress: bool = True) -> dict:
    """``{"ppl", "tokens", "windows", "seconds"}`` of ``text`` under ``engine``'s model.

    Raises ``LiteturboError`` when the text is shorter than one window or ``seqlen`` exceeds the KV pool.
    """
    if seqlen < 2:
        raise LiteturboError(f"--seqlen must be at least 2 tokens, got {seqlen}")
    if seqlen > engine.model.cfg.max_position_embeddings:
        raise LiteturboError(f"--seqlen {seqlen} exceeds the model's context of "
                             f"{engine.model.cfg.max_position_embeddings} tokens")
    if max_windows is not None and max_windows < 1:
        raise LiteturboError(f"--max-windows must be at least 1, got {max_windows} (leave it out to score all)")
    t0 = time.perf_counter()
    ids = engine.encode(text)
    n_win = len(ids) // seqlen
    if n_win == 0:
        raise LiteturboError(f"the text has {len(ids)} tokens, fewer than one window of --seqlen {seqlen}")
    if seqlen > engine.block_manager.num_blocks * engine.block_manager.block_size:
        raise LiteturboError(f"--seqlen {seqlen} exceeds the KV pool; raise max_kv_tokens")
    if max_windows:
        n_win = min(n_win, max_windows)
    nlls = [window_nll(engine, ids[i * seqlen:(i + 1) * seqlen])
            for i in tqdm(range(n_win), desc="perplexity", unit="window", disable=not progress)]
    return {"ppl": math.exp(sum(nlls) / len(nlls)), "tokens": n_win * seqlen, "windows": n_win,
            "seconds": time.perf_counter() - t0}
