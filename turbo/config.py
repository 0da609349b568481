"""Configs of the engine and of one generation request, validated on construction."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field

import torch

from backends.cpu_threads import parse_threads
from backends.platform import Platform, current_platform
from lite.formats import LiteturboError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _coerce(obj, name: str, kind: str, optional: bool = False) -> None:
    """Check (and normalise) one field's type; ``LiteturboError`` naming the field otherwise."""
    v = getattr(obj, name)
    if v is None and optional:
        return
    if kind == "bool":
        if not isinstance(v, bool):
            raise LiteturboError(f"{name} must be True or False, got {v!r}")
    elif kind == "int":
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise LiteturboError(f"{name} must be an integer, got {v!r}")
        setattr(obj, name, int(v))
    elif kind == "float":
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise LiteturboError(f"{name} must be a number, got {v!r}")
        setattr(obj, name, float(v))
    elif kind == "str":
        if not isinstance(v, str):
            raise LiteturboError(f"{name} must be a string, got {v!r}")


KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "int8", "int4")
KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
QUANT_POLICY = {0: "auto", 8: "int8", 4: "int4"}  # LMDeploy's --quant-policy values


@dataclass
class EngineConfig:
    """Engine options.

    backend: ``"auto"`` (the best one for the device: Triton on CUDA/ROCm, Ascend on NPUs, torch elsewhere) or a
    registered backend name (``torch``, ``triton``, ``ascend``). device: ``"auto"`` (a GPU, then an NPU, then the
    CPU), ``"cpu"``, ``"cuda[:N]"``, ``"npu[:N]"``; resolved by :func:`backends.platform.current_platform`. dtype:
    compute dtype, ``"auto"`` = the platform's default (bfloat16 where native, else float16 on accelerators and
    float32 on CPUs).
    block_size: tokens per KV block. KV pool size (accounting in :mod:`turbo.core.planner`), at most one of:
    ``num_blocks``; ``kv_cache_gib`` (absolute); ``cache_max_entry_count`` (fraction of the memory left after the
    weights and a step's workspace: free GPU/NPU memory, or available RAM on CPU, as LMDeploy's option);
    ``max_kv_tokens`` (rounded up to whole blocks); none set: 0.9 of that memory on GPUs/NPUs, 16,384 tokens on
    CPUs. A pool that does not fit is refused at start-up with the shortfall.
    session_len: longest token history of one sequence (default: the model's max_position_embeddings,
    capped by the pool; a larger explicit value than the pool holds is refused). max_num_batched_tokens: tokens computed per step (long prompts are chunked to fit).
    max_batch_size: sequences in the persistent batch at most.
    batch_invariant: kernels chosen per token, never by the step's size, so that in 16-bit a request's
    greedy output does not depend on what it was batched with or on prefix-cache hits (bit-exact); costs
    about 2x prefill speed on CPU. Off, outputs can differ in near-ties after rounding (float32: rarely).
    kv_cache_dtype: storage of the KV cache, one of :data:`KV_CACHE_DTYPE_CHOICES`: ``"auto"`` = the compute
    dtype; ``"int8"``/``"int4"`` quantize each token's keys and values per KV head (asymmetric, scales beside
    each block; see :mod:`backends.kv_cache`). quant_policy: LMDeploy's spelling of the same choice (0 = 16-bit,
    8 = int8, 4 = int4); giving both with different meanings is refused. kv_calibration: use the calibrated key
    parameters a checkpoint carries (``liteturbo lite calibrate-kv``) when the cache is int8/int4; ``False``
    keeps the online mode. kv_rotation: without calibrated parameters, store each head's keys and values
    Hadamard-rotated in an int8/int4 cache (:meth:`backends.kv_cache.KVQuantParams.rotation_only`; the query and
    the attention output are rotated instead of every cached token): ``None`` (default) = on for int4 when
    ``head_dim`` is a power of two, off otherwise; ``True`` asks for it (refused at start-up for a head size that
    is not a power of two); ``False`` = plain per-token quantization. enforce_eager: never replay decode steps as CUDA graphs (on CUDA with a backend whose
    decode path is graph-safe they are by default, see :mod:`turbo.core.cuda_graphs`).
    threads: torch's CPU threads (process-wide), see :mod:`backends.cpu_threads`: ``None``/``"auto"`` (default;
    ``$LITETURBO_THREADS`` when set) = torch's count capped to the cores this process may use (affinity, cgroup
    quota), lowered during decode on a CPU device while another process takes cores and raised back after;
    ``N > 0`` = exactly N, fixed; ``-K`` = the usable cores less K (at least 1), adaptive.
    tensor_parallel_size: ranks the model is split over (:mod:`turbo.core.tp`): this process is rank 0 and
    spawns the others (``torch.multiprocessing``, spawn: a script that builds such an engine needs the
    ``if __name__ == "__main__":`` guard), one device each (``cuda:i``/``npu:i`` counting from ``device``'s index;
    on a CPU all share it); heads, MLP features and the vocabulary are split, so each rank holds about 1/N of the
    weights and KV (default 1; the command line's ``--tp``). A split that breaks
    a head or a quantization group is refused at start-up, naming the sizes that work.
    session_host_gib: the host tier of session KV (:mod:`turbo.core.kv_tier`): when the pool needs room, an idle
    session's KV moves, in its stored form, to host memory under this budget (least recently spilled leave first) and
    its next turn copies it back instead of recomputing (default 0: off; the command line's
    ``--session-host-gib``). On a CPU the host tier is a separate budget beside the pool.
    session_overflow: a session turn that would exceed ``session_len``: ``"refuse"`` (default; the error gives both
    numbers and the session stays as it was) or ``"drop-oldest"`` (the oldest whole turns are dropped, the system
    prompt kept, until it fits; the session then forgets them; the command line's ``--session-overflow``).
    speculative_drafter: where speculating requests (``GenerationConfig.speculative``) draft from:
    ``"suffix"`` (default: the longest earlier match of their tail in their own history or the server's recent
    outputs, draft length adapted per request) or ``"ngram"`` (prompt lookup: the last 3, then 2 tokens in their own
    history, fixed length); see :mod:`turbo.core.speculative`. speculative_recent_tokens: tokens of recent outputs
    kept for those drafts (default 65,536; 0: none).
    """

    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 64
    max_kv_tokens: int | None = None
    num_blocks: int | None = None
    kv_cache_gib: float | None = None
    cache_max_entry_count: float | None = None
    session_len: int | None = None
    max_num_batched_tokens: int = 1024
    max_batch_size: int = 64
    lm_head: str = "auto"
    enable_prefix_caching: bool = True
    batch_invariant: bool = False
    kv_cache_dtype: str = "auto"
    quant_policy: int | None = None
    kv_calibration: bool = True
    kv_rotation: bool | None = None
    enforce_eager: bool = False
    threads: int | str | None = None  # CPU threads: None/"auto", N, or -K (see backends.cpu_threads)
    tensor_parallel_size: int = 1
    session_host_gib: float = 0.0
    session_overflow: str = "refuse"
    speculative_drafter: str = "suffix"
    speculative_recent_tokens: int = 65536

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        for name in ("backend", "device", "dtype", "lm_head"):
            _coerce(self, name, "str")
        self.backend = self.backend.strip().lower()
        for name in ("block_size", "max_num_batched_tokens", "max_batch_size", "tensor_parallel_size"):
            _coerce(self, name, "int")
        for name in ("num_blocks", "session_len", "quant_policy", "max_kv_tokens"):
            _coerce(self, name, "int", optional=True)
        for name in ("kv_cache_gib", "cache_max_entry_count"):
            _coerce(self, name, "float", optional=True)
        _coerce(self, "session_host_gib", "float")
        _coerce(self, "session_overflow", "str")
        _coerce(self, "speculative_drafter", "str")
        _coerce(self, "speculative_recent_tokens", "int")
        if self.speculative_drafter not in ("suffix", "ngram"):
            raise LiteturboError(f"speculative_drafter must be 'suffix' or 'ngram', got {self.speculative_drafter!r}")
        if self.speculative_recent_tokens < 0:
            raise LiteturboError(f"speculative_recent_tokens must be >= 0 (0: no drafts from recent outputs), got "
                                 f"{self.speculative_recent_tokens}")
        if self.session_overflow not in ("refuse", "drop-oldest"):
            raise LiteturboError(f"session_overflow must be 'refuse' or 'drop-oldest', got {self.session_overflow!r}")
        if not 0 <= self.session_host_gib < math.inf:
            raise LiteturboError(f"session_host_gib must be a finite number of GiB >= 0 (0: no host tier), got "
                                 f"{self.session_host_gib}")
        for name in ("enable_prefix_caching", "batch_invariant", "kv_calibration", "enforce_eager"):
            _coerce(self, name, "bool")
        _coerce(self, "kv_rotation", "bool", optional=True)
        _coerce(self, "kv_cache_dtype", "str")
        self.kv_cache_dtype = KV_ALIASES.get(self.kv_cache_dtype.lower(), self.kv_cache_dtype.lower())
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise LiteturboError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)} (case-insensitive; "
                                 f"aliases bf16, fp16, half, fp32, float), got {self.kv_cache_dtype!r}")
        if self.quant_policy is not None:
            if self.quant_policy not in QUANT_POLICY:
                raise LiteturboError(f"quant_policy must be 0 (16-bit KV), 8 (int8) or 4 (int4), got {self.quant_policy}")
            asked = QUANT_POLICY[self.quant_policy]
            quantized = self.kv_cache_dtype in ("int8", "int4")
            if self.kv_cache_dtype != "auto" and (asked != self.kv_cache_dtype if asked != "auto" else quantized):
                raise LiteturboError(f"quant_policy={self.quant_policy} and kv_cache_dtype={self.kv_cache_dtype!r} "
                                     f"disagree; give one of them")
            if self.kv_cache_dtype == "auto":
                self.kv_cache_dtype = asked
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise LiteturboError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_batch_size", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise LiteturboError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_kv_tokens is not None and self.max_kv_tokens <= 0:
            raise LiteturboError(f"max_kv_tokens must be positive, got {self.max_kv_tokens}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise LiteturboError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_gib is not None and not (0 < self.kv_cache_gib < math.inf):
            raise LiteturboError(f"kv_cache_gib must be a positive, finite number of GiB, got {self.kv_cache_gib}")
        pool = [f"{n}={getattr(self, n)}" for n in ("num_blocks", "kv_cache_gib", "cache_max_entry_count",
                                                     "max_kv_tokens") if getattr(self, n) is not None]
        if len(pool) > 1:
            raise LiteturboError(f"give one KV pool size, not {' and '.join(pool)} (num_blocks, kv_cache_gib, "
                                 f"cache_max_entry_count and max_kv_tokens each size the whole pool)")
        if self.cache_max_entry_count is not None and not 0 < self.cache_max_entry_count <= 1:
            raise LiteturboError(f"cache_max_entry_count must be in (0, 1], got {self.cache_max_entry_count}")
        if self.lm_head not in ("auto", "int8", "16bit"):
            raise LiteturboError(f"lm_head must be auto, int8 or 16bit, got {self.lm_head!r}")
        self.platform()  # an unknown device, or one this machine lacks, fails here
        try:
            self.threads = parse_threads(self.threads)
        except ValueError as e:
            raise LiteturboError(f"threads: {e}") from None
        if self.session_len is not None and self.session_len <= 1:
            raise LiteturboError(f"session_len must be > 1, got {self.session_len}")

    def platform(self) -> Platform:
        """The :class:`~backends.platform.Platform` of ``device``. Raises ``LiteturboError`` for an unknown device or
        one this machine lacks."""
        try:
            return current_platform(self.device)
        except ValueError as e:
            raise LiteturboError(str(e)) from None

    def torch_dtype(self) -> torch.dtype:
        """The resolved compute dtype for ``device``."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return self.platform().default_dtype()

    def kv_storage_dtype(self) -> str:
        """The resolved KV cache storage dtype name (``"auto"`` → the compute dtype)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.torch_dtype()]


