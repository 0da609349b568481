"""Speculative decoding from the request's own history (prompt lookup, model-free): draft tokens, then verify them.

A greedy request with ``GenerationConfig(speculative=k)`` drafts up to ``k`` tokens per step: the last ``n`` tokens
(``n`` from :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`) are looked up in its earlier tokens (prompt and output, the
most recent match first) and the tokens that followed that match are the draft (Saxena 2023, "prompt lookup
decoding"; vLLM's ``ngram`` speculator). The engine proposes the draft as data on the sequence
(``Sequence.draft_ids``, :func:`draft`), the scheduler schedules it when the budget and pool allow
(``SchedulerOutput.drafts``), the step computes it with the last real token (``k + 1`` rows, one forward), and
:func:`verify` keeps the drafted tokens the model's greedy choice agrees with, plus the model's own next token:
between 1 and ``k + 1`` tokens a step. The scheduler rolls back the rejected drafts in ``update_from_output`` (their
KV is never offered to the prefix cache). Greedy only: the output is the model's greedy output (up to float rounding
of a multi-row step, which can flip a near-tie). Pure functions of a request's data: nothing here touches the engine.
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


def draft(req, session_len: int) -> list[int]:
    """The drafts to propose for the request ``req`` this step: up to ``gen.speculative`` tokens (fewer near its
    token limit or the context) when it may speculate and is decoding, else ``[]``."""
    seq, gen = req.seq, req.gen
    if not (gen.speculative and eligible(gen) and req.output_ids and seq.status is Status.RUNNING
            and seq.num_computed == seq.num_tokens - 1 and len(req.output_ids) >= gen.min_new_tokens):
        return []
    k = min(gen.speculative, gen.max_new_tokens - len(req.output_ids) - 1, session_len - seq.num_tokens - 1)
    return propose(seq.token_ids, k) if k > 0 else []


def verify(logits, row: int, drafts: list[int]) -> tuple[list[int], int]:
    """The tokens a row with ``drafts`` gets from its logits (``logits[row:row + len(drafts) + 1]``, float
    ``[rows, vocab]``): the drafts the model's greedy choices agree with, then its own next token; and how many
    drafts were accepted."""
    greedy = logits[row:row + len(drafts) + 1].argmax(-1).tolist()
    a = accepted(greedy, drafts)
    return drafts[:a] + [greedy[a]], a
