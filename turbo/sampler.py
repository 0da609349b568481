"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2020, nucleus sampling)."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """Pick a token id from float32 logits ``[vocab]``.

    ``temperature == 0`` is greedy (argmax). ``top_k > 0`` keeps the k most likely tokens, ``top_p < 1``
    the smallest set whose probability reaches ``top_p``; then sampling with ``generator``.
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
    return int(torch.multinomial(probs, 1, generator=generator))