@dataclass(frozen=True)
class SamplingField:
    """One sampling / stopping option of a request, as both the library and the HTTP API read it.

    api: its name in the HTTP API (``None``: library only); keyword: the :class:`GenerationConfig` field. kind:
    ``"int"``, ``"float"`` (finite), ``"bool"``, ``"strs"`` (non-empty strings), ``"ids"`` (token ids >= 0) or
    ``"bias"`` (token id -> a number in [-100, 100] added to its logit, OpenAI's ``logit_bias``).
    default: the library's default (the HTTP API sets OpenAI's for ``temperature`` and ``max_tokens``). lo / hi:
    bounds (``None``: unbounded; ``lo_open`` / ``hi_open``: exclusive); a ``hi`` that is a string names another
    keyword, checked once every option is known. optional: ``None`` is allowed. api_aliases: other API names of
    the same option (given together, they must agree). api_off: an API value that means off (the default).
    """

    api: str | None
    keyword: str
    kind: str
    default: object = None
    lo: float | None = None
    hi: float | str | None = None
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False
    api_aliases: tuple[str, ...] = ()
    api_off: int | None = None


# the one owner of the sampling rules: GenerationConfig.__post_init__ and the HTTP request layer
# (turbo/serve/protocol.py) both read this table; the order is the order the API reads and shows them
SAMPLING_FIELDS = (
    SamplingField("max_tokens", "max_new_tokens", "int", 256, lo=1, api_aliases=("max_completion_tokens",)),
    SamplingField("temperature", "temperature", "float", 0.0, lo=0),
    SamplingField("top_p", "top_p", "float", 1.0, lo=0, hi=1, lo_open=True),
    SamplingField("min_p", "min_p", "float", 0.0, lo=0, hi=1),
    SamplingField("presence_penalty", "presence_penalty", "float", 0.0, lo=-2, hi=2),  # OpenAI's and vLLM's range
    SamplingField("frequency_penalty", "frequency_penalty", "float", 0.0, lo=-2, hi=2),
    SamplingField("repetition_penalty", "repetition_penalty", "float", 1.0, lo=0, lo_open=True),
    SamplingField("top_k", "top_k", "int", 0, lo=0, api_off=-1),  # -1: vLLM's spelling of off
    SamplingField("stop", "stop", "strs", ()),
    SamplingField("stop_token_ids", "stop_token_ids", "ids", ()),
    SamplingField("logit_bias", "logit_bias", "bias", {}),  # OpenAI's: token id -> bias in [-100, 100]
    SamplingField("seed", "seed", "int", None, lo=0, hi=2**63, hi_open=True, optional=True),
    SamplingField("ignore_eos", "ignore_eos", "bool", False),
    SamplingField("min_tokens", "min_new_tokens", "int", 0, lo=0, hi="max_new_tokens"),
    SamplingField(None, "logprobs", "int", 0, lo=0, hi=20),  # the HTTP API's logprobs are a response option
    SamplingField("speculative", "speculative", "int", 0, lo=0, hi=16),  # draft tokens per step (from history)
)
SAMPLING = {f.keyword: f for f in SAMPLING_FIELDS}

