"""Speculative decoding from the request's own history (prompt lookup, model-free): draft tokens, then verify them.

A greedy request with ``GenerationConfig(speculative=k)`` drafts up to ``k`` tokens per step: the last ``n`` tokens
(``n`` from :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`) are looked up in its earlier tokens (prompt and output, the
most recent match first) and the tokens that followed that match are the draft (Saxena 2023, "prompt lookup
decoding"; vLLM's ``ngram`` speculator). The engine appends the draft to the sequence
(``Sequence.num_drafts``), computes it in the step with the last real token (``k + 1`` rows, one forward), and
keeps the drafted tokens the model's greedy choice agrees with, plus the model's own next token: between 1 and
``k + 1`` tokens a step. The KV of rejected drafts is dropped (never offered to the prefix cache). Greedy only:
the output is the model's greedy output (up to float rounding of a multi-row step, which can flip a near-tie).
"""
from __future__ import annotations

from .scheduler import Status

MAX_NGRAM = 3
MIN_NGRAM = 2


def eligible(gen) -> bool:
    """Whether a request with these options may speculate: greedy, no penalties, bias, constraint or logprobs."""
    return (gen.speculative > 0 and gen.temperature <= 0 and gen.repetition_penalty == 1.0
            and not gen.presence_penalty and not gen.frequency_penalty and not gen.logit_bias
            and not gen.constrained and not gen.logprobs)


def propose(token_ids: list[int], k: int) -> list[int]:
    """Up to ``k`` draft tokens: what followed the most recent earlier occurrence of the last n tokens (longest n
    first), ``[]`` when none matches."""
    size = len(token_ids)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if size <= n:
            continue
        tail = token_ids[size - n:]
        first = tail[0]
        for start in range(size - n - 1, -1, -1):  # the most recent match first; not the tail itself
            if token_ids[start] == first and token_ids[start:start + n] == tail:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return follow
    return []


def accepted(greedy: list[int], drafts: list[int]) -> int:
    """How many leading drafts the model's greedy choices agree with (``greedy[j]`` is its choice after the real
    token and ``drafts[:j]``)."""
    a = 0
    while a < len(drafts) and greedy[a] == drafts[a]:
        a += 1
    return a


def propose_drafts(core) -> list:
    """Append prompt-lookup drafts to the running, decoding sequences of ``core``'s speculating requests (room in the
    pool permitting: drafts never push anything out); returns those sequences."""
    drafted = []
    for req in core.requests.values():
        seq, gen = req.seq, req.gen
        if not (gen.speculative and eligible(gen) and req.output_ids and seq.status is Status.RUNNING
                and seq.num_computed == seq.num_tokens - 1 and len(req.output_ids) >= gen.min_new_tokens):
            continue
        k = min(gen.speculative, gen.max_new_tokens - len(req.output_ids) - 1, core.session_len - seq.num_tokens - 1)
        if k <= 0 or not core.block_manager.can_allocate(seq.block_table, seq.num_tokens + k):
            continue
        drafts = propose(seq.token_ids, k)
        if drafts:
            seq.token_ids.extend(drafts)
            seq.num_drafts = len(drafts)
            drafted.append(seq)
    return drafted


def fit_drafts(sched, drafted: list) -> None:
    """Drop the drafts a step does not compute: all of an unscheduled (or preempted) sequence's, and those past the
    tokens the step's budget gave a scheduled one."""
    scheduled = {id(s): n for s, n in zip(sched.seqs, sched.num_new_tokens)}
    for seq in drafted:
        keep = min(seq.num_drafts, scheduled[id(seq)] - 1) if id(seq) in scheduled else 0
        if keep < seq.num_drafts:
            del seq.token_ids[len(seq.token_ids) - (seq.num_drafts - keep):]
            seq.num_drafts = keep


def verify_drafts(core, logits, row: int, req) -> None:
    """Keep the drafts of ``req`` that the model's greedy choices (``logits[row:row + drafts + 1]``) agree with, and
    its next token after them; append them (stop rules apply per token); free the rejected drafts' KV."""
    seq = req.seq
    m = seq.num_drafts
    base = len(seq.token_ids) - m
    drafts = seq.token_ids[base:]
    greedy = logits[row:row + m + 1].argmax(-1).tolist()
    a = accepted(greedy, drafts)
    del seq.token_ids[base:]
    seq.num_drafts, seq.num_computed = 0, base
    c = core.counters
    c["spec_steps"] += 1
    c["spec_drafted"] += m
    c["spec_accepted"] += a
    reason = None
    for j, tok in enumerate(drafts[:a] + [greedy[a]]):
        c["generated_tokens"] += 1
        c["decode_tokens"] += 1
        reason = req.append_token(tok, None, core.session_len)
        if j < a:
            seq.num_computed += 1  # a kept draft: its KV was computed in this step
        if reason is not None:
            break
    seq.num_computed = core.block_manager.truncate(seq.block_table, seq.num_computed)
    core.block_manager.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed)
    if reason is not None:
        core._finish(req, reason)
