"""Constrained (guided) decoding: a request's grammar compiled by llguidance, and its token masks per step.

A request with one of :class:`~turbo.config.GenerationConfig`'s constraints (``json_schema``, ``regex``, ``choice``,
``grammar``) gets a :class:`Guide`: an ``llguidance.LLMatcher`` over the model's tokenizer. Each step the engine asks
every guided request that will sample for its mask of allowed next tokens (:class:`MaskJob`, computed by llguidance
on a CPU thread while the model's forward runs), the batched sampler adds ``-inf`` to the disallowed tokens of that
row (:func:`mask_bias`, :mod:`turbo.core.sampler`), and the sampled token is fed back
(:meth:`Guide.consume`). End-of-sequence is allowed only where the grammar accepts; when the grammar can take no
more tokens (:attr:`Guide.stopped`) the request ends with ``stop``. A constraint that is unfinished when
``max_new_tokens`` runs out ends with ``length``, never ``stop``.

The grammar dialects are llguidance's: JSON schema (with its ``x-guidance`` options; by default here compact JSON
without whitespace: a small model given free whitespace can spend its tokens on newlines; a schema's own
``x-guidance`` object overrides this), regex (Rust ``regex`` syntax, anchored at both ends), Lark (llguidance's
dialect, with ``%json{...}`` for inline schemas; GBNF, recognised by ``::=``, is converted to it) and a choice (a
list of exact strings, compiled as one regex). Compiled grammars are cached (:func:`compiled`); llguidance's errors
reach the caller without its parser-state dumps. Masks are bitmasks:
int32 ``[ceil(vocab / 32)]`` per row, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed
(llguidance's layout). Source: https://github.com/guidance-ai/llguidance.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import InvalidRequest

GUIDED_KEYS = ("json_schema", "regex", "choice", "grammar")  # GenerationConfig's constraint fields, at most one

_TOKENIZERS: dict[int, object] = {}
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face ``tokenizer`` (token bytes, EOS) over ``vocab_size`` ids (the model's
    vocabulary: ids past the tokenizer's table are never allowed). Built once per tokenizer (~0.3 s for a 49k
    vocabulary). Raises ``InvalidRequest`` when llguidance cannot read the tokenizer."""
    key = id(tokenizer)
    with _LOCK:
        got = _TOKENIZERS.get(key)
        if got is None or got[0] is not tokenizer:
            import llguidance.hf
            try:
                lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
            except Exception as e:  # noqa: BLE001 - any reason it cannot: the request is refused, the engine lives
                raise InvalidRequest(f"constrained decoding needs a tokenizer llguidance can read; this one "
                                     f"({type(tokenizer).__name__}) fails: {e}") from None
            got = _TOKENIZERS[key] = (tokenizer, lt)
        return got[1]


def grammar_text(gen) -> tuple[str, str] | None:
    """``(llguidance grammar, what it is in words)`` for ``gen``'s constraint, ``None`` when it has none; with
    ``after_reasoning`` the constraint is a sub-grammar after the reasoning block (:func:`_after_reasoning`). The
    fields were type-checked by ``GenerationConfig``."""
    got = _constraint_text(gen)
    if got is None or gen.after_reasoning is None:
        return got
    return _after_reasoning(got[0], got[1], gen.after_reasoning), got[1]


def _after_reasoning(grammar: str, kind: str, how: str) -> str:
    """A top-level grammar whose text is free up to ``</think>`` and the whitespace after it (``how`` "open": the
    prompt opened the block; "optional": the reply may open it with ``<think>`` after whitespace, or answer at
    once), then ``grammar``: llguidance's text of constraint ``kind``, JSON (``{"grammars": [...]}``, what
    ``grammar_from_json_schema`` / ``grammar_from_regex`` return) or, for ``grammar`` (a request's Lark, GBNF
    converted, or a tool-call grammar), the Lark text itself (what ``grammar_from_lark`` returns). The reasoning
    and the whitespace after it are one lexeme (exactly one ``</think>``, at its end), so an answer that starts with
    free text cannot take that whitespace from it (the reasoning parsers drop it too)."""
    import json
    inner = [{"lark_grammar": grammar}] if kind == "grammar" else json.loads(grammar)["grammars"]
    think = r'THINK: /(?s:.*)<\/think>[ \t\r\n]*/ & ~/(?s:.*)<\/think>(?s:.*)<\/think>(?s:.*)/' + "\n"
    head = "start: THINK @answer\n" if how == "open" else \
        "start: OPEN THINK @answer | @answer\nOPEN: /[ \\t\\r\\n]*<think>/\n"
    return json.dumps({"grammars": [{"lark_grammar": head + think}, dict(inner[0], name="answer"), *inner[1:]]})


