"""Token sampling for all the rows of one engine step at once, on the logits' device.

Per row, in this order (as vLLM/transformers apply them): repetition penalty (Keskar et al. 2019, CTRL: divide
positive logits / multiply negative ones of tokens seen in prompt and output), presence and frequency penalties
(OpenAI API semantics, on generated tokens), logit bias (OpenAI's ``logit_bias``: added), banned ids masked to
-inf (the engine's min_new_tokens: stop ids), the tokens a constraint does not allow masked to -inf (``token_mask``:
a grammar's mask, :mod:`turbo.core.guided`),
the top log-probabilities of these logits when the row asks for them; then greedy (temperature 0: argmax) or
temperature → top-k → top-p (Holtzman et al. 2020) → min-p → a draw.

The draw is the exponential race: token ``argmax(p / q)`` with ``q = -log(u) ~ Exp(1)`` per token is token i with
probability p_i. Each row draws its ``q`` (V numbers per step) with its request's own generator on the logits'
device, so a request's tokens do not depend on what it is batched with and the same seed gives the same tokens.

The host only builds the penalty and mask indices (copied to the device); everything else runs on the device,
and :func:`sample_batch` makes one device→host transfer: a ``tolist()`` of the sampled ids, packed with the top
log-probabilities when a row asks for them (on the CPU, top-p also reads one bool: whether every row's nucleus lies
among its 64 largest logits, which spares a sort of the vocabulary, :func:`_nucleus`). :func:`apply_penalties`,
:func:`sample` and :func:`top_logprobs` are the one-row forms over the same code.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lite.formats import LiteturboError

_NEG_INF = float("-inf")


@dataclass
class RowSampling:
    """Sampling options and token history of one row (one request) of a step.

    ``prompt_ids`` only matter with a repetition penalty, ``output_ids`` with any penalty; ``banned_ids`` are
    masked to -inf before everything else (the engine passes the stop ids until min_new_tokens exist).
    ``logprobs``: also return the top-n log-probabilities. ``token_mask``: float32 ``[vocab]`` (CPU or the logits'
    device), 0 for the tokens a constraint allows and ``-inf`` for the others, added to the logits (``None``: all
    allowed). ``generator`` draws this row's random numbers; it
    must live on the logits' device (``None``: torch's default generator of that device). ``keep_state``: after this
    row's draw, keep the generator's state in ``state_after`` (a verify step sets it back to the state after the
    tokens it keeps, :mod:`turbo.core.speculative`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned_ids: Collection[int] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int = 0
    generator: torch.Generator | None = None
    token_mask: torch.Tensor | None = None
    keep_state: bool = False  # keep the generator's state after this row's draw in ``state_after`` (speculation)
    state_after: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, gen, **kwargs) -> "RowSampling":
        """The options of ``gen`` (a :class:`turbo.GenerationConfig` or anything with the same fields)."""
        return cls(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, min_p=gen.min_p,
                   repetition_penalty=gen.repetition_penalty, presence_penalty=gen.presence_penalty,
                   frequency_penalty=gen.frequency_penalty, logprobs=gen.logprobs,
                   logit_bias=getattr(gen, "logit_bias", None) or {}, **kwargs)

    @property
    def penalised(self) -> bool:
        """Whether the row's logits change before the draw (penalties or banned ids)."""
        return bool(self.repetition_penalty != 1.0 or (self.output_ids and (self.presence_penalty
                                                                            or self.frequency_penalty))
                    or self.banned_ids or self.logit_bias or self.token_mask is not None)


@dataclass
class Sampled:
    """The token picked for one row, and its top log-probabilities (natural log) when the row asked for them
    (tokens masked out, by a constraint or as banned ids, are left out: fewer than asked for then)."""

    token_id: int
    logprobs: list[tuple[int, float]] | None = None


