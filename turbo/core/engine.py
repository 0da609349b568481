"""The engine core: a persistent batch over a paged KV cache; requests are added, stepped, cancelled and read here.

``step()`` reads schedule → run → update, as vLLM v1's does: the :class:`~turbo.core.scheduler.Scheduler` returns a
:class:`~turbo.core.scheduler.SchedulerOutput` (which sequences compute how many tokens, the speculative drafts each
row verifies, the KV-tier stores and loads to carry out first); the engine carries out the moves, the
:class:`~turbo.core.runner.ModelRunner` computes the step as one flat batch and the rows are sampled in one batched
draw (:mod:`turbo.core.sampler`; drafts verified by :mod:`turbo.core.speculative`) into a
:class:`~turbo.core.request.StepOutput`; each request's stop rules cut its tokens (:meth:`Request.append_token
<turbo.core.request.Request.append_token>`, text released through :mod:`turbo.core.detokenizer`); and
:meth:`~turbo.core.scheduler.Scheduler.update_from_output` applies the output (rejected drafts rolled back). Counters
are one :class:`~turbo.core.counters.EngineCounters`. Start-up (loading, memory fitting, pool sizing) is
:mod:`turbo.core.startup`.

:class:`EngineCore` also offers what sessions and the background loop build on, so that they never reach into the
scheduler, block manager or runner: ``lock``, :meth:`~EngineCore.new_sequence`, :meth:`~EngineCore.drive`,
:meth:`~EngineCore.check_prompt`, :meth:`~EngineCore.drop_sequence`, :meth:`~EngineCore.evict_idle`,
:meth:`~EngineCore.export_kv`, :meth:`~EngineCore.import_kv`, :attr:`~EngineCore.num_waiting`,
:attr:`~EngineCore.dead` and :meth:`~EngineCore.close` (a tensor-parallel engine's workers, :mod:`turbo.core.tp`). It
imports nothing of ``turbo`` above this package but the configs and typed errors.
"""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from lite.formats import LiteturboError
from lite.formats.checkpoint import weight_files

from ..config import EngineConfig, GenerationConfig
from ..errors import EngineDead
from . import heap, inputs, speculative
from .counters import EngineCounters
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .guided import Guide, MaskJob
from .kv_tier import HostTier, load_saved_kv, prefix_kv, timed
from .request import GenerationOutput, Request, StepOutput, step_input
from .sampler import RowSampling, SamplingError, sample_batch
from .scheduler import KVLoad, KVStore, SchedulerOutput, Sequence
from .startup import engine_config, start


