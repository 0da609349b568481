"""Speculative decoding from history (model-free drafts), verified exactly at any temperature.

**Drafts.** A request with ``GenerationConfig(speculative=k)`` drafts up to ``k`` tokens per step from text it has
seen: the longest suffix of its tokens (at least :data:`MIN_MATCH`, at most :data:`MAX_MATCH` tokens) that occurred
earlier in its own history (:class:`SuffixIndex` over the sequence's tokens: its prompt, i.e. every earlier turn and
tool result of a session, and its output) or in the server's recent outputs (:class:`RecentOutputs`, bounded, per
engine), and the tokens that followed that occurrence are the draft (among equally long matches the one whose
whitespace also agrees, then the most recent; the request's own history wins a tie). This generalizes prompt lookup
(Saxena 2023; vLLM's ``ngram`` speculator: the last 3, then 2 tokens, the most recent match; kept as
:func:`propose_ngram`, drafter ``"ngram"``) toward suffix decoding (Oliaro et al. 2024, SuffixDecoding: a suffix
structure over prompts and past outputs, the longest match). Matches skip whitespace-only tokens
(:func:`whitespace_ids`: line breaks, indentation), so a text restated with another layout (a tool's compact JSON
written out indented, a re-indented code block) still matches its source, and a draft from such a source takes the
layout the request's output has been writing (:class:`Layout`: the whitespace it put between the same two tokens).
Under a constraint, the tokens the grammar forces next (a JSON schema's keys and punctuation: llguidance's
fast-forward tokens) are the draft when there are any, and other drafts are cut where the grammar refuses them. A
draft ends at a stop token (nothing after it is kept).

The draft length adapts per request (:class:`DraftState`) unless the match is at least :data:`LONG_MATCH` tokens
long (then up to ``k``): it grows by two after a step that kept every draft and shrinks by one after any other
(Hugging Face's assisted-generation heuristic), between 1 and ``k``; a request whose drafts keep failing pauses
drafting for a few steps. A step's drafts together stay within :data:`STEP_ROWS` rows beside its running requests
(:func:`share_budget`; the draft positions most likely to be kept first): in a large batch a step is compute-bound
and a draft row costs about what a real row does.

**Verification** (one forward of the last real token and the ``k`` drafts: ``k + 1`` logits rows): row ``j`` is
sampled as the ``j``-th next token would be without speculation, with the request's penalties (its output so far
plus ``drafts[:j]``), logit bias, banned ids, constraint mask at that position (:mod:`turbo.core.guided`), top-k /
top-p / min-p and temperature, and with the ``j``-th draw of the request's own generator (the exponential race of
:mod:`turbo.core.sampler`). The drafts equal to the sampled tokens are kept, then the first sampled token that
differs (or the one after the last draft): between 1 and ``k + 1`` tokens a step, and the generator is set back to
its state after the draws of the tokens kept, so each kept token consumed exactly one draw. Every kept token is
therefore the token non-speculative decoding samples at that position from the same logits and the same draw: the
output distribution is exactly the model's, at any temperature (for a point-mass draft ``d`` this is the standard
rejection rule, Leviathan et al. 2023 / Chen et al. 2023: ``d`` is accepted with probability ``p(d)`` and a rejection
draws from ``p`` without ``d``, renormalized). When the logits rows also equal the single-step ones
(``batch_invariant=True``; float32 up to its rounding), the same seed gives the same tokens with or without
speculation; in 16-bit a ``k + 1``-row forward can round differently from ``k + 1`` single steps and flip a near tie.

Pure functions and small state of a request's data: nothing here touches the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from .scheduler import Status

MIN_MATCH = 2  # the shortest suffix looked up
MAX_MATCH = 64  # the longest suffix compared (a longer match is as good)
LONG_MATCH = 4  # a match this long drafts the full length, whatever the acceptance so far
MAX_CANDIDATES = 64  # earlier occurrences of the last MIN_MATCH tokens examined, the most recent first
NGRAM_MAX = 3  # prompt lookup: the last 3, then 2 tokens
STEP_ROWS = 64  # a step verifies drafts while its rows (one per running request, plus drafts) stay within this
PAUSE_AFTER = 4  # draft steps in a row that accepted nothing before drafting pauses
PAUSE_STEPS = 8  # steps drafting pauses for


class SuffixIndex:
    """The positions of every :data:`MIN_MATCH`-token window of a growing token list, for longest-suffix lookups.

    ``tokens``: the list indexed (kept by reference: call :meth:`sync` after it grows; a list that shrank or changed
    is re-indexed). A token ``< 0`` is a separator: no window spans it and no draft crosses it. ``skip``: token ids
    matched as if absent (whitespace-only tokens, :func:`whitespace_ids`): a text restated with other line breaks
    or indentation (compact JSON written out indented, a code block re-indented) still matches its source, and an
    equally long match whose tokens agree with the context including those is preferred."""

    def __init__(self, tokens: list[int] | None = None, skip: frozenset[int] = frozenset()) -> None:
        self.tokens: list[int] = tokens if tokens is not None else []
        self.skip = skip
        self.kept: list[int] = []  # the position in ``tokens`` of every token not in ``skip``, in order
        self.grams: dict[tuple[int, int], list[int]] = {}  # window -> the count of kept tokens up to its end
        self.indexed = 0  # the length of ``tokens`` at the last sync (its windows are in ``grams``)
        self.last: int | None = None
        self.sync()

    def sync(self, tokens: list[int] | None = None) -> None:
        """Index the windows added since the last call (``tokens``: a new list to follow). A list that shrank or
        whose last indexed token changed is re-indexed from the start."""
        if tokens is not None:
            self.tokens = tokens
        toks, n = self.tokens, self.indexed
        if len(toks) < n or (n and toks[n - 1] != self.last):
            self.grams, self.kept, n = {}, [], 0
        grams, kept, skip = self.grams, self.kept, self.skip
        for i in range(n, len(toks)):
            if toks[i] in skip:
                continue
            kept.append(i)
            if len(kept) >= MIN_MATCH:
                a, b = toks[kept[-2]], toks[i]
                if a >= 0 and b >= 0:
                    grams.setdefault((a, b), []).append(len(kept))
        self.indexed = len(toks)
        self.last = toks[-1] if toks else None

    def match(self, context: list[int], k: int, own: bool = False) -> tuple[int, list[int]]:
        """``(match length, up to k tokens that followed it)`` for the longest suffix of ``context`` found in the
        indexed tokens, lengths counted without ``skip`` tokens (ties: the match agreeing with more of the context's
        last tokens as they are, then the most recent); ``(0, [])`` when none of at least :data:`MIN_MATCH` is.
        ``own``: ``context`` is the indexed list itself (its own tail is not a match; a continuation that runs into
        the tail repeats: the text is looping with that period). When ``context`` ends with ``skip`` tokens the
        draft starts after the source's own ones."""
        toks, kept, skip = self.tokens, self.kept, self.skip
        tail: list[int] = []  # the context's last tokens not in skip, latest first
        i = len(context) - 1
        while i >= 0 and len(tail) <= MAX_MATCH:
            if context[i] not in skip:
                tail.append(context[i])
            i -= 1
        if len(tail) < MIN_MATCH or k <= 0:
            return 0, []
        cands = self.grams.get((tail[1], tail[0]))
        if not cands:
            return 0, []
        spaced = context[-1] in skip
        best = (0, 0)
        best_at = -1
        limit = len(kept) if own else len(kept) + 1  # own: not the tail itself
        top_tail = len(tail) - (1 if own else 0)
        seen = 0
        for e in reversed(cands):
            if e >= limit:
                continue
            at = kept[e - 1] + 1  # where the source goes on
            if spaced:
                while at < len(toks) and toks[at] in skip:
                    at += 1
            if at >= len(toks) or toks[at] < 0:
                continue  # no continuation: the tail itself, or the end of an output
            seen += 1
            if seen > MAX_CANDIDATES:
                break
            n, top = MIN_MATCH, min(MAX_MATCH, e, top_tail)
            while n < top and toks[kept[e - 1 - n]] == tail[n] and tail[n] >= 0:
                n += 1
            if n < best[0]:
                continue
            x = 0  # the tokens before the continuation equal to the context's last ones, skip tokens included
            while x < 16 and x < at and x < len(context) and toks[at - 1 - x] == context[-1 - x]:
                x += 1
            if (n, x) > best:
                best, best_at = (n, x), at
                if n >= MAX_MATCH and x >= 16:
                    break
        if best_at < 0:
            return 0, []
        follow = toks[best_at:best_at + k]
        for j, t in enumerate(follow):
            if t < 0:
                follow = follow[:j]
                break
        else:
            if own and len(follow) < k and follow:  # the match reaches the tail: a loop, drafted on over its period
                period = follow
                follow = (period * (k // len(period) + 1))[:k]
        return (best[0], follow) if follow else (0, [])


def whitespace_ids(tokenizer) -> frozenset[int]:
    """The ids of ``tokenizer``'s tokens whose text is whitespace only (spaces, tabs, line breaks: 166 of SmolLM2's
    49,152): the :class:`SuffixIndex` ``skip`` set."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, s in enumerate(texts) if s and not s.strip())


class RecentOutputs:
    """The server's recent outputs (each finished request's generated tokens, separated), indexed for drafts;
    bounded: past ``capacity`` tokens the older half is dropped. ``skip``: as :class:`SuffixIndex`'s (settable:
    :meth:`set_skip`)."""

    def __init__(self, capacity: int = 65536, skip: frozenset[int] = frozenset()) -> None:
        self.capacity = capacity
        self.index = SuffixIndex(skip=skip)
        self.layout = Layout(skip)  # the whitespace the outputs put between tokens (a request's own layout wins)

    def set_skip(self, skip: frozenset[int]) -> None:
        """Match without ``skip`` tokens from now on (the outputs so far re-indexed, their layout re-read)."""
        if skip != self.index.skip:
            self.index = SuffixIndex(self.index.tokens, skip)
            self.layout = Layout(skip)
            self.layout.add(self.index.tokens)

    def add(self, token_ids: list[int]) -> None:
        """Remember one finished output (a few tokens or more)."""
        if len(token_ids) < MIN_MATCH + 1:
            return
        toks = self.index.tokens
        if self.index.skip:
            self.layout.add(token_ids[-self.capacity:])
        toks.extend(token_ids[-self.capacity:])
        toks.append(-1)
        if len(toks) > self.capacity:
            keep = toks[len(toks) - self.capacity // 2:]
            self.index = SuffixIndex(keep, self.index.skip)
            self.layout = Layout(self.index.skip)
            self.layout.add(keep)
        else:
            self.index.sync()

    def match(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """:meth:`SuffixIndex.match` over the recent outputs."""
        return self.index.match(context, k)


class Layout:
    """The whitespace a request's output puts between two tokens (line breaks, indentation: the ``skip`` tokens),
    learnt from its output, so that a draft restating a source with another layout (compact JSON written out
    indented) takes the output's: :meth:`apply`."""

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        self.between: dict[tuple[int, int], tuple[int, ...]] = {}  # (token, next non-skip token) -> skip tokens
        self.seen = 0  # the tokens read so far (of the list :meth:`learn` reads)
        self.prev: int | None = None  # the last non-skip token read
        self.run: list[int] = []  # the skip tokens read since

    def learn(self, tokens: list[int], start: int = 0) -> None:
        """Read ``tokens[max(start, tokens read so far):]`` (the request's output: ``start`` = its first position)."""
        self.read(tokens[max(start, self.seen):])
        self.seen = len(tokens)

    def add(self, output: list[int]) -> None:
        """Read one more whole output (the server's: :class:`RecentOutputs`)."""
        self.prev, self.run = None, []
        self.read(output)

    def read(self, tokens: list[int]) -> None:
        """Read ``tokens``, continuing the text read so far."""
        skip, between = self.skip, self.between
        for t in tokens:
            if t in skip:
                self.run.append(t)
                continue
            if self.prev is not None and t >= 0:
                between[(self.prev, t)] = tuple(self.run)
            self.prev, self.run = (t if t >= 0 else None), []

    def apply(self, context: list[int], draft: list[int], fallback: Layout | None = None) -> list[int]:
        """``draft`` (tokens that follow ``context``) with the skip tokens between two of its non-skip tokens (and
        between the context's last one and its first) replaced by those the output put between the same two, where
        it did, else those ``fallback`` (the server's outputs) did; the rest as it is."""
        skip, between = self.skip, self.between
        other = fallback.between if fallback is not None else {}
        if not (between or other) or not draft:
            return draft
        i = len(context) - 1
        while i >= 0 and context[i] in skip:
            i -= 1
        prev, done = (context[i] if i >= 0 else None), list(context[i + 1:])  # done: skip tokens already written
        out: list[int] = []
        run: list[int] = []
        for t in draft:
            if t in skip:
                run.append(t)
                continue
            want = None if prev is None else between.get((prev, t), other.get((prev, t)))
            if want is not None:
                run = list(want)
            if done:  # the context already wrote the first part of this run
                run = run[len(done):] if run[:len(done)] == done else []
                done = []
            out.extend(run)
            out.append(t)
            prev, run = t, []
        return out + run