def _penalise_(x: torch.Tensor, rows: Sequence[RowSampling]) -> None:
    """Apply the rows' penalties, logit biases and banned ids in place to float32 ``x [len(rows), vocab]``."""
    rep_r, rep_c, rep_v = [], [], []
    pf_r, pf_c, pf_n, pf_p, pf_f = [], [], [], [], []
    ban_r, ban_c = [], []
    bias_r, bias_c, bias_v = [], [], []
    for i, r in enumerate(rows):
        if r.logit_bias:
            bias_r += [i] * len(r.logit_bias)
            bias_c += r.logit_bias.keys()
            bias_v += r.logit_bias.values()
        if r.repetition_penalty != 1.0:
            seen = set(r.prompt_ids)
            seen.update(r.output_ids)
            rep_r += [i] * len(seen)
            rep_c += seen
            rep_v += [r.repetition_penalty] * len(seen)
        if r.output_ids and (r.presence_penalty or r.frequency_penalty):
            counts = Counter(r.output_ids)
            pf_r += [i] * len(counts)
            pf_c += counts.keys()
            pf_n += counts.values()
            pf_p += [r.presence_penalty] * len(counts)
            pf_f += [r.frequency_penalty] * len(counts)
        if r.banned_ids:
            ban_r += [i] * len(r.banned_ids)
            ban_c += r.banned_ids
    dev = x.device
    if rep_r:
        idx = torch.tensor([rep_r, rep_c], dtype=torch.long).to(dev)
        pen = torch.tensor(rep_v, dtype=torch.float32).to(dev)
        v = x[idx[0], idx[1]]
        x[idx[0], idx[1]] = torch.where(v > 0, v / pen, v * pen)
    if pf_r:
        idx = torch.tensor([pf_r, pf_c], dtype=torch.long).to(dev)
        val = torch.tensor([pf_n, pf_p, pf_f], dtype=torch.float32).to(dev)
        x[idx[0], idx[1]] -= val[2] * val[0] + val[1]  # presence + frequency x count, in float32
    if bias_r:  # OpenAI's logit_bias: added after the penalties
        idx = torch.tensor([bias_r, bias_c], dtype=torch.long).to(dev)
        x[idx[0], idx[1]] += torch.tensor(bias_v, dtype=torch.float32).to(dev)
    if ban_r:
        idx = torch.tensor([ban_r, ban_c], dtype=torch.long).to(dev)
        x[idx[0], idx[1]] = _NEG_INF
    masked = [i for i, r in enumerate(rows) if r.token_mask is not None]
    if masked:  # a constraint's mask: 0 where it allows a token, -inf elsewhere (+inf logits clamped first: no NaN)
        mask = torch.stack([rows[i].token_mask for i in masked]).to(dev, non_blocking=True)
        big = torch.finfo(torch.float32).max
        if len(masked) == len(rows):
            x.clamp_(max=big).add_(mask)
        else:
            sel = torch.tensor(masked, dtype=torch.long).to(dev)
            x[sel] = x.index_select(0, sel).clamp_(max=big).add_(mask)


def _top_logprobs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and ids of the ``k`` largest log-probabilities of each row of ``x``."""
    return torch.topk(torch.log_softmax(x, -1), k, dim=-1)


NUCLEUS_CANDIDATES = 64  # top-p looks at each row's 64 most likely tokens first (a full sort only when they fall short)


def _top_k_(s: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """``s`` with the logits below each row's k-th largest at ``-inf`` (``ks[i] == 0``: row i unchanged)."""
    dev = s.device
    k_t = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long).to(dev)
    kth = torch.topk(s, max(ks), dim=-1).values.gather(1, k_t[:, None])
    if not all(ks):
        on = torch.tensor([bool(k) for k in ks]).to(dev)
        kth = torch.where(on[:, None], kth, torch.full_like(kth, _NEG_INF))
    return s.masked_fill(s < kth, _NEG_INF)


def _nucleus_sorted(s: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by a full stable sort (ties by token id): ``s`` with the tokens outside each row's nucleus at -inf."""
    v, order = torch.sort(s, dim=-1, descending=True, stable=True)
    probs = torch.softmax(v, -1)
    v = v.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], _NEG_INF)
    return torch.full_like(s, _NEG_INF).scatter_(1, order, v)