def _constraint_text(gen) -> tuple[str, str] | None:
    import llguidance
    if gen.json_schema is not None:
        schema = {} if gen.json_schema is True else gen.json_schema
        if isinstance(schema, dict) and "x-guidance" not in schema:  # no free whitespace: small models loop in it
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return llguidance.LLMatcher.grammar_from_json_schema(schema), "json_schema"
    if gen.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(gen.regex), "regex"
    if gen.choice is not None:  # one regex of the escaped strings: compiles lazily, thousands of choices are cheap
        return llguidance.LLMatcher.grammar_from_regex("|".join(_escape(c) for c in gen.choice)), "choice"
    if gen.grammar is not None:
        text = gen.grammar
        if "::=" in text:  # GBNF (llama.cpp's, vLLM's xgrammar examples): llguidance converts it to its Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 - any reason it does not convert is the caller's grammar
                raise InvalidRequest(f"grammar looks like GBNF (it has ::=) but does not convert to Lark: "
                                     f"{_reason(str(e))}") from None
        return llguidance.LLMatcher.grammar_from_lark(text), "grammar"
    return None


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _escape(text: str) -> str:
    """``text`` as a literal in llguidance's regex syntax (Rust's ``regex``: every meta character escaped)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _reason(msg: str) -> str:
    """llguidance's error without its parser-state and backtrace dumps (the first lines, at most 300 characters)."""
    for cut in ("\n<state>", "\n<grammar>", "\n<backtrace>", "\nstack backtrace"):
        msg = msg.split(cut)[0]
    msg = msg.strip()
    return msg if len(msg) <= 300 else msg[:297] + "..."


def check_grammar(gen) -> tuple[str, str] | None:
    """:func:`grammar_text` of ``gen``, checked: raises ``InvalidRequest`` naming the field and llguidance's reason
    when the constraint does not compile (needs no tokenizer)."""
    import llguidance
    try:
        got = grammar_text(gen)
    except (ValueError, TypeError, RuntimeError) as e:
        raise InvalidRequest(f"the constraint does not compile: {_reason(str(e))}") from None
    if got is not None:
        err = llguidance.LLMatcher.validate_grammar(got[0])
        if err:
            raise InvalidRequest(f"{got[1]} cannot be used for constrained decoding: {_reason(err)}")
    return got


_COMPILED: OrderedDict = OrderedDict()  # (tokenizer, vocab, grammar) -> (a fresh matcher to copy, field)
_CACHE_SIZE = 64


def compiled(gen, tokenizer, vocab_size: int):
    """``(a fresh llguidance matcher, field)`` for ``gen``'s constraint: compiled once per grammar (the last
    :data:`_CACHE_SIZE` are kept) and deep-copied for each request, so the ``n`` choices of a request, or a
    schema an agent sends every turn, compile once. Raises ``InvalidRequest`` for a constraint that does not
    compile."""
    import llguidance
    grammar, field = check_grammar(gen)
    lt = ll_tokenizer(tokenizer, vocab_size)
    key = (id(lt), vocab_size, grammar)
    with _LOCK:
        got = _COMPILED.get(key)
        if got is not None:
            _COMPILED.move_to_end(key)
            return got[0].deep_copy(), field
    matcher = llguidance.LLMatcher(lt, grammar)
    if matcher.is_error():
        raise InvalidRequest(f"{field} cannot be used for constrained decoding: {_reason(matcher.get_error())}")
    with _LOCK:
        _COMPILED[key] = (matcher, field)
        while len(_COMPILED) > _CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return matcher.deep_copy(), field