@dataclass
class DraftState:
    """A request's drafting state: its own history's index, the current draft length and the acceptance record."""

    index: SuffixIndex | None = None
    length: int = 0  # current draft length (0: not started: the request's speculative)
    misses: int = 0  # draft steps in a row that accepted nothing
    paused: int = 0  # steps left without drafting
    rate: float = 0.5  # acceptance (kept / drafted), moving average over its verify steps
    layout: Layout | None = None  # the output's whitespace between tokens (drafts restated in it)

    def update(self, drafted: int, accepted: int, k: int) -> None:
        """Adapt after a verify step of ``drafted`` drafts of which ``accepted`` were kept (``k``: the maximum)."""
        self.rate = 0.8 * self.rate + 0.2 * (accepted / max(drafted, 1))
        if accepted == drafted:
            self.length = min(k, self.length + 2)
        else:
            self.length = max(1, self.length - 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= PAUSE_AFTER:
            self.paused, self.misses = PAUSE_STEPS, 0


def eligible(gen) -> bool:
    """Whether a request may speculate: it asks for it (every sampling option is verified exactly)."""
    return gen.speculative > 0


def propose_ngram(token_ids: list[int], k: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the most recent earlier occurrence of the last n tokens
    (n = :data:`NGRAM_MAX` down to :data:`MIN_MATCH`), ``[]`` when none matches."""
    size = len(token_ids)
    for n in range(NGRAM_MAX, MIN_MATCH - 1, -1):
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


def propose_suffix(state: DraftState, token_ids: list[int], k: int, recent: RecentOutputs | None,
                   skip: frozenset[int] = frozenset(), output_start: int | None = None) -> list[int]:
    """The tokens after the longest earlier match of the tail of ``token_ids`` in the request's own history or in
    ``recent`` (the server's outputs), ``[]`` when neither matches: up to ``k`` after a match of at least
    :data:`LONG_MATCH` tokens, else up to the request's current draft length. ``skip``: the tokens matched as if
    absent (:class:`SuffixIndex`), for the request's own index (made at its first call); with ``output_start``
    (the request's first output position) the draft's whitespace follows its output's :class:`Layout`."""
    if state.index is None:
        state.index = SuffixIndex(token_ids, skip)
        if skip and output_start is not None:
            state.layout = Layout(skip)
    else:
        state.index.sync(token_ids)
    n_own, own = state.index.match(token_ids, k + 4, own=True)  # a few more: the layout may drop some
    if recent is not None:
        n_srv, srv = recent.match(token_ids, k + 4)
        if n_srv > n_own:
            n_own, own = n_srv, srv
    if state.layout is not None and own:
        state.layout.learn(token_ids, output_start)
        own = state.layout.apply(token_ids, own, recent.layout if recent is not None else None)
    return own[:k] if n_own >= LONG_MATCH else own[:min(k, state.length or k)]


def draft(req, session_len: int, drafter: str = "suffix", recent: RecentOutputs | None = None,
          skip: frozenset[int] = frozenset()) -> list[int]:
    """The drafts to propose for the request ``req`` this step: up to its current draft length (fewer near its token
    limit or the context) when it speculates and is decoding, else ``[]``. ``drafter``: ``"suffix"`` (the default:
    :func:`propose_suffix`) or ``"ngram"`` (:func:`propose_ngram`, with the fixed length ``gen.speculative``)."""
    seq, gen = req.seq, req.gen
    if not (gen.speculative and req.output_ids and seq.status is Status.RUNNING
            and seq.num_computed == seq.num_tokens - 1):
        return []
    st = req.draft_state
    if st.paused:
        st.paused -= 1
        return []
    if st.length == 0:
        st.length = gen.speculative
    k = min(gen.speculative, gen.max_new_tokens - len(req.output_ids) - 1, session_len - seq.num_tokens - 1)
    if k <= 0:
        return []
    if req.guide is not None:
        forced = req.guide.forced_tokens()
        if forced:  # tokens the grammar forces next (a schema's keys and punctuation): kept whatever the logits
            return forced[:k]
    if drafter == "ngram":
        d = propose_ngram(seq.token_ids, k)
    else:
        d = propose_suffix(st, seq.token_ids, k, recent, skip, req.prompt_len)
    if d and req.guide is not None:  # a draft the grammar forbids ends there: the rest could never be kept
        d = d[:req.guide.valid_prefix(d)]
    for j, t in enumerate(d):  # nor is a token after a stop token
        if t in req.stop_ids:
            return d[:j + 1]
    return d


def share_budget(requests, drafts: dict[int, list[int]], num_running: int, rows: int | None = None) -> None:
    """Cut the step's drafts (``drafts``: request index -> its draft, cut in place) so that the rows the step
    computes for decoding, one per running request plus the drafts, stay within ``rows`` (default :data:`STEP_ROWS`):
    in a large batch a step is compute-bound and a draft row costs about what a real one does, so only drafts likely
    to be kept pay. The draft positions most likely to be kept are taken first: the j-th draft of a request whose
    acceptance so far is ``a`` is kept with probability about ``a ** j``."""
    budget = max(0, (STEP_ROWS if rows is None else rows) - num_running)
    if sum(len(d) for d in drafts.values()) <= budget:
        return
    ranked = sorted(((requests[i].draft_state.rate ** (j + 1), i, j) for i, d in drafts.items() for j in range(len(d))),
                    reverse=True)
    keep = {i: 0 for i in drafts}
    for _, i, j in ranked[:budget]:
        keep[i] = max(keep[i], j + 1)
    for i, d in drafts.items():
        del d[keep[i]:]


def accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions (``sampled[j]``: the token sampled after
    the real token and ``drafts[:j]``)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