def _nucleus(s: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``s`` (float32 ``[n, vocab]``) with the tokens outside each row's top-p nucleus at -inf: a token is dropped
    when the probability of the tokens before it (descending logits, ties by token id) already reaches ``top_p``, so
    the top token always stays (``top_p`` inf: nothing dropped). Exact: rows are decided on their
    :data:`NUCLEUS_CANDIDATES` largest logits when the tokens strictly above the smallest of them already hold
    ``top_p`` of the mass (every token of the nucleus is then among them, in the same order), by a full sort
    otherwise (:func:`_nucleus_sorted`); sorting 49k logits costs ~2 ms a row on a CPU, the candidates ~0.1 ms. On an
    accelerator, where a sort is cheap and the check would wait for the device, always the sort."""
    if s.device.type != "cpu":
        return _nucleus_sorted(s, top_p)
    n, vocab = s.shape
    c = min(NUCLEUS_CANDIDATES, vocab)
    probs = torch.softmax(s, -1)
    vals, idx = torch.topk(s, c, dim=-1)
    idx, perm = torch.sort(idx, dim=-1)  # by token id, then stably by value: the full sort's order
    vals, perm = torch.sort(vals.gather(1, perm), dim=-1, descending=True, stable=True)
    idx = idx.gather(1, perm)
    p = probs.gather(1, idx)
    cum = p.cumsum(-1)
    above = vals > vals[:, -1:]  # a prefix: the candidates strictly above the boundary value
    covered = (cum * above).amax(-1) >= top_p
    kept = torch.full_like(s, _NEG_INF).scatter_(1, idx, vals.masked_fill((cum - p) >= top_p[:, None], _NEG_INF))
    if bool(covered.all()):  # on the CPU: no device to wait for
        return kept
    miss = (~covered).nonzero().squeeze(1)
    kept[miss] = _nucleus_sorted(s.index_select(0, miss), top_p.index_select(0, miss))
    return kept


def _draw(s: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Token ids ``[len(rows)]`` drawn from float32 logits ``s`` (already divided by the temperature) after
    top-k, top-p and min-p."""
    n, vocab = s.shape
    dev = s.device
    ks = [r.top_k if 0 < r.top_k < vocab else 0 for r in rows]
    if any(ks):
        s = _top_k_(s, ks)
    if any(r.top_p < 1.0 for r in rows):
        top_p = torch.tensor([r.top_p if r.top_p < 1.0 else float("inf") for r in rows], dtype=torch.float32).to(dev)
        s = _nucleus(s, top_p)
    probs = torch.softmax(s, -1)
    if any(r.min_p > 0.0 for r in rows):
        min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32).to(dev)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    q = torch.empty((n, vocab), dtype=torch.float32, device=dev)
    for i, r in enumerate(rows):  # each row with its own generator, in vocabulary order: batch-independent
        q[i].uniform_(generator=r.generator)
        if r.keep_state and r.generator is not None:
            r.state_after = r.generator.get_state()
    q = q.log_().neg_()  # Exp(1) from u in [0, 1): q in (0, inf]; on CPU ~5x cheaper than exponential_
    return probs.div_(q).argmax(-1)


