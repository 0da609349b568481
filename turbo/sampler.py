"""Token sampling for one sequence: penalties, temperature, top-k, top-p (Holtzman et al. 2020), min-p.

Order (as vLLM/transformers apply them): repetition penalty (Keskar et al. 2019, CTRL: divide positive
logits / multiply negative ones of tokens seen so far), presence and frequency penalties (OpenAI API
semantics, on generated tokens), min_new_tokens (EOS masked), then greedy or temperature → top-k → top-p →
min-p → multinomial with the request's own generator (so the result does not depend on the batch).
"""
from __future__ import annotations

from collections import Counter

import torch


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> torch.Tensor:
    """Return penalised float32 logits ``[vocab]`` (a copy when any penalty is active)."""
    if repetition_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0:
        return logits
    x = logits.float().clone()
    if repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=x.device)
        if seen.numel():
            v = x[seen]
            x[seen] = torch.where(v > 0, v / repetition_penalty, v * repetition_penalty)
    if output_ids and (presence_penalty or frequency_penalty):
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long, device=x.device)
        cnt = torch.tensor([counts[i] for i in counts], dtype=torch.float32, device=x.device)
        x[ids] -= presence_penalty + frequency_penalty * cnt
    return x


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, min_p: float = 0.0) -> int:
    """Pick a token id from float32 logits ``[vocab]``.

    ``temperature == 0`` is greedy (argmax). ``top_k > 0`` keeps the k most likely tokens, ``top_p < 1``
    the smallest set whose probability reaches ``top_p``, ``min_p > 0`` the tokens with probability at
    least ``min_p`` times the top one's; then sampling with ``generator``.
    """
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    x = logits.float() / temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    probs = torch.softmax(x, -1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens and their log-probabilities (natural log) under ``logits``."""
    lp = torch.log_softmax(logits.float(), -1)
    v, i = torch.topk(lp, n)
    return list(zip(i.tolist(), v.tolist()))
