"""The engine: model runner over a paged KV cache, sequences, and stateful chat sessions."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from backends import get_backend
from backends.types import AttentionMetadata
from lite.formats import LiteturboError, load_config, resolve_model

from .block_manager import BlockManager, OutOfBlocks
from .config import EngineConfig, GenerationConfig
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .model import LlamaModel
from .sampler import sample


@dataclass
class Sequence:
    """A token history and its KV blocks. Tokens ``[:num_computed]`` have K/V in the cache."""

    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)


@dataclass
class StepInput:
    """What the model runner computes in one step (the scheduler → runner contract).

    For each sequence ``b``: tokens ``token_ids[query_start[b]:query_start[b+1]]`` at ``positions``, its
    block table, and whether to return logits for its last token (``logits_rows``).
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
    """Result of one request: text, generated ids, why it stopped, and timings (seconds)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    decode_seconds: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed after the first token (tokens/s)."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class ModelRunner:
    """Owns the model weights and the KV cache tensors; runs :class:`StepInput` batches."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        cfg = model.cfg
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dev, dt = model.backend.device, model.dtype
        self.kv_caches = [(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                          for _ in range(cfg.num_layers)]
        self.kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def run(self, step: StepInput) -> torch.Tensor:
        """float32 logits ``[len(step.logits_rows), vocab]``."""
        dev = self.model.backend.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            query_start=step.query_start, context_lens=step.context_lens, block_tables=step.block_tables,
            block_size=self.block_size,
        )
        return self.model.forward(
            torch.tensor(step.token_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            self.kv_caches, meta, torch.tensor(step.logits_rows, dtype=torch.long, device=dev),
        )


class Engine:
    """Load a model (name, or 16/32-bit or W4A16 checkpoint folder) and generate with it.

    >>> engine = Engine("smollm2-135m-instruct")
    >>> s = engine.session()
    >>> s.chat("What is the capital of France?")

    Raises ``LiteturboError`` for a bad model path, unsupported architecture or bad options.
    """

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, **kwargs) -> None:
        from transformers import AutoTokenizer

        try:
            self.config = config or EngineConfig(**kwargs)
        except TypeError as e:
            raise LiteturboError(f"bad Engine option: {e}") from None
        self.path = resolve_model(model)
        try:
            self.backend = get_backend(self.config.backend, self.config.device)
        except (ValueError, RuntimeError) as e:
            raise LiteturboError(str(e)) from None
        self.dtype = self.config.torch_dtype()
        raw_cfg = load_config(self.path)
        lm_int8 = self.config.lm_head == "int8" or (
            self.config.lm_head == "auto" and bool(raw_cfg.get("quantization_config"))
            and self.backend.device.type == "cpu" and self.dtype != torch.float32)
        self.model = LlamaModel.from_pretrained(self.path, self.backend, self.dtype, lm_head_int8=lm_int8)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        bs = self.config.block_size
        num_blocks = (self.config.max_kv_tokens + bs - 1) // bs
        self.block_manager = BlockManager(num_blocks, bs)
        self.runner = ModelRunner(self.model, num_blocks, bs)
        max_ctx = min(self.model.cfg.max_position_embeddings, num_blocks * bs)
        self.session_len = min(self.config.session_len or max_ctx, max_ctx)
        eos = set(self.model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.counters = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "last_prefill_tokens": 0}

    # ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: tokens prefilled/decoded in total and in the last request, blocks used/free."""
        return dict(self.counters, blocks_total=self.block_manager.num_blocks,
                    blocks_free=self.block_manager.num_free, kv_cache_bytes=self.runner.kv_bytes)

    def session(self, system: str | None = None) -> "Session":
        """A new stateful chat session (its KV cache survives between turns)."""
        return Session(self, system)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_template_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, ready for the reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise LiteturboError(f"the tokenizer of {self.path} has no chat template; use Engine.generate with a "
                                 f"plain prompt instead")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def generate(self, prompt: str | list[int], gen: GenerationConfig | None = None, **kwargs) -> GenerationOutput:
        """Generate a completion of a plain prompt (text or token ids) statelessly."""
        *_, out = self.stream(prompt, gen, **kwargs)
        return out

    def stream(self, prompt: str | list[int], gen: GenerationConfig | None = None,
               **kwargs) -> Iterator[str | GenerationOutput]:
        """Yield text pieces, then the :class:`GenerationOutput` as the last item."""
        gen = gen or _gen_config(kwargs)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq = Sequence()
        try:
            yield from self._generate(seq, ids, gen)
        finally:
            self.block_manager.free(seq.block_table)

    # ------------------------------------------------------------------------------------------
    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise LiteturboError("the prompt is empty: give at least one token of text")
        if len(ids) >= self.session_len:
            raise LiteturboError(f"the prompt has {len(ids)} tokens but the context holds {self.session_len}; "
                                 f"shorten the prompt (or reset the session) or raise session_len/max_kv_tokens")
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise LiteturboError(f"token id {bad[0]} is outside the vocabulary (size {self.model.cfg.vocab_size})")

    def _compute(self, seq: Sequence, end: int, want_logits: bool) -> torch.Tensor | None:
        """Bring ``seq.num_computed`` up to ``end`` in one step; logits of token ``end-1`` if asked."""
        start = seq.num_computed
        bm = self.block_manager
        try:
            bm.ensure_capacity(seq.block_table, end)
        except OutOfBlocks as e:
            raise LiteturboError(f"the KV cache is full ({e}); raise max_kv_tokens or close idle sessions") from None
        step = StepInput(
            token_ids=seq.token_ids[start:end], positions=list(range(start, end)),
            slot_mapping=bm.slots(seq.block_table, start, end), query_start=[0, end - start],
            context_lens=[end], block_tables=[seq.block_table], logits_rows=[end - start - 1],
        )
        logits = self.runner.run(step)
        seq.num_computed = end
        self.counters["steps"] += 1
        return logits[0] if want_logits else None

    def _generate(self, seq: Sequence, prompt_ids: list[int], gen: GenerationConfig) -> Iterator:
        """Reuse the cached prefix of ``seq`` shared with ``prompt_ids``, prefill the rest, decode."""
        self._check_prompt(prompt_ids)
        t0 = time.perf_counter()
        # the KV of the longest common prefix stays; at least the last prompt token is recomputed for logits
        common = 0
        limit = min(seq.num_computed, len(prompt_ids) - 1)
        while common < limit and seq.token_ids[common] == prompt_ids[common]:
            common += 1
        self.block_manager.truncate(seq.block_table, common)
        seq.num_computed, seq.token_ids = common, list(prompt_ids)
        n_prompt = len(prompt_ids)
        chunk = self.config.max_prefill_tokens
        logits = None
        while seq.num_computed < n_prompt:
            end = min(seq.num_computed + chunk, n_prompt)
            logits = self._compute(seq, end, end == n_prompt)
        self.counters["prefill_tokens"] += n_prompt - common
        self.counters["last_prefill_tokens"] = n_prompt - common

        gen_ids: list[int] = []
        detok = IncrementalDetokenizer(self.tokenizer)
        stopper = StopStringMatcher(gen.stop)
        rng = None
        if gen.temperature > 0:
            rng = torch.Generator()
            rng.manual_seed(gen.seed if gen.seed is not None else int(torch.seed() % (2**63)))
        stop_ids = set(gen.stop_token_ids) | (set() if gen.ignore_eos else self.eos_token_ids)
        finish, ttft, t_first = "length", 0.0, t0
        while True:
            tok = sample(logits, gen.temperature, gen.top_k, gen.top_p, rng)
            if not gen_ids:
                t_first = time.perf_counter()
                ttft = t_first - t0
            gen_ids.append(tok)
            seq.token_ids.append(tok)
            if tok in stop_ids:
                finish = "stop"
                break
            piece = stopper.feed(detok.add(tok))
            if piece:
                yield piece
            if stopper.stopped:
                finish = "stop"
                break
            if len(gen_ids) >= gen.max_new_tokens:
                break
            if len(seq.token_ids) >= self.session_len:
                break
            logits = self._compute(seq, len(seq.token_ids), True)
            self.counters["decode_tokens"] += 1
        tail = stopper.flush()
        if tail:
            yield tail
        decode_s = time.perf_counter() - t_first
        text = self.tokenizer.decode([t for t in gen_ids if t not in stop_ids], skip_special_tokens=True)
        if gen.stop and stopper.stopped:
            cuts = [text.find(s) for s in gen.stop if s and s in text]
            text = text[:min(cuts)] if cuts else text
        yield GenerationOutput(text=text, token_ids=gen_ids, finish_reason=finish, prompt_tokens=n_prompt,
                               cached_tokens=common, ttft=ttft, decode_seconds=decode_s)