def sample_batch_device(logits: torch.Tensor, rows: Sequence[RowSampling], row_index: Sequence[int] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sample one token per row on the logits' device; no host synchronization.

    ``logits``: ``[N, vocab]``; ``row_index[i]`` is the row of ``logits`` that ``rows[i]`` samples from (default:
    row i). ``logits`` is not modified. Returns token ids ``[len(rows)]`` (long) and, when some row asks for
    log-probabilities, their values and ids ``[len(rows), max logprobs]`` (rows that did not ask hold junk)."""
    n = len(rows)
    if row_index is not None and list(row_index) != list(range(logits.shape[0])):
        x = logits.index_select(0, torch.tensor(row_index, dtype=torch.long).to(logits.device)).float()
    else:
        x = logits.float()
    if x.shape[0] != n:
        raise ValueError(f"{n} sampling rows for {x.shape[0]} rows of logits")
    dev = x.device
    if any(r.penalised for r in rows):
        if x is logits:
            x = x.clone()
        _penalise_(x, rows)
    lp_vals = lp_ids = None
    k = max((r.logprobs for r in rows), default=0)
    if k:
        lp_vals, lp_ids = _top_logprobs(x, k)
    # rows with NaN logits or nothing left to pick get token id -1 (no host sync here; sample_batch raises)
    bad = ~(x.amax(-1) > float("-inf"))  # amax propagates NaN, and NaN > -inf is False
    greedy = [i for i, r in enumerate(rows) if r.temperature <= 0.0]
    if len(greedy) == n:
        return x.argmax(-1).masked_fill_(bad, -1), lp_vals, lp_ids
    drawn = [i for i, r in enumerate(rows) if r.temperature > 0.0]
    sel = torch.tensor(drawn, dtype=torch.long).to(dev) if len(drawn) < n else None
    temp = torch.tensor([rows[i].temperature for i in drawn], dtype=torch.float32).to(dev)
    xs = x if sel is None else x.index_select(0, sel)
    s = xs / temp[:, None]
    # a temperature so small that finite logits overflow (inf, or every one -inf), or a penalty that made a logit
    # +inf (a tiny repetition_penalty), acts as its limit, greedy: the draw would see NaN probabilities, i.e. junk
    over = (~torch.isfinite(s) & torch.isfinite(xs)).any(-1) | torch.isposinf(xs).any(-1)
    s = torch.where(over[:, None], xs, s)
    picks = torch.where(over, xs.argmax(-1), _draw(s, [rows[i] for i in drawn]))
    if sel is None:
        return picks.masked_fill_(bad, -1), lp_vals, lp_ids
    tok = torch.empty(n, dtype=torch.long, device=dev)
    tok[sel] = picks
    g = torch.tensor(greedy, dtype=torch.long).to(dev)
    tok[g] = x.index_select(0, g).argmax(-1)
    return tok.masked_fill_(bad, -1), lp_vals, lp_ids


def sample_batch(logits: torch.Tensor, rows: Sequence[RowSampling], row_index: Sequence[int] | None = None
                 ) -> list[Sampled]:
    """:func:`sample_batch_device`, then one device→host transfer of the ids (and log-probabilities asked for)."""
    tok, lp_vals, lp_ids = sample_batch_device(logits, rows, row_index)
    if lp_vals is None:
        return _checked([Sampled(t) for t in tok.tolist()])
    # one transfer: ids packed beside the log-probabilities, exact in float32 while ids < 2**24
    vocab = logits.shape[-1]
    dtype = torch.float32 if vocab <= 2**24 else torch.float64
    packed = torch.cat([tok[:, None].to(dtype), lp_ids.to(dtype), lp_vals.to(dtype)], 1).tolist()
    k = lp_vals.shape[1]
    out = []
    for r, row in zip(rows, packed):
        n = r.logprobs
        # tokens that were masked out (a constraint, banned ids) have no probability: not alternatives
        lp = [(int(i), v) for i, v in zip(row[1:1 + n], row[1 + k:1 + k + n]) if v != _NEG_INF] if n else None
        out.append(Sampled(int(row[0]), lp))
    return _checked(out)


class SamplingError(LiteturboError):
    """A row could not be sampled; ``row`` is its index in the batch, ``reason`` says why and what to do."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(f"sampling row {row}: {reason}")
        self.row, self.reason = row, reason


def _checked(out: list[Sampled]) -> list[Sampled]:
    """Raise :class:`SamplingError` naming the first row whose logits were NaN or all ``-inf`` (token id -1)."""
    for i, o in enumerate(out):
        if o.token_id < 0:
            raise SamplingError(i, "the logits are NaN or all -inf (a numerical overflow in the model, e.g. "
                                   "float16 activations: try dtype='bfloat16' or 'float32'; a damaged checkpoint; or "
                                   "every token was banned)")
    return out


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> torch.Tensor:
    """Return penalised float32 logits ``[vocab]`` (a copy when any penalty is active)."""
    if repetition_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0:
        return logits
    x = logits.float().clone()
    _penalise_(x[None], [RowSampling(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty, prompt_ids=prompt_ids,
                                     output_ids=output_ids)])
    return x


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None, min_p: float = 0.0) -> int:
    """Pick a token id from float32 logits ``[vocab]`` (one row of :func:`sample_batch`).

    ``temperature == 0`` is greedy (argmax). ``top_k > 0`` keeps the k most likely tokens, ``top_p < 1``
    the smallest set whose probability reaches ``top_p``, ``min_p > 0`` the tokens with probability at
    least ``min_p`` times the top one's; then a draw with ``generator`` (on the logits' device).
    """
    row = RowSampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator)
    return sample_batch(logits[None], [row])[0].token_id


def top_logprobs(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens and their log-probabilities (natural log) under ``logits``."""
    v, i = _top_logprobs(logits.float(), n)
    return list(zip(i.tolist(), v.tolist()))
