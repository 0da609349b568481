"""The engine: a persistent batch over a paged KV cache; requests are added, stepped and cancelled here.

``step()`` asks the :class:`~turbo.scheduler.Scheduler` which sequences compute how many tokens, runs them
as one flat batch through the :class:`ModelRunner` (which owns the weights and the backend's KV cache object:
16-bit, int8 or int4, see :mod:`backends.kv_cache`), samples a token for every sequence whose tokens are all
computed (:mod:`turbo.sampler`, batched on the logits' device) and releases their text (:mod:`turbo.detokenizer`).
Everything else is built on ``add_request`` + ``step``: input processing in :mod:`turbo.inputs`, stateful chat
sessions in :mod:`turbo.session`, the background loop for servers in :mod:`turbo.loop`, typed errors in
:mod:`turbo.errors`. Start-up sizes the KV pool with the memory accounting of :mod:`turbo.planner` (weights checked
against free memory before any is read, then the pool from what is free after loading, less a step's workspace)
and refuses what cannot fit with the shortfall.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from backends import KVCacheSpec, KVQuantParams, get_backend
from backends.types import AttentionMetadata
from lite.formats import LiteturboError, load_config, load_kv_params, resolve_model

from .block_manager import BlockManager
from .config import EngineConfig, GenerationConfig
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from . import inputs
from .model import LlamaModel, ModelConfig
from . import planner
from .sampler import RowSampling, SamplingError, sample_batch
from .scheduler import Scheduler, ScheduledStep, Sequence


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
class GenerationOutput:
    """Result of one request: text, generated ids, why it stopped, and timings (seconds).

    text: exactly the streamed pieces joined (the one source of a reply's text, also stored in a session's
    history): cut before a stop string, special tokens skipped, and without an incomplete multi-byte character
    at the end (the token limit cut it; see :mod:`turbo.detokenizer`). A cancelled or failed request's text is
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


