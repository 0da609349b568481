"""Step data: what the scheduler hands the model runner (:class:`StepInput`), what a computed and sampled step hands
back to the scheduler (:class:`StepOutput`), the engine-side state of one request (:class:`Request`: its sequence,
sampling options, detokenizer and stop-string matcher, the text released so far) and the result of a finished one
(:class:`GenerationOutput`). Plain dataclasses; :meth:`Request.append_token` holds the rules that end a request (stop
ids, stop strings, the token limit, the context).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .guided import Guide
from .scheduler import Sequence
from .speculative import DraftState


@dataclass
class StepInput:
    """What the model runner computes in one step (the scheduler → runner contract).

    For each sequence ``b``: tokens ``token_ids[query_start[b]:query_start[b+1]]`` at ``positions``, its
    block table, and the rows whose logits are returned (``logits_rows``).
    """

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]


@dataclass
class StepOutput:
    """What one step produced, by row of its :class:`~turbo.core.scheduler.SchedulerOutput` (the step → scheduler
    contract, read by :meth:`~turbo.core.scheduler.Scheduler.update_from_output`).

    ``new_token_ids[row]``: the tokens the row's sequence gets, in order: its accepted draft tokens, then the model's
    next token (cut after a token that ends the request). Rows absent computed a prompt chunk, or failed
    (``errors[row]``: the exception that ends the row's request). ``num_accepted[row]``: how many of its drafts the
    model agreed with (their K/V was computed in the step; rejected drafts' is dropped). ``logprobs[row]``: per new
    token, the top log-probabilities of the distribution it was sampled from, when the request asks for them.
    """

    new_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_accepted: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)


@dataclass
class GenerationOutput:
    """Result of one request: text, generated ids, why it stopped, and timings (seconds).

    text: exactly the streamed pieces joined (the one source of a reply's text, also stored in a session's
    history): cut before a stop string, special tokens skipped, and without an incomplete multi-byte character
    at the end (the token limit cut it; see :mod:`turbo.core.detokenizer`). A cancelled or failed request's text is
    what had been released when it ended (text held back as a possible stop-string start is dropped).
    finish_reason: ``stop`` (EOS, stop string or stop id), ``length`` (max_new_tokens or the context),
    ``cancelled``, ``error`` (the step or its sampling raised; the stream/generate call re-raises it).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    decode_seconds: float
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed after the first token (tokens/s)."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


@dataclass
class Request:
    """Engine-side state of one generation request over a :class:`Sequence`."""

    seq: Sequence
    gen: GenerationConfig
    prompt_len: int
    stop_ids: set[int]
    detok: IncrementalDetokenizer
    stopper: StopStringMatcher
    rng: torch.Generator | None
    keep_cache: bool = False
    guide: Guide | None = None  # the request's constraint (turbo.core.guided), None when free
    draft_state: DraftState = field(default_factory=DraftState)  # speculative drafting (turbo.core.speculative)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    text: str = ""  # all text released so far: the streamed pieces joined, and GenerationOutput.text
    finish_reason: str | None = None
    cached_tokens: int = -1
    error: BaseException | None = None  # why it finished with finish_reason "error"
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_end: float | None = None

    @property
    def finished(self) -> bool:
        """True once the request stopped (any reason)."""
        return self.finish_reason is not None

    def release(self, piece: str) -> None:
        """Publish ``piece`` of output text: it is streamed (:meth:`take_text`) and ends up in ``text``."""
        if piece:
            self.pending.append(piece)
            self.text += piece

    def take_text(self) -> str:
        """Text produced since the last call."""
        out = "".join(self.pending)
        self.pending.clear()
        return out

    def append_token(self, tok: int, logprobs: list[tuple[int, float]] | None, session_len: int) -> str | None:
        """Append the sampled ``tok`` (and its top log-probabilities) to the output and release its text; returns the
        finish reason when the request stops here (``stop``: a stop id, a stop string, or a constraint that is
        complete and takes no more tokens; ``length``: max_new_tokens or ``session_len`` tokens in the sequence),
        else ``None``. The sequence gets the token from the scheduler (``update_from_output``). Raises
        ``InvalidRequest`` when the request's constraint refuses ``tok``."""
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.output_ids.append(tok)
        if self.guide is not None:
            self.guide.consume(tok)
        if tok in self.stop_ids:
            return "stop"
        self.release(self.stopper.feed(self.detok.add(tok)))
        if self.stopper.stopped or (self.guide is not None and self.guide.stopped):
            return "stop"
        if len(self.output_ids) >= self.gen.max_new_tokens or self.prompt_len + len(self.output_ids) >= session_len:
            return "length"
        return None

    def end(self, reason: str) -> None:
        """Mark the request finished with ``reason``. Generation that ran to its end (``length``, ``stop``) releases
        what was held back (a possible stop-string start; an incomplete last character is dropped); a cancelled
        or failed request releases nothing more: its text stays what was already streamed."""
        self.finish_reason = reason
        self.t_end = time.perf_counter()
        if reason in ("length", "stop"):
            self.release(self.stopper.feed(self.detok.flush()))
            self.release(self.stopper.flush())

    def output(self) -> GenerationOutput:
        """The :class:`GenerationOutput` of this (finished) request."""
        t_first = self.t_first or self.t_end or self.t_arrival
        return GenerationOutput(text=self.text, token_ids=list(self.output_ids), finish_reason=self.finish_reason,
                                prompt_tokens=self.prompt_len, cached_tokens=max(self.cached_tokens, 0),
                                ttft=t_first - self.t_arrival, decode_seconds=(self.t_end or t_first) - t_first,
                                logprobs=list(self.logprobs))


def step_input(sched, block_manager) -> StepInput:
    """The :class:`StepInput` of a :class:`~turbo.core.scheduler.SchedulerOutput`: for each sequence its next ``n``
    tokens (its draft tokens after its history), their positions and KV slots (from its block table), its context
    length and the row of its last token (whose logits are sampled); a row with ``k`` drafts gets the logits rows
    of its last ``k + 1`` tokens."""
    ids, pos, slots, qs, ctx, tables, rows = [], [], [], [0], [], [], []
    for seq, n, drafts in zip(sched.seqs, sched.num_new_tokens, sched.drafts):
        s, e = seq.num_computed, seq.num_computed + n
        ids += (seq.token_ids + drafts)[s:e] if drafts else seq.token_ids[s:e]
        pos += range(s, e)
        slots += block_manager.slots(seq.block_table, s, e)
        qs.append(qs[-1] + n)
        ctx.append(e)
        tables.append(seq.block_table)
        rows.extend(range(qs[-1] - 1 - len(drafts), qs[-1]))
    return StepInput(ids, pos, slots, qs, ctx, tables, rows)