# what a list-valued option must be, in words (the library's and the API's messages)
LIST_KINDS = {"strs": "a list of non-empty strings", "ids": "a list of token ids (integers >= 0)"}


def bound_text(lo, hi=None, lo_open: bool = False, hi_open: bool = False) -> str:
    """A range in words: ``">= 1"``, ``"> 0"``, ``"in (0, 1]"``, ``"in [0, 2**63)"``, ``"in [0, max_new_tokens]"``."""
    if hi is None:
        return f"{'>' if lo_open else '>='} {_num_text(lo)}"
    return f"in {'(' if lo_open else '['}{_num_text(lo)}, {_num_text(hi)}{')' if hi_open else ']'}"


def _num_text(x) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return f"2**{x.bit_length() - 1}" if x >= 2**32 and x & (x - 1) == 0 else str(x)
    return f"{x:g}"


def _in_range(f: SamplingField, v, hi=None) -> bool:
    """Whether ``v`` lies in ``f``'s bounds (``hi``: the value of the keyword a string ``f.hi`` names)."""
    hi = f.hi if hi is None else hi
    if f.lo is not None and not (v > f.lo if f.lo_open else v >= f.lo):
        return False
    return hi is None or (v < hi if f.hi_open else v <= hi)


def _listed(f: SamplingField, v) -> list:
    """A list option normalised: one string / id becomes a list of it. ``LiteturboError`` naming the option."""
    if f.kind == "strs":
        v = [v] if isinstance(v, str) else v
        ok = isinstance(v, (list, tuple)) and all(isinstance(x, str) and x for x in v)
    else:
        v = [v] if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v
        ok = isinstance(v, (list, tuple, set)) and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in v)
    if not ok:
        raise LiteturboError(f"{f.keyword} must be {LIST_KINDS[f.kind]}, got {v!r}")
    return [int(x) for x in v] if f.kind == "ids" else list(v)