class ModelRunner:
    """Owns the model weights and the KV cache object; runs :class:`StepInput` batches."""

    def __init__(self, model: LlamaModel, spec: KVCacheSpec, kv_params: KVQuantParams | None = None) -> None:
        self.model, self.block_size = model, spec.block_size
        self.kv_cache = model.backend.allocate_kv_cache(spec, model.dtype, kv_params)

    @property
    def kv_bytes(self) -> int:
        """Bytes the KV pool holds (values and scales)."""
        return self.kv_cache.nbytes

    def run(self, step: StepInput) -> torch.Tensor:
        """float32 logits ``[len(step.logits_rows), vocab]``."""
        dev = self.model.backend.device
        self.model.check_positions(max(step.positions))  # on the host: the forward never synchronizes
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            query_start=step.query_start, context_lens=step.context_lens, block_tables=step.block_tables,
            block_size=self.block_size,
        )
        return self.model.forward(
            torch.tensor(step.token_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            self.kv_cache, meta, torch.tensor(step.logits_rows, dtype=torch.long, device=dev),
        )


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


class Engine:
    """Load a model (name, or 16/32-bit or W4A16 checkpoint folder) and generate with it.

    >>> engine = Engine("smollm2-135m-instruct")
    >>> s = engine.session()
    >>> s.chat("What is the capital of France?")

    Raises ``LiteturboError`` for a bad model path, unsupported architecture or bad options.
    """

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, **kwargs) -> None:
        from transformers import AutoTokenizer

        if config is not None and kwargs:
            raise LiteturboError(f"give options either as config=EngineConfig(...) or as keywords, not both "
                                 f"(got config and {sorted(kwargs)})")
        if config is not None and not isinstance(config, EngineConfig):
            raise LiteturboError(f"config must be an EngineConfig, got {type(config).__name__}; "
                                 f"use EngineConfig(**options) or pass the options as keywords")
        try:
            self.config = config or EngineConfig(**kwargs)
        except TypeError as e:
            raise LiteturboError(f"bad Engine option: {e}") from None
        self.path = resolve_model(model)
        self.platform = self.config.platform()
        try:
            self.backend = get_backend(self.config.backend, self.platform.device,
                                       batch_invariant=self.config.batch_invariant)
        except (ValueError, RuntimeError) as e:
            raise LiteturboError(str(e)) from None
        self.dtype = self.config.torch_dtype()
        if self.platform.kind == "cpu" and self.dtype == torch.float16:
            import warnings

            warnings.warn("float16 on a CPU is emulated: about 10x slower than bfloat16 here; use dtype='bfloat16' "
                          "(or 'auto')", stacklevel=2)
        raw_cfg = load_config(self.path)
        lm_int8 = self.config.lm_head == "int8" or (
            self.config.lm_head == "auto" and bool(raw_cfg.get("quantization_config"))
            and self.backend.device.type == "cpu" and self.dtype != torch.float32)
        plan_model = self._plan_model(raw_cfg, lm_int8)  # config + weight layout, read from the headers once
        self._check_fits_before_loading(plan_model, lm_int8)
        self.model = LlamaModel.from_pretrained(self.path, self.backend, self.dtype, lm_head_int8=lm_int8)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError) as e:
            raise LiteturboError(f"cannot load the tokenizer of {self.path} ({str(e).splitlines()[0][:200]}); the "
                                 f"folder needs the tokenizer files of the original model (tokenizer.json, "
                                 f"tokenizer_config.json); copy them from it") from None
        bs = self.config.block_size
        self.kv_cache_dtype = self.config.kv_storage_dtype()
        self.kv_params = self._kv_params(raw_cfg)
        num_blocks = self._pool_blocks(plan_model, lm_int8)
        self.block_manager = BlockManager(num_blocks, bs, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_batch_size, self.config.max_num_batched_tokens)
        try:
            self.runner = ModelRunner(self.model, self._kv_spec(num_blocks), self.kv_params)
        except (RuntimeError, MemoryError) as e:
            raise LiteturboError(f"cannot allocate the KV cache of {num_blocks} blocks x {bs} tokens ({e}); lower "
                                 f"kv_cache_gib / cache_max_entry_count / num_blocks / max_kv_tokens") from None
        max_ctx = min(self.model.cfg.max_position_embeddings, num_blocks * bs)
        self.session_len = min(self.config.session_len or max_ctx, max_ctx)
        if self.config.session_len and self.config.session_len > max_ctx:
            import warnings

            warnings.warn(f"session_len={self.config.session_len} is capped to {max_ctx} tokens (the model's "
                          f"max_position_embeddings and the KV pool of {num_blocks * bs} tokens)", stacklevel=2)
        eos = set(self.model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.requests: dict[int, Request] = {}
        self._loop = None  # the EngineLoop of astream / servers, made on first use
        # one step at a time: threads may share an engine (each drives steps for everyone until its own
        # request is done); the lock guards the scheduler, the block manager and the caches
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.counters = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "last_prefill_tokens": 0,
                         "generated_tokens": 0, "busy_seconds": 0.0}

    def _kv_params(self, raw_cfg: dict) -> KVQuantParams | None:
        """Calibrated key parameters of the checkpoint, when the cache is int8/int4 and they are not turned off.
        Raises ``LiteturboError`` for a damaged file or one made for another model shape."""
        if self.kv_cache_dtype not in ("int8", "int4") or not self.config.kv_calibration:
            return None
        params = load_kv_params(self.path, raw_cfg)
        if params is not None:
            m = self.model.cfg
            bad = params.mismatch(m.num_layers, m.num_kv_heads, m.head_dim)
            if bad:
                raise LiteturboError(f"the KV parameter file of {self.path} was made for another model ({bad}); "
                                     f"run `liteturbo lite calibrate-kv` on this model, or pass kv_calibration=False "
                                     f"(--no-kv-calibration)")
        return params

    def _kv_spec(self, num_blocks: int) -> KVCacheSpec:
        m = self.model.cfg
        try:
            return KVCacheSpec(self.kv_cache_dtype, num_blocks, self.config.block_size, m.num_layers,
                               m.num_kv_heads, m.head_dim)
        except ValueError as e:
            raise LiteturboError(str(e)) from None

    def _plan_model(self, raw_cfg: dict, lm_int8: bool):
        """(ModelConfig, WeightChoice) the planner counts with, from config.json and the weight headers."""
        cfg = ModelConfig.from_dict(raw_cfg)
        return cfg, planner.weight_choice(self.path, raw_cfg, lm_int8)

    def _workspace(self, mcfg, quantized: bool, lm_int8: bool, context_tokens: int | None = None) -> dict[str, int]:
        c = self.config
        return planner.workspace_breakdown(
            mcfg, type(self.backend), self.dtype, self.kv_cache_dtype, quantized, lm_int8, c.max_num_batched_tokens,
            c.max_batch_size, min(c.session_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings),
            c.batch_invariant, context_tokens)

    def _check_fits_before_loading(self, plan_model, lm_int8: bool) -> None:
        """Refuse, before reading any weight, a model whose weights and step workspace exceed the free memory
        (memory other processes use is not free), naming the shortfall and what would help."""
        mcfg, wc = plan_model
        weights = sum(planner.weight_breakdown(mcfg, type(self.backend), self.platform.device.type, self.dtype,
                                               wc).values())
        self.kv_cache_dtype = self.config.kv_storage_dtype()
        ws = sum(self._workspace(mcfg, wc.bits < 16, lm_int8, context_tokens=self.config.block_size).values())
        free = self._free_memory()
        if weights + ws > free:
            c = self.config
            raise LiteturboError(
                f"{self.path.name} does not fit on {self.platform.device}: its weights take {planner.gib(weights)} "
                f"({'W%dA16' % wc.bits if wc.bits < 16 else str(self.dtype).removeprefix('torch.')}) and a step's "
                f"workspace {planner.gib(ws)} (max_num_batched_tokens={c.max_num_batched_tokens}, "
                f"max_batch_size={c.max_batch_size}), but only {planner.gib(free)} of {self.platform.kind} memory is "
                f"free (the rest is in use): {planner.gib(weights + ws - free)} short, before any KV cache. "
                + ("Quantize it to 4 bits (liteturbo lite auto-awq), " if wc.bits > 4 else "")
                + f"lower max_num_batched_tokens / max_batch_size / session_len, free memory, or use a larger "
                  f"device; `liteturbo plan {self.path}` shows the accounting")

    def _pool_blocks(self, plan_model, lm_int8: bool) -> int:
        """KV blocks to allocate (see :mod:`turbo.planner`: ``free − workspace`` after the weights are loaded,
        sized by the one pool option given, or the default), counting the real bytes of a block in the chosen KV
        dtype (scales included). Raises ``LiteturboError`` naming the shortfall and the options that would fit when
        the pool, or one session of an explicit ``session_len``, does not fit."""
        cfg = self.config
        bs = cfg.block_size
        mcfg, wc = plan_model
        block_bytes = self._kv_spec(1).bytes_per_block()
        free = self._free_memory()
        accel = self.platform.kind != "cpu"

        paged = type(self.backend).paged_attention
        length = min(cfg.session_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        pool, ws = planner.size_pool(
            free, lambda ctx: self._workspace(mcfg, wc.bits < 16, lm_int8, context_tokens=ctx), block_bytes, bs,
            num_blocks=cfg.num_blocks, kv_cache_gib=cfg.kv_cache_gib, cache_max_entry_count=cfg.cache_max_entry_count,
            max_kv_tokens=cfg.max_kv_tokens, accelerator=accel,
            context_cap=None if paged else cfg.max_batch_size * length)
        self.workspace_bytes = sum(ws.values())
        fitting_tokens = int(pool.available // block_bytes) * bs
        if pool.asked < block_bytes and pool.what.split("=")[0] in ("kv_cache_gib", "cache_max_entry_count") \
                and pool.available >= block_bytes:
            raise LiteturboError(f"{pool.what} is less than one KV block ({block_bytes} bytes of {bs} tokens); give "
                                 f"at least {block_bytes / 2**30:.6f} GiB, or use max_kv_tokens (--max-kv-tokens)")
        if pool.blocks < 1:
            raise LiteturboError(
                f"{pool.what} asks for a KV cache of {planner.gib(max(pool.asked, block_bytes))} but only "
                f"{planner.gib(pool.available)} is left of the {planner.gib(free)} of {self.platform.kind} memory free "
                f"after loading the weights, once a step's workspace ({planner.gib(self.workspace_bytes)}: "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}, max_batch_size={cfg.max_batch_size}) is set "
                f"aside: {planner.gib(max(pool.asked, block_bytes) - pool.available)} short. To fit: "
                + self._fit_hint(fitting_tokens))
        tokens = pool.blocks * bs
        wanted = cfg.session_len and min(cfg.session_len, mcfg.max_position_embeddings)
        if wanted and wanted > tokens:
            raise LiteturboError(
                f"session_len={wanted} needs {wanted} tokens of KV cache but the pool ({pool.what}) holds {tokens} "
                f"({planner.gib(-(-wanted // bs) * block_bytes - pool.blocks * block_bytes)} short). To fit: "
                + self._fit_hint(fitting_tokens, session=True))
        return pool.blocks

    def _fit_hint(self, fitting_tokens: int, session: bool = False) -> str:
        """The options that would make the KV pool fit, for error messages."""
        cfg = self.config
        hints = []
        if session:
            hints.append("a smaller session_len (--session-len), or a larger pool (max_kv_tokens / kv_cache_gib / "
                         "cache_max_entry_count; --max-kv-tokens, --kv-cache-gib, --cache-max-entry-count)")
        elif fitting_tokens >= cfg.block_size:
            hints.append(f"max_kv_tokens={fitting_tokens} (--max-kv-tokens {fitting_tokens}: the most that fits), or "
                         f"cache_max_entry_count=0.9")
        if self.kv_cache_dtype not in ("int8", "int4"):
            hints.append("kv_cache_dtype='int8' (--kv-cache-dtype int8: about half the bytes per token) or 'int4'")
        elif self.kv_cache_dtype == "int8":
            hints.append("kv_cache_dtype='int4' (--kv-cache-dtype int4)")
        if not session:
            hints.append("a smaller max_num_batched_tokens or max_batch_size (less workspace)")
        return "; ".join(hints) + f" (`liteturbo plan {self.path}` shows the accounting)"

    def _free_memory(self) -> int:
        """Free bytes where the KV cache lives: free device memory, or available RAM on CPU (the platform's)."""
        return self.platform.free_memory()

    # --- info ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: running/waiting requests, tokens prefilled/decoded, prefix-cache hits, blocks, tokens/s, and the
        KV pool: ``kv_cache_dtype``, ``kv_calibrated``, ``kv_bytes_per_token`` (all layers, K and V, scales
        included), ``kv_pool_tokens`` (tokens the pool holds), ``kv_cache_bytes``."""
        c = dict(self.counters)
        c["generation_tokens_per_s"] = c["generated_tokens"] / c["busy_seconds"] if c["busy_seconds"] else 0.0
        return dict(c, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    idle_sessions=len(self.scheduler.idle), cache_hit_tokens=self.block_manager.hit_tokens,
                    blocks_total=self.block_manager.num_blocks, blocks_free=self.block_manager.num_free,
                    block_size=self.block_manager.block_size, kv_cache_bytes=self.runner.kv_bytes,
                    kv_cache_dtype=self.kv_cache_dtype, kv_calibrated=self.runner.kv_cache.calibrated,
                    kv_bytes_per_token=self.runner.kv_cache.spec.bytes_per_token(),
                    kv_pool_tokens=self.block_manager.num_blocks * self.block_manager.block_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of raw ``text`` (see :func:`turbo.inputs.encode`: the tokenizer's own special tokens by
        default). Raises ``LiteturboError`` for text that is not valid Unicode."""
        return inputs.encode(self.tokenizer, text, add_special_tokens)

    def chat_template_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the chat template, ready for the reply (see
        :func:`turbo.inputs.chat_template_ids`)."""
        return inputs.chat_template_ids(self.tokenizer, messages, self.path)

    def session(self, system: str | None = None) -> "Session":
        """A new stateful chat session (its KV cache survives between turns while memory allows)."""
        from .session import Session

        return Session(self, system)

    def fingerprint(self) -> str:
        """Identifies the weights and compute dtype (saved KV is reused only under the same one)."""
        import hashlib

        from lite.formats.checkpoint import weight_files

        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for f in weight_files(self.path):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
        h.update(str(self.dtype).encode())
        return h.hexdigest()[:16]

    def load_session(self, path: str | Path) -> "Session":
        """Restore a session written by :meth:`Session.save` (see :func:`turbo.session.load_session`)."""
        from .session import load_session

        return load_session(self, path)

    # --- requests --------------------------------------------------------------------------------------
    def _check_prompt(self, ids: list[int], session: bool = False) -> None:
        inputs.check_prompt(ids, self.session_len, self.model.cfg.vocab_size, session)

    def add_request(self, prompt: str | list[int], gen: GenerationConfig | None = None, priority: int = 0,
                    seq: Sequence | None = None) -> Request:
        """Queue a request; ``seq`` continues an existing sequence (a session), reusing its computed prefix.

        A text prompt is raw text, tokenized by :meth:`encode` (with the tokenizer's own special tokens, e.g. a
        BOS); token ids are used as given. ``priority``: lower runs first (and is preempted last). Raises
        ``LiteturboError`` for a bad prompt, option or priority."""
        with self._lock:
            return self._add_request(prompt, gen, priority, seq)

    def _add_request(self, prompt, gen, priority, seq) -> Request:
        gen = GenerationConfig() if gen is None else gen
        if not isinstance(gen, GenerationConfig):
            raise LiteturboError(f"gen must be a GenerationConfig, got {type(gen).__name__}; use "
                                 f"GenerationConfig(**options) or pass the options as keywords")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise LiteturboError(f"priority must be an integer (lower runs first), got {priority!r}")
        if not isinstance(prompt, (str, list, tuple)):
            raise LiteturboError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in gen.stop_token_ids if t >= vocab]
        if bad:
            raise LiteturboError(f"stop_token_ids {bad[:3]} are outside the vocabulary (size {vocab})")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids, session=seq is not None)
        if seq is None:
            seq = Sequence(seq_id=next(self._ids), priority=priority)
        else:
            seq.priority = priority
            common, limit = 0, min(seq.num_computed, len(ids) - 1)
            while common < limit and seq.token_ids[common] == ids[common]:
                common += 1
            seq.num_computed = self.block_manager.truncate(seq.block_table, common)
        seq.token_ids = ids
        rng = None
        if gen.temperature > 0:
            rng = torch.Generator(device=self.backend.device)  # the logits' device: sampling runs there
            rng.manual_seed(gen.seed if gen.seed is not None else int(torch.seed() % (2**63)))
        stop_ids = set(gen.stop_token_ids) | (set() if gen.ignore_eos else self.eos_token_ids)
        req = Request(seq=seq, gen=gen, prompt_len=len(ids), stop_ids=stop_ids,
                      detok=IncrementalDetokenizer(self.tokenizer), stopper=StopStringMatcher(gen.stop), rng=rng)
        self.requests[seq.seq_id] = req
        self.scheduler.add(seq)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request now and free its blocks (a session keeps its computed tokens while memory allows).
        Cancelling a finished request does nothing; a request of another engine raises ``LiteturboError``."""
        if not isinstance(req, Request):
            raise LiteturboError(f"expected a Request from add_request, got {type(req).__name__}")
        with self._lock:
            if req.finished:
                return
            if self.requests.get(req.seq.seq_id) is not req:
                raise LiteturboError("this request belongs to another Engine; cancel it there")
            self._finish(req, "cancelled")

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.t_end = time.perf_counter()
        # generation ran to its end: release what was held back (a possible stop-string start; an incomplete
        # last character is dropped). A cancelled or failed request releases nothing more: its text stays what
        # was already streamed.
        if reason in ("length", "stop"):
            req.release(req.stopper.feed(req.detok.flush()))
            req.release(req.stopper.flush())
        self.scheduler.finish(req.seq, keep_cache=req.keep_cache)
        self.requests.pop(req.seq.seq_id, None)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    # --- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that got a new token (or finished).

        If the step fails (a kernel error, a request's sampling options), the requests of the step are
        finished with ``finish_reason="error"`` (their blocks freed) and the exception propagates, so no
        request is left half-run."""
        with self._lock:
            return self._step()

    def _step(self) -> list[Request]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.seqs:
            if self.scheduler.waiting:  # nothing fits even alone: the pool is too small for this request
                seq = self.scheduler.waiting[0]
                req = self.requests.get(seq.seq_id)
                if req is not None:  # the error is raised to the request's owner, not to whoever stepped
                    req.error = LiteturboError(f"the KV cache ({self.block_manager.num_blocks} blocks of "
                                               f"{self.block_manager.block_size} tokens) cannot hold this request "
                                               f"({seq.num_tokens} tokens); raise max_kv_tokens or kv_cache_gib")
                    self._finish(req, "error")
            return []
        try:
            return self._run_step(sched, t0)
        except BaseException as e:
            for seq in sched.seqs:
                req = self.requests.get(seq.seq_id)
                if req is not None and not req.finished:
                    req.error = e
                    self._finish(req, "error")
            raise

    def _run_step(self, sched: ScheduledStep, t0: float) -> list[Request]:
        logits = self.runner.run(self._build(sched))
        touched, ready = [], []  # ready: (logits row, request) of the sequences that get a token now
        for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            req = self.requests[seq.seq_id]
            if req.cached_tokens < 0:
                req.cached_tokens = seq.num_computed
            seq.num_computed += n
            self.block_manager.register_full_blocks(seq.token_ids, seq.block_table, seq.num_computed)
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            if not req.output_ids:
                self.counters["prefill_tokens"] += req.prompt_len - req.cached_tokens
                self.counters["last_prefill_tokens"] = req.prompt_len - req.cached_tokens
            else:
                self.counters["decode_tokens"] += 1
            ready.append((row, req))
        if ready:  # one batched draw on the logits' device, one host synchronization
            opts = []
            for _, req in ready:
                gen, done = req.gen, req.output_ids
                opts.append(RowSampling.of(
                    gen, generator=req.rng, output_ids=done,
                    prompt_ids=req.seq.token_ids[:req.prompt_len] if gen.repetition_penalty != 1.0 else (),
                    banned_ids=req.stop_ids if len(done) < gen.min_new_tokens else ()))
            try:
                picks = sample_batch(logits, opts, [row for row, _ in ready])
            except Exception:  # some request's sampling failed: find it by sampling each row alone
                picks = []
                for (row, req), opt in zip(ready, opts):
                    try:
                        picks.append(sample_batch(logits, [opt], [row])[0])
                    except SamplingError as e:
                        picks.append(LiteturboError(f"request {req.seq.seq_id}: {e.reason}"))
                    except Exception as e:
                        picks.append(e)
            for (_, req), pick in zip(ready, picks):
                try:
                    if isinstance(pick, Exception):
                        raise pick
                    self._append_token(req, pick.token_id, pick.logprobs)
                except Exception as e:  # this request's sampling failed: it alone ends, with the error kept
                    req.error = e
                    self._finish(req, "error")
                touched.append(req)
        self.counters["steps"] += 1
        self.counters["busy_seconds"] += time.perf_counter() - t0
        return touched

    def _build(self, sched: ScheduledStep) -> StepInput:
        ids, pos, slots, qs, ctx, tables, rows = [], [], [], [0], [], [], []
        bm = self.block_manager
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            s, e = seq.num_computed, seq.num_computed + n
            ids += seq.token_ids[s:e]
            pos += range(s, e)
            slots += bm.slots(seq.block_table, s, e)
            qs.append(qs[-1] + n)
            ctx.append(e)
            tables.append(seq.block_table)
            rows.append(qs[-1] - 1)
        return StepInput(ids, pos, slots, qs, ctx, tables, rows)

    def _append_token(self, req: Request, tok: int, logprobs: list[tuple[int, float]] | None = None) -> None:
        """Append the sampled ``tok`` (and its top log-probabilities) to ``req``; finish it if it stops."""
        gen, seq = req.gen, req.seq
        if logprobs is not None:
            req.logprobs.append(logprobs)
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
        req.output_ids.append(tok)
        seq.token_ids.append(tok)
        self.counters["generated_tokens"] += 1
        if tok in req.stop_ids:
            return self._finish(req, "stop")
        req.release(req.stopper.feed(req.detok.add(tok)))
        if req.stopper.stopped:
            return self._finish(req, "stop")
        if len(req.output_ids) >= gen.max_new_tokens or seq.num_tokens >= self.session_len:
            return self._finish(req, "length")

    def output(self, req: Request) -> GenerationOutput:
        """The :class:`GenerationOutput` of a finished request. Raises ``LiteturboError`` while it runs."""
        if not isinstance(req, Request):
            raise LiteturboError(f"expected a Request from add_request, got {type(req).__name__}")
        if not req.finished:
            raise LiteturboError("the request is still running: step the engine until req.finished (or cancel it)")
        ids = req.output_ids
        t_first = req.t_first or req.t_end or req.t_arrival
        return GenerationOutput(text=req.text, token_ids=list(ids), finish_reason=req.finish_reason,
                                prompt_tokens=req.prompt_len, cached_tokens=max(req.cached_tokens, 0),
                                ttft=t_first - req.t_arrival, decode_seconds=(req.t_end or t_first) - t_first,
                                logprobs=list(req.logprobs))

    # --- convenience APIs ----------------------------------------------------------------------------------
    def generate(self, prompts, gen: GenerationConfig | None = None, priority: int = 0, **kwargs):
        """Generate completions. ``prompts``: one prompt (text or token ids) → one :class:`GenerationOutput`;
        a list of prompts → a list, all run together in the persistent batch."""
        gen = _gen_config(gen, kwargs)
        if isinstance(prompts, (list, tuple)) and len(prompts) == 0:
            return []  # no prompts, no outputs (an empty prompt inside the list is an error)
        if not isinstance(prompts, (str, list, tuple)):
            raise LiteturboError(f"prompts must be a str, a list of token ids, or a list of those; got "
                                 f"{type(prompts).__name__}")
        single = isinstance(prompts, str) or isinstance(prompts[0], int)
        batch = [prompts] if single else list(prompts)
        reqs = []
        try:
            for p in batch:
                reqs.append(self.add_request(p, gen, priority=priority))
            while any(not r.finished for r in reqs):
                self.step()
                time.sleep(0)  # let other threads waiting on the engine lock in between steps
        finally:
            for r in reqs:
                self.cancel(r)
        for r in reqs:
            if r.error is not None:
                raise r.error
        outs = [self.output(r) for r in reqs]
        return outs[0] if single else outs

    def stream(self, prompt: str | list[int], gen: GenerationConfig | None = None,
               **kwargs) -> Iterator[str | GenerationOutput]:
        """Yield text pieces, then the :class:`GenerationOutput` as the last item."""
        req = self.add_request(prompt, _gen_config(gen, kwargs))
        yield from self._drive(req)

    async def astream(self, prompt: str | list[int], gen: GenerationConfig | None = None, **kwargs):
        """Async version of :meth:`stream`: text pieces, then the :class:`GenerationOutput`.

        The request runs on the engine's :class:`~turbo.loop.EngineLoop` (:attr:`loop`, started at the first
        call): the model's forward never runs on the event loop, and several ``astream`` calls share the persistent
        batch. Submitting (which may wait for a step) happens off the event loop too. Leaving the stream early
        cancels the request."""
        import asyncio

        gen = _gen_config(gen, kwargs)
        handle = await asyncio.to_thread(self.loop.submit, prompt, gen)
        async for piece in handle:
            yield piece
        yield handle.output

    @property
    def loop(self):
        """The :class:`~turbo.loop.EngineLoop` that drives this engine from a background thread for
        :meth:`astream` and servers (made and started on first use; ``engine.loop.stop()`` ends it)."""
        from .loop import EngineLoop

        with self._lock:
            if self._loop is None:
                self._loop = EngineLoop(self)
            if not self._loop.running:
                self._loop.start()
            return self._loop

    def _drive(self, req: Request, every_step: bool = False) -> Iterator[str | GenerationOutput]:
        """Step until ``req`` finishes, yielding its new text (``""`` after text-less steps if ``every_step``),
        then its :class:`GenerationOutput`."""
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
            self.cancel(req)  # a consumer that went away frees the request's blocks at once
        if req.error is not None:
            raise req.error
        yield self.output(req)


def _gen_config(gen: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    if gen is not None:
        if kwargs:
            raise LiteturboError(f"give generation options either as gen=GenerationConfig(...) or as keywords, "
                                 f"not both (got gen and {sorted(kwargs)})")
        return gen  # type checked by add_request
    try:
        return GenerationConfig(**kwargs)
    except TypeError as e:
        raise LiteturboError(f"bad generation option: {e}") from None


from .session import Session  # noqa: E402  (re-exported: turbo.engine.Session; session.py imports this module)