class EngineCore:
    """Load a model (name, or 16/32-bit or W4A16 checkpoint folder) and run requests on it: ``add_request``,
    ``step``, ``cancel``, ``output``, ``stats``. Raises ``LiteturboError`` for a bad model path, unsupported
    architecture, bad options, or a model or KV pool that cannot fit in the free memory."""

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = engine_config(config, kwargs)
        p = start(self.config, model)
        self.path, self.platform, self.backend, self.dtype = p.path, p.platform, p.backend, p.dtype
        self.model, self.tokenizer, self.runner = p.model, p.tokenizer, p.runner
        self.kv_cache_dtype, self.kv_params, self.workspace_bytes = p.kv_cache_dtype, p.kv_params, p.workspace_bytes
        self.block_manager, self.scheduler = p.block_manager, p.scheduler
        self.session_len, self.eos_token_ids = p.session_len, p.eos_token_ids
        self.thread_control = p.thread_control  # CPU threads under contention (backends/cpu_threads.py)
        # sessions' evicted KV in host memory, and saved on disk (turbo/core/kv_tier.py); one rank only
        self.host_tier = HostTier(int(self.config.session_host_gib * 2**30))
        if self.config.tensor_parallel_size == 1:  # the scheduler plans the tiers' stores and loads as step data
            self.scheduler.restore_kv = True
            self.scheduler.spill_kv = self.config.session_host_gib > 0
        self.requests: dict[int, Request] = {}
        # one step at a time: threads may share an engine (each drives steps for everyone until its own
        # request is done); the lock guards the scheduler, the block manager and the caches
        self.lock = threading.RLock()
        self._ids = itertools.count()
        self.counters = EngineCounters()
        # the server's recent outputs, drafted from by speculating requests (turbo/core/speculative.py)
        self.recent_outputs = (speculative.RecentOutputs(self.config.speculative_recent_tokens)
                               if self.config.speculative_recent_tokens > 0 else None)
        self._skip_ids: frozenset[int] | None = None  # whitespace-only tokens, matched as if absent (at first use)

    # --- requests --------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], gen: GenerationConfig | None = None, priority: int = 0,
                    seq: Sequence | None = None) -> Request:
        """Queue a request; ``seq`` continues an existing sequence (a session), reusing its computed prefix.

        A text prompt is raw text, tokenized by :meth:`encode` (with the tokenizer's own special tokens, e.g. a
        BOS); token ids are used as given. ``priority``: lower runs first (and is preempted last). Raises
        ``LiteturboError`` for a bad prompt, option or priority."""
        gen = GenerationConfig() if gen is None else gen
        if not isinstance(gen, GenerationConfig):
            raise LiteturboError(f"gen must be a GenerationConfig, got {type(gen).__name__}; use "
                                 f"GenerationConfig(**options) or pass the options as keywords")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise LiteturboError(f"priority must be an integer (lower runs first), got {priority!r}")
        if not isinstance(prompt, (str, list, tuple)):
            raise LiteturboError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        bad_bias = [t for t in gen.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise LiteturboError(f"logit_bias names token ids {sorted(bad_bias)[:3]} outside the vocabulary (size "
                                 f"{self.vocab_size})")
        bad = [t for t in gen.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise LiteturboError(f"stop_token_ids {bad[:3]} are outside the vocabulary (size {self.vocab_size})")
        guide = Guide(gen, self.tokenizer, self.vocab_size) if gen.constrained else None  # InvalidRequest if bad
        with self.lock:
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.check_prompt(ids, session=seq is not None)
            if seq is None:
                seq = self.new_sequence(priority)
                seq.after = self._prefilling(ids)
            else:
                seq.priority = priority
                self._keep_common(seq, ids, min(seq.num_computed, len(ids) - 1))
            seq.token_ids = ids
            seq.max_tokens = min(len(ids) + gen.max_new_tokens, self.session_len)  # admission's decode reserve
            rng = None
            if gen.temperature > 0:
                rng = torch.Generator(device=self.backend.device)  # the logits' device: sampling runs there
                rng.manual_seed(gen.seed if gen.seed is not None else int(torch.seed() % (2**63)))
            stop_ids = set(gen.stop_token_ids) | (set() if gen.ignore_eos else self.eos_token_ids)
            req = Request(seq=seq, gen=gen, prompt_len=len(ids), stop_ids=stop_ids,
                          detok=IncrementalDetokenizer(self.tokenizer), stopper=StopStringMatcher(gen.stop), rng=rng,
                          guide=guide)
            self.requests[seq.seq_id] = req
            self.scheduler.add(seq)
            return req

    def _keep_common(self, seq: Sequence, ids: list[int], limit: int) -> None:
        """Keep the KV of the first ``limit`` tokens at most that ``seq`` shares with ``ids``; free the blocks past."""
        common = 0
        while common < limit and seq.token_ids[common] == ids[common]:
            common += 1
        seq.num_computed = self.block_manager.truncate(seq.block_table, common)

    def rewind(self, seq: Sequence, token_ids: list[int]) -> None:
        """Put an idle session's token history back to ``token_ids`` (its history before a turn that was rolled
        back), keeping the KV of the tokens both share (but a last partial block now shared in the prefix cache)."""
        with self.lock:
            self._keep_common(seq, token_ids, min(seq.num_computed, len(token_ids)))
            seq.token_ids, seq.draft_ids = list(token_ids), []

    def prepare_constraint(self, gen: GenerationConfig) -> None:
        """Compile ``gen``'s constraint into the cache :meth:`add_request` copies from (see
        :func:`turbo.core.guided.compiled`), so that a caller holding the engine's lock, or the loop's thread, does not
        compile it. Raises ``InvalidRequest`` for a constraint that does not compile; nothing without one."""
        if isinstance(gen, GenerationConfig) and gen.constrained:
            Guide(gen, self.tokenizer, self.vocab_size)

    def _prefilling(self, ids: list[int]) -> Sequence | None:
        """A sequence still computing exactly the prompt ``ids`` (so a new request for it waits and then reuses its
        KV blocks from the prefix cache: the ``n`` choices of one request share the prompt's prefill), else
        ``None``. Only with prefix caching, and for prompts of at least one full block."""
        if not self.config.enable_prefix_caching or len(ids) <= self.block_manager.block_size:
            return None
        for req in self.requests.values():
            s = req.seq
            if s.num_computed < req.prompt_len and req.prompt_len == len(ids) and s.token_ids[:req.prompt_len] == ids:
                return s
        return None

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Stop a request now and free its blocks (a session keeps its computed tokens while memory allows). ``reason``
        is its finish reason: ``"cancelled"`` (stopped from outside: a session turn is then rolled back), or ``"stop"``
        (the caller ended a reply it reads, e.g. a repeated tool call). Cancelling a finished request does nothing; a
        request of another engine raises ``LiteturboError``."""
        if not isinstance(req, Request):
            raise LiteturboError(f"expected a Request from add_request, got {type(req).__name__}")
        if reason not in ("cancelled", "stop"):
            raise LiteturboError(f"reason must be 'cancelled' or 'stop', got {reason!r}")
        with self.lock:
            if req.finished:
                return
            if self.requests.get(req.seq.seq_id) is not req:
                raise LiteturboError("this request belongs to another Engine; cancel it there")
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.end(reason)
        if reason in ("stop", "length") and self.recent_outputs is not None:
            self.recent_outputs.add(req.output_ids)
        self.scheduler.finish(req.seq, keep_cache=req.keep_cache)
        self.requests.pop(req.seq.seq_id, None)

    def output(self, req: Request) -> GenerationOutput:
        """The :class:`GenerationOutput` of a finished request. Raises ``LiteturboError`` while it runs."""
        if not isinstance(req, Request):
            raise LiteturboError(f"expected a Request from add_request, got {type(req).__name__}")
        if not req.finished:
            raise LiteturboError("the request is still running: step the engine until req.finished (or cancel it)")
        return req.output()

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    # --- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule → KV-tier moves → run and sample (a :class:`StepOutput`) → stop rules → ``update_from_output``;
        returns the requests that got tokens or ended. A failed step ends its requests with ``"error"`` and raises."""
        with self.lock:
            if self.dead is not None:  # a tensor-parallel rank is gone: every request ends with the error
                self._fail_all(EngineDead(self.dead + "; the engine cannot continue: restart it"))
            t0 = time.perf_counter()
            self._propose_drafts()
            sched = self.scheduler.schedule()
            try:
                self._move_kv(sched)
                if not sched.seqs:
                    return self._refuse_unfittable(sched)
                out = self._execute(sched)
                rows = self._apply_stop_rules(sched, out)
                self.scheduler.update_from_output(sched, out)
            except BaseException as e:
                self._fail(sched, e)
                raise
            for req, reason in rows:
                if reason is not None:
                    self._finish(req, reason)
            self.counters.steps += 1
            self.counters.busy_seconds += time.perf_counter() - t0
            return [req for req, _ in rows]

    def _propose_drafts(self) -> None:
        """Drafts of speculating requests from their history and the server's recent outputs, as data on their
        sequences (the scheduler fits them)."""
        reqs = [r for r in self.requests.values() if r.gen.speculative]
        if reqs and self._skip_ids is None and self.config.speculative_drafter == "suffix":
            # once, ~0.3 s for a 49k vocabulary
            self._skip_ids = speculative.whitespace_ids(self.tokenizer) if self.tokenizer is not None else frozenset()
            if self.recent_outputs is not None:
                self.recent_outputs.set_skip(self._skip_ids)
        drafts = {i: speculative.draft(r, self.session_len, self.config.speculative_drafter, self.recent_outputs,
                                       self._skip_ids or frozenset())
                  for i, r in enumerate(reqs)}
        speculative.share_budget(reqs, drafts, len(self.scheduler.running))
        for i, r in enumerate(reqs):
            r.seq.draft_ids = drafts[i]

    def _execute(self, sched: SchedulerOutput) -> StepOutput:
        """Compute ``sched`` (one forward; constraints' masks on a CPU thread beside it) and sample its rows."""
        self._note_cache_hits(sched)
        self.thread_control.begin_step(len(sched.seqs), sched.total_tokens, sum(map(len, sched.drafts)))
        masks = self._start_masks(sched)
        logits = self.runner.run(step_input(sched, self.block_manager))
        allowed = {} if masks is None else masks.result()
        out = self._sample(logits, sched, allowed)
        self.thread_control.end_step()
        if masks is not None:
            self.counters.mask_rows += len(allowed)
            self.counters.mask_seconds += masks.compute_s
            self.counters.mask_wait_seconds += masks.wait_s
        return out

    def _refuse_unfittable(self, sched: SchedulerOutput) -> list[Request]:
        """Nothing was scheduled: a waiting request that does not fit even alone gets the error (raised to its
        owner, not to whoever stepped). Not when a failed load took the step's sequence out (it recomputes next)."""
        if not self.scheduler.waiting or sched.kv_loads:
            return []
        seq = next((s for s in self.scheduler.waiting if not s.held), self.scheduler.waiting[0])
        req = self.requests.get(seq.seq_id)
        if req is not None:
            req.error = LiteturboError(f"the KV cache ({self.block_manager.num_blocks} blocks of "
                                       f"{self.block_manager.block_size} tokens) cannot hold this request "
                                       f"({seq.num_tokens} tokens); raise max_kv_tokens or kv_cache_gib")
            self._finish(req, "error")
        return []

    def _fail_all(self, error: EngineDead) -> None:
        """End every request with ``error`` (the engine is dead) and raise it."""
        for req in list(self.requests.values()):
            if not req.finished:
                req.error = error
                self._finish(req, "error")
        raise error

    def _fail(self, sched: SchedulerOutput, error: BaseException) -> None:
        for seq in sched.seqs:
            req = self.requests.get(seq.seq_id)
            if req is not None and not req.finished:
                req.error = error
                self._finish(req, "error")

    def _note_cache_hits(self, sched: SchedulerOutput) -> None:
        for seq in sched.seqs:
            req = self.requests[seq.seq_id]
            if req.cached_tokens < 0:  # first step of the request: what the prefix cache (or a session) held
                req.cached_tokens = seq.num_computed

    def _start_masks(self, sched: SchedulerOutput) -> MaskJob | None:
        """The allowed-token masks of the step's constrained rows that will sample, started on a worker thread."""
        guides = [self.requests[seq.seq_id].guide if sampled else None
                  for seq, sampled in zip(sched.seqs, sched.sampled)]
        if not any(g is not None for g in guides):
            return None
        return MaskJob(guides, self.vocab_size, sched.drafts)

    def _sample(self, logits: torch.Tensor, sched: SchedulerOutput, masks: dict) -> StepOutput:
        """The :class:`StepOutput` of the step's sampled rows, from one batched draw on the logits' device (one host
        synchronization): a row with ``k`` drafts samples its ``k + 1`` positions as non-speculative decoding would
        (penalties over its output plus the drafts before, the constraint's mask at each position, its generator's
        next draws) and keeps the drafts equal to the sampled tokens plus the first sampled token that differs
        (:mod:`turbo.core.speculative`); its generator is set back to the state after the tokens kept. A request
        whose sampling fails alone gets its error. ``masks``: (step row, position) -> the tokens its constraint
        allows."""
        out, c = StepOutput(), self.counters
        first_row = list(itertools.accumulate((len(d) + 1 for d in sched.drafts), initial=0))
        plan, opts, rows = [], [], []
        for i, seq in enumerate(sched.seqs):
            if not sched.sampled[i]:
                continue
            req, d = self.requests[seq.seq_id], sched.drafts[i]
            if not req.output_ids:
                c.prefill_tokens += req.prompt_len - req.cached_tokens
                c.last_prefill_tokens = req.prompt_len - req.cached_tokens
            elif not d:
                c.decode_tokens += 1
            gen = req.gen
            prompt = req.seq.token_ids[:req.prompt_len] if gen.repetition_penalty != 1.0 else ()
            # the output a position sees only matters to penalties: copied with the drafts before it only then
            penalised = gen.repetition_penalty != 1.0 or gen.presence_penalty or gen.frequency_penalty
            plan.append((i, req, d, len(opts)))
            for j in range(len(d) + 1):
                hist = req.output_ids + d[:j] if j and penalised else req.output_ids
                n_out = len(req.output_ids) + j
                banned = req.stop_ids if n_out < gen.min_new_tokens and req.guide is None else ()
                opts.append(RowSampling.of(gen, generator=req.rng, output_ids=hist, prompt_ids=prompt,
                                           banned_ids=banned, token_mask=masks.get((i, j)), keep_state=bool(d)))
                rows.append(first_row[i] + j)
        if not plan:
            return out
        try:
            picks = sample_batch(logits, opts, rows)
        except Exception:  # some request's sampling failed: find it by sampling each request's rows alone
            picks = []
            for i, req, d, at in plan:
                picks += self._sample_alone(logits, rows[at:at + len(d) + 1], req, opts[at:at + len(d) + 1])
        for i, req, d, at in plan:
            got = picks[at:at + len(d) + 1]
            bad = next((p for p in got if isinstance(p, Exception)), None)
            if bad is not None:
                out.errors[i] = bad
                continue
            toks = [p.token_id for p in got]
            if d:
                a = speculative.accepted(toks, d)
                toks = toks[:a + 1]
                out.num_accepted[i] = a
                if req.rng is not None and opts[at + a].state_after is not None:
                    req.rng.set_state(opts[at + a].state_after)  # as if only the kept tokens were drawn
                req.draft_state.update(len(d), a, req.gen.speculative)
                c.spec_steps, c.spec_drafted, c.spec_accepted = (c.spec_steps + 1, c.spec_drafted + len(d),
                                                                 c.spec_accepted + a)
            out.new_token_ids[i] = toks
            if req.gen.logprobs:
                out.logprobs[i] = [p.logprobs for p in got[:len(toks)]]
        return out

    def _apply_stop_rules(self, sched: SchedulerOutput, out: StepOutput) -> list[tuple[Request, str | None]]:
        """Give each row's new tokens to its request (its stop rules: stop ids and strings, the token limit, the
        context, a constraint); a row's tokens are cut after the one that ends it. Returns (request, finish reason
        or ``None``) per row that got tokens or an error; a request whose sampling or constraint failed alone ends
        with that error."""
        rows = []
        for i in sorted({*out.new_token_ids, *out.errors}):
            req, toks, reason, j = self.requests[sched.seqs[i].seq_id], out.new_token_ids.get(i, []), None, 0
            try:
                if i in out.errors:
                    raise out.errors[i]
                for j, tok in enumerate(toks):
                    self.counters.generated_tokens += 1
                    self.counters.decode_tokens += i in out.num_accepted
                    lps = out.logprobs.get(i)
                    reason = req.append_token(tok, lps[j] if lps else None, self.session_len)
                    if reason is not None:
                        break
            except Exception as e:  # this request's sampling failed: it alone ends, with the error kept
                req.error, reason = e, "error"
            del toks[j + 1:]
            rows.append((req, reason))
        return rows

    @staticmethod
    def _sample_alone(logits: torch.Tensor, rows: list[int], req: Request, opts: list[RowSampling]) -> list:
        """One request's rows sampled on their own: their :class:`Sampled` picks, or its error for each row."""
        try:
            return sample_batch(logits, opts, rows)
        except SamplingError as e:
            err = LiteturboError(f"request {req.seq.seq_id}: {e.reason}")
        except Exception as e:  # noqa: BLE001 - this request alone fails
            err = e
        return [err] * len(rows)

    # --- the tiers of session KV ----------------------------------------------------------------------------
    def _move_kv(self, sched: SchedulerOutput) -> None:
        """Carry out the step's KV-tier moves before the run: the stores of evicted sessions first (their blocks may
        be reused by this step), then the loads into the blocks admission allocated; a load that fails goes back to
        the scheduler (the sequence leaves the step and recomputes)."""
        self._store_kv(sched.kv_stores)
        for load in sched.kv_loads:
            if not self._load_stored(load):
                self.scheduler.load_failed(sched, load.seq, load.tier)

    def _store_kv(self, stores: list[KVStore]) -> None:
        """Keep the K/V of evicted sessions' computed tokens in the host tier."""
        for st in stores:
            with timed(self.host_tier.counters, "spill_seconds"):
                kv = self.runner.export_kv(st.slots)
            self.host_tier.put(st.seq, st.token_ids, kv)

    def _load_stored(self, load: KVLoad) -> bool:
        """Load ``load``'s stored K/V (host tier, or the session's saved file) into its slots and offer the full
        blocks to the prefix cache; False when it is gone, replaced or of another shape."""
        seq, n, tier = load.seq, load.num_tokens, load.tier
        got = self.host_tier.take(seq.seq_id) if tier == "host" else load_saved_kv(*seq.disk_kv)
        if n == 0:  # the stored copy shares nothing with the sequence any more: dropped
            return True
        if got is None:
            return False
        with timed(self.host_tier.counters, f"{tier}_restore_seconds"):
            try:  # validates every tensor before writing any
                self.runner.import_kv(prefix_kv(got[1], n), load.slots)
            except ValueError as e:
                if isinstance(e, EngineDead):
                    raise
                return False
        self.block_manager.register_full_blocks(seq.token_ids, seq.block_table, n)
        self.host_tier.counters[f"{tier}_hits"] += 1
        del got
        heap.trim_heap()  # the stored copy read back (tens of MB) was freed: give its pages back
        return True

    # --- what sessions and the loop build on -------------------------------------------------------------
    def new_sequence(self, priority: int = 0) -> Sequence:
        """A fresh, empty :class:`Sequence` with an id unique in this engine."""
        return Sequence(seq_id=next(self._ids), priority=priority)

    def check_prompt(self, ids: list[int], session: bool = False) -> None:
        """Refuse an empty prompt, ids outside the vocabulary, or more tokens than ``session_len`` (see
        :func:`turbo.core.inputs.check_prompt`). Raises ``InvalidRequest``."""
        inputs.check_prompt(ids, self.session_len, self.vocab_size, session)

    def drive(self, req: Request, every_step: bool = False) -> Iterator[str | GenerationOutput]:
        """Step until ``req`` finishes, yielding its new text (``""`` after text-less steps if ``every_step``),
        then its :class:`GenerationOutput`. A consumer that goes away cancels the request (its blocks are freed
        at once); the request's error is re-raised."""
        try:
            while not req.finished:
                self.step()
                time.sleep(0)  # let other threads waiting on the engine lock in between steps
                text = req.take_text()
                if text or every_step:
                    yield text
            text = req.take_text()
            if text:
                yield text
        finally:
            self.cancel(req)
        if req.error is not None:
            raise req.error
        yield self.output(req)

    def drop_sequence(self, seq: Sequence) -> None:
        """Forget ``seq``'s place in the batch and free its blocks (a session's reset, close or failed turn)."""
        with self.lock:
            self.scheduler.finish(seq)
            self.host_tier.drop(seq.seq_id)

    def evict_idle(self, seq: Sequence) -> bool:
        """Free the KV blocks of ``seq`` if it is an idle session (its tokens stay, recomputed on its next turn);
        returns whether it was idle."""
        with self.lock:
            idle = self.scheduler.evict_if_idle(seq)
            self._store_kv(self.scheduler.take_kv_stores())
            return idle

    @property
    def num_waiting(self) -> int:
        """Requests queued beyond the running batch."""
        return len(self.scheduler.waiting)

    @property
    def vocab_size(self) -> int:
        """Tokens in the model's vocabulary."""
        return self.model.cfg.vocab_size

    @property
    def kv_storage(self) -> str:
        """How the KV cache stores values (e.g. ``bfloat16``, ``int8``): saved KV is reused only under the same."""
        return self.runner.kv_cache.storage_key()

    def export_kv(self, seq: Sequence) -> dict[str, torch.Tensor]:
        """The cached K/V of ``seq``'s computed tokens in the cache's stored form (per layer ``[tokens, kv_heads,
        ...]``: 16-bit values, or int8/int4 codes with their scales), for :meth:`import_kv`. With tensor parallelism,
        each rank's shard (its KV heads) under ``"rank{r}/..."`` (reused only at the same
        :attr:`tensor_parallel_size`). Raises :class:`~turbo.errors.EngineDead` when a rank is gone."""
        with self.lock:
            return self.runner.export_kv(self.block_manager.slots(seq.block_table, 0, seq.num_computed))

    def import_kv(self, seq: Sequence, kv: dict[str, torch.Tensor], n: int) -> str | None:
        """Load the first ``n`` tokens of ``seq`` (exported by :meth:`export_kv`) into fresh blocks and park it as an
        idle session. Returns ``None`` on success, or why it was not loaded (no room, tensors of another shape):
        then nothing is held and the tokens will be recomputed. Raises :class:`~turbo.errors.EngineDead` when a
        tensor-parallel rank is gone."""
        with self.lock:
            why = self._load_kv(seq, kv, n)
            if why is None:
                self.scheduler.finish(seq, keep_cache=True)
            return why

    def _load_kv(self, seq: Sequence, kv: dict[str, torch.Tensor], n: int) -> str | None:
        """Write exported K/V of ``seq``'s first ``n`` tokens into fresh blocks and mark them computed (offered to the
        prefix cache); or why not (no room, tensors of another shape), then nothing is held."""
        try:
            self.block_manager.ensure_capacity(seq.block_table, n)
        except Exception:
            self.block_manager.free(seq.block_table)
            return "the KV pool has no room for it now"
        try:  # validates every tensor before writing any
            self.runner.import_kv(kv, self.block_manager.slots(seq.block_table, 0, n))
        except ValueError as e:
            self.block_manager.free(seq.block_table)
            if isinstance(e, EngineDead):
                raise
            return str(e)
        seq.num_computed = n
        self.block_manager.register_full_blocks(seq.token_ids, seq.block_table, n)
        return None

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is split over (1: this process alone)."""
        return self.config.tensor_parallel_size

    @property
    def dead(self) -> str | None:
        """Why this engine can no longer run (a tensor-parallel worker died, naming its rank and exit code; a step
        failed part-way on the ranks; it was closed), else ``None``. Steps of a dead engine raise
        :class:`~turbo.errors.EngineDead`. Always ``None`` at ``tensor_parallel_size`` 1."""
        return self.runner.dead

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism; they also exit with this process). Nothing to do
        at ``tensor_parallel_size`` 1."""
        self.runner.close()

    # --- info ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: running/waiting requests, tokens prefilled/decoded, prefix-cache hits, blocks, tokens/s;
        constrained decoding's ``mask_rows`` (masks computed), ``mask_seconds`` (their CPU time, on a worker thread
        beside the forward) and ``mask_wait_seconds`` (what the steps waited for them); and the
        KV pool: ``kv_cache_dtype``, ``kv_calibrated``, ``kv_transform`` (none, rotated or calibrated:
        :attr:`backends.kv_cache.PagedKVCache.transform`), ``kv_bytes_per_token`` (all layers, K and V, scales
        included), ``kv_pool_tokens`` (tokens the pool holds), ``kv_cache_bytes``; ``tensor_parallel_size`` (the
        KV figures are then rank 0's, each rank holding its KV heads); the session KV tiers' ``host_tier_*`` figures
        (:meth:`turbo.core.kv_tier.HostTier.stats`: sessions and bytes in host memory, spills, host and disk hits,
        dropped, restore and spill seconds)."""
        c = self.counters.as_dict()
        bm, sch = self.block_manager, self.scheduler
        return dict(c, running=len(sch.running), waiting=len(sch.waiting), idle_sessions=len(sch.idle),
                    cache_hit_tokens=bm.hit_tokens, blocks_total=bm.num_blocks, blocks_free=bm.num_free,
                    block_size=bm.block_size, kv_cache_bytes=self.runner.kv_bytes,
                    kv_cache_dtype=self.kv_cache_dtype, kv_calibrated=self.runner.kv_cache.calibrated,
                    kv_transform=self.runner.kv_cache.transform,
                    kv_bytes_per_token=self.runner.kv_cache.spec.bytes_per_token(),
                    kv_pool_tokens=bm.num_blocks * bm.block_size, tensor_parallel_size=self.tensor_parallel_size,
                    **self.host_tier.stats())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of raw ``text`` (see :func:`turbo.core.inputs.encode`: the tokenizer's own special tokens by
        default). Raises ``LiteturboError`` for text that is not valid Unicode."""
        return inputs.encode(self.tokenizer, text, add_special_tokens)

    def chat_template_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the chat template, ready for the reply (see
        :func:`turbo.core.inputs.chat_template_ids`)."""
        return inputs.chat_template_ids(self.tokenizer, messages, self.path)

    def fingerprint(self) -> str:
        """Identifies the weights and compute dtype (saved KV is reused only under the same one)."""
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for f in weight_files(self.path):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        h.update(str(self.dtype).encode())
        return h.hexdigest()[:16]