def _biased(f: SamplingField, v) -> dict[int, float]:
    """A ``"bias"`` option normalised to ``{token id: float}`` (ids may be given as digit strings, as JSON object
    keys are). ``LiteturboError`` naming the option."""
    want = f"{f.keyword} must map token ids (integers >= 0) to numbers in [-100, 100]"
    if not isinstance(v, dict):
        raise LiteturboError(f"{want}, got {v!r}")
    out = {}
    for k, b in v.items():
        key = int(k) if isinstance(k, str) and k.strip().isdigit() else k
        if not isinstance(key, numbers.Integral) or isinstance(key, bool) or key < 0:
            raise LiteturboError(f"{want}; the key {k!r} is not a token id")
        if not isinstance(b, numbers.Real) or isinstance(b, bool) or not math.isfinite(b) or not -100 <= b <= 100:
            raise LiteturboError(f"{want}; token {k} has {b!r}")
        out[int(key)] = float(b)
    return out


def _sampling_default(keyword: str):
    d = SAMPLING[keyword].default
    if isinstance(d, dict):
        return field(default_factory=dict)
    return field(default_factory=list) if isinstance(d, tuple) else field(default=d)


@dataclass
class GenerationConfig:
    """Sampling and stopping options of one request; names, types, ranges and defaults are
    :data:`SAMPLING_FIELDS`'s.

    max_new_tokens: generated tokens at most. temperature 0 = greedy. top_k 0 = off. top_p 1 = off.
    stop: strings that end generation (not included in the text). stop_token_ids: extra ids that end it.
    ignore_eos: keep going past EOS. seed: per-request RNG seed (``None`` = nondeterministic).
    min_p: keep tokens with probability >= min_p x the top one's (0 = off). repetition_penalty (> 0, 1 = off),
    presence_penalty / frequency_penalty (in [-2, 2], 0 = off): see :mod:`turbo.core.sampler`. min_new_tokens: EOS
    and stop ids are masked until this many tokens exist. logprobs: also return the top-n log-probabilities per
    token. logit_bias: ``{token id: bias}`` added to those tokens' logits before sampling (with the penalties,
    so logprobs see it), each in [-100, 100] (OpenAI's ``logit_bias``; -100 bans a token in practice).

    speculative: draft up to this many tokens per step from history (the request's own tokens, the server's recent
    outputs: ``EngineConfig.speculative_drafter``) and verify them in one forward (:mod:`turbo.core.speculative`),
    exactly at any temperature and with every sampling option (penalties, logit bias, constraints and logprobs
    apply at every verified position); 0 = off.

    Constrained decoding (at most one; compiled by llguidance when the request is added, see
    :mod:`turbo.core.guided`): json_schema: a JSON schema (a dict, ``True``, or its JSON text) the reply must
    match (``{"type": "object"}``: any JSON object, OpenAI's JSON mode); regex: a regular expression the whole
    reply matches; choice: the reply is exactly one of these strings; grammar: a Lark grammar in llguidance's
    dialect, or a GBNF one (it has ``::=``; converted). The grammar decides where a constrained reply ends (``min_new_tokens`` does not delay it); one
    unfinished at ``max_new_tokens`` ends with ``length``; logprobs are those of the constrained distribution.
    after_reasoning (a thinking model's reply, :mod:`turbo.reasoning_parsers`): the constraint holds only after the
    reasoning block: ``"open"`` when the prompt opened it (free text up to ``</think>``, then the constraint),
    ``"optional"`` when the reply may open it with ``<think>`` (or answer at once); ``None``: from the first token.
    Raises ``LiteturboError`` naming the option for a wrong type or a value out of range.
    """

    max_new_tokens: int = _sampling_default("max_new_tokens")
    temperature: float = _sampling_default("temperature")
    top_k: int = _sampling_default("top_k")
    top_p: float = _sampling_default("top_p")
    stop: list[str] = _sampling_default("stop")
    stop_token_ids: list[int] = _sampling_default("stop_token_ids")
    logit_bias: dict[int, float] = _sampling_default("logit_bias")
    ignore_eos: bool = _sampling_default("ignore_eos")
    seed: int | None = _sampling_default("seed")
    min_p: float = _sampling_default("min_p")
    repetition_penalty: float = _sampling_default("repetition_penalty")
    presence_penalty: float = _sampling_default("presence_penalty")
    frequency_penalty: float = _sampling_default("frequency_penalty")
    min_new_tokens: int = _sampling_default("min_new_tokens")
    logprobs: int = _sampling_default("logprobs")
    speculative: int = _sampling_default("speculative")
    json_schema: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    after_reasoning: str | None = None

    def __post_init__(self) -> None:
        self._check_constraint()
        if self.after_reasoning not in (None, "open", "optional"):
            raise LiteturboError(f"after_reasoning must be None, \"open\" or \"optional\", got {self.after_reasoning!r}")
        for f in SAMPLING_FIELDS:  # every type before any range
            if f.kind in LIST_KINDS:
                setattr(self, f.keyword, _listed(f, getattr(self, f.keyword)))
            elif f.kind == "bias":
                setattr(self, f.keyword, _biased(f, getattr(self, f.keyword)))
            else:
                _coerce(self, f.keyword, f.kind, optional=f.optional)
        for f in SAMPLING_FIELDS:
            v = getattr(self, f.keyword)
            if f.kind == "float" and not math.isfinite(v):
                raise LiteturboError(f"{f.keyword} must be a finite number, got {v}")
            if f.lo is None or v is None:
                continue
            hi = getattr(self, f.hi) if isinstance(f.hi, str) else None
            if not _in_range(f, v, hi):
                raise LiteturboError(f"{f.keyword} must be {bound_text(f.lo, f.hi, f.lo_open, f.hi_open)}, got {v}")


    def _check_constraint(self) -> None:
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) > 1:
            raise LiteturboError(f"give one constraint, not {' and '.join(given)}")
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except ValueError as e:
                raise LiteturboError(f"json_schema is not valid JSON ({e}); give a JSON schema object") from None
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise LiteturboError(f"json_schema must be a JSON schema (an object), got {self.json_schema!r}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise LiteturboError(f"{k} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise LiteturboError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def constrained(self) -> bool:
        """Whether the reply is constrained (json_schema, regex, choice or grammar)."""
        return any(getattr(self, k) is not None for k in ("json_schema", "regex", "choice", "grammar"))


def generation_config(gen: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """A request's :class:`GenerationConfig` from ``gen`` or keywords (not both). Raises ``LiteturboError`` for both,
    an unknown keyword or a bad value (``gen``'s type is checked where it is used)."""
    if gen is not None:
        if kwargs:
            raise LiteturboError(f"give generation options either as gen=GenerationConfig(...) or as keywords, "
                                 f"not both (got gen and {sorted(kwargs)})")
        return gen
    try:
        return GenerationConfig(**kwargs)
    except TypeError as e:
        raise LiteturboError(f"bad generation option: {e}") from None