def _gen_config(kwargs: dict) -> GenerationConfig:
    try:
        return GenerationConfig(**kwargs)
    except TypeError as e:
        raise LiteturboError(f"bad generation option: {e}") from None


class Session:
    """A stateful chat: messages, their token history and (while open) KV blocks kept between turns.

    Each turn renders the whole conversation with the chat template and computes only the tokens after the
    longest prefix already in the cache, so the result equals running the full conversation statelessly.
    """

    def __init__(self, engine: Engine, system: str | None = None) -> None:
        self.engine = engine
        self.system = system
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.seq = Sequence()
        self.closed = False
        self.busy = False
        self.last: GenerationOutput | None = None

    def chat(self, message: str, stream: bool = False, gen: GenerationConfig | None = None, **kwargs):
        """Send a user message. Returns the reply text, or with ``stream=True`` an iterator of text pieces.

        ``self.last`` holds the :class:`GenerationOutput` of the latest turn (tokens, timings, cache hits).
        Raises ``LiteturboError`` for a closed session, an empty message, or a conversation longer than the
        context.
        """
        if self.closed:
            raise LiteturboError("this session is closed; open a new one with engine.session()")
        self._check_idle()
        if not isinstance(message, str):
            raise LiteturboError(f"the message must be a str, got {type(message).__name__}")
        if not message.strip():
            raise LiteturboError("the message is empty: type some text")
        gen = gen or _gen_config(kwargs)
        it = self._turn(message, gen)
        if stream:
            return it
        return "".join(it)

    def _check_idle(self) -> None:
        if self.busy:
            raise LiteturboError("a reply is still streaming on this session; read it to the end or close() the "
                                 "stream first (or open another session)")

    def _turn(self, message: str, gen: GenerationConfig) -> Iterator[str]:
        self._check_idle()  # runs at the first next(): a stream never started holds nothing
        messages = self.messages + [{"role": "user", "content": message}]
        ids = self.engine.chat_template_ids(messages)
        pieces: list[str] = []
        out = None
        self.busy = True
        try:
            for item in self.engine._generate(self.seq, ids, gen):
                if isinstance(item, GenerationOutput):
                    out = item
                else:
                    pieces.append(item)
                    yield item
        finally:
            # a consumer that stops early (client gone) still leaves a consistent history
            reply = out.text if out is not None else "".join(pieces)
            if out is not None or pieces:
                self.messages = messages + [{"role": "assistant", "content": reply}]
            self.last = out
            self.busy = False

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt) and free its KV blocks."""
        self._check_idle()
        self.engine.block_manager.free(self.seq.block_table)
        self.seq = Sequence()
        self.messages = self.messages[:1] if self.system is not None else []

    def close(self) -> None:
        """Free the session's KV blocks; further ``chat`` calls raise."""
        self.engine.block_manager.free(self.seq.block_table)
        self.seq = Sequence()
        self.closed = True