class Guide:
    """One request's constraint state over the tokenizer (see the module docstring). Raises ``InvalidRequest``
    from the constructor for a constraint that does not compile."""

    def __init__(self, gen, tokenizer, vocab_size: int) -> None:
        self.matcher, self.field = compiled(gen, tokenizer, vocab_size)
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bitmask of the next token into int32 ``bitmask[row]`` (contiguous, on the CPU)."""
        self.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)

    def consume(self, token_id: int) -> None:
        """Advance over the sampled ``token_id``. Raises ``InvalidRequest`` when the grammar refuses it (a token the
        mask did not allow: a bug, or a mask skipped)."""
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            raise InvalidRequest(f"the {self.field} constraint refused token {token_id}: "
                                 f"{_reason(self.matcher.get_error()) or 'not allowed here'}")

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens; ``[]`` when the next token is free
        or the grammar is complete)."""
        if self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from its current state (it does not advance)."""
        if self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(tokens)

    def fill_drafts(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> int:
        """Write the masks of the next positions into ``bitmask[row:]`` (position ``j``: after ``drafts[:j]``), for
        the drafts the grammar accepts and the one after them, advancing through them and rolling back after.
        Returns the number of masks written (``1 +`` the drafts accepted)."""
        n = self.valid_prefix(drafts)
        for j in range(n + 1):
            self.fill(bitmask, row + j)
            if j < n:
                self.matcher.consume_token(drafts[j])
        if n:
            self.matcher.rollback(n)
        return n + 1

    @property
    def stopped(self) -> bool:
        """Whether the grammar can take no more tokens (the reply is complete)."""
        return self.matcher.is_stopped()


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


_BIAS_TABLE: torch.Tensor | None = None


def mask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Float32 ``[rows, vocab_size]``: 0 where int32 ``bitmask [rows, words]`` allows a token, ``-inf`` elsewhere
    (added to the logits; one table lookup per byte, ~10x cheaper on a CPU than a bool ``masked_fill``)."""
    global _BIAS_TABLE
    if _BIAS_TABLE is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # byte value -> its 8 bits, lowest first
        _BIAS_TABLE = torch.where(bits.bool(), 0.0, float("-inf"))
    by_byte = bitmask.contiguous().view(torch.uint8).long()  # little-endian: byte j of word w = tokens 32w+8j..
    return torch.nn.functional.embedding(by_byte, _BIAS_TABLE).reshape(bitmask.shape[0], -1)[:, :vocab_size]


class MaskJob:
    """The masks of one step's guided rows: llguidance fills them on a worker thread, started before the forward and
    read after it (:meth:`result` unpacks them on the caller's thread). A row with speculative drafts gets a mask per
    verified position (:meth:`Guide.fill_drafts`).

    No torch operation runs on the worker: a torch op on another thread starts a second OpenMP thread team, whose
    spinning threads then compete with the forward's for the cores (measured here: decode of every request, free
    ones too, at half speed after the first constrained one). ``guides``: the :class:`Guide` of each row that will
    sample (``None``: unconstrained); ``drafts``: each row's drafts (default none). :meth:`result` returns
    ``{(row, position): mask [vocab]}`` (:func:`mask_bias`: 0 or ``-inf``, float32) for the guided rows' positions
    (a position after a draft the grammar refuses has none), or raises what the computation raised; then
    ``compute_s`` is the seconds llguidance took on the worker and ``wait_s`` the seconds :meth:`result` waited for
    it (the part the forward did not hide)."""

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, guides: list[Guide | None], vocab_size: int, drafts: list[list[int]] | None = None) -> None:
        self.index = [i for i, g in enumerate(guides) if g is not None]
        self.drafts = [drafts[i] if drafts else [] for i in self.index]
        self.vocab_size = vocab_size
        self.compute_s = self.wait_s = 0.0
        self.first = [0]
        for d in self.drafts:
            self.first.append(self.first[-1] + len(d) + 1)
        self.written = [0] * len(self.index)
        self.bitmask = torch.zeros((self.first[-1], bitmask_words(vocab_size)), dtype=torch.int32)  # this thread
        self.future: Future | None = None
        if self.index:
            if MaskJob._pool is None:
                MaskJob._pool = ThreadPoolExecutor(1, thread_name_prefix="liteturbo-mask")
            self.future = MaskJob._pool.submit(self._fill, [guides[i] for i in self.index])

    def _fill(self, guides: list[Guide]) -> None:
        t0 = time.perf_counter()
        for r, g in enumerate(guides):
            d = self.drafts[r]
            if d:
                self.written[r] = g.fill_drafts(self.bitmask, self.first[r], d)
            else:
                g.fill(self.bitmask, self.first[r])
                self.written[r] = 1
        self.compute_s = time.perf_counter() - t0

    def result(self) -> dict[tuple[int, int], torch.Tensor]:
        """Wait for the masks; ``{(row, position): float32 [vocab] of 0 / -inf}`` (see the class docstring)."""
        if self.future is None:
            return {}
        t0 = time.perf_counter()
        self.future.result()
        self.wait_s = time.perf_counter() - t0
        masks = mask_bias(self.bitmask, self.vocab_size)
        return {(i, j): masks[self.first[r] + j] for r, i in enumerate(self.index) for j in range(self.written[r])}
