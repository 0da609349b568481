"""Memory accounting of an engine: the bytes of its weights, a step's workspace and the KV pool, from ``config.json``
and the weight headers before anything is loaded. The engine's start-up (:mod:`turbo.core.startup`) sizes its pool
with it, and ``liteturbo plan`` (:mod:`turbo.plan`) reports it.

Memory of a running engine, in four parts (all in bytes):

* **weights**: what the backend holds after loading, counted per linear by the backend's own
  :meth:`backends.base.Backend.linear_nbytes` (packed codes, scales, zero points in its layout), plus the 16-bit
  embedding table, the lm_head (none when tied to the embeddings, int8 + per-channel scales when the engine
  runs it as weight-only int8), the norms, and the rotary cos/sin tables (float32 ``[max_position, head_dim]``
  each). ``tests/test_planner.py`` checks these figures equal the tensors the engine allocates.
* **workspace**: transient tensors of the largest step (an upper-bound estimate, see :func:`workspace_breakdown`):
  activations of a prefill chunk of ``max_num_batched_tokens`` tokens, the dense copy of a quantized weight when a
  chunk is large enough to be dequantized for one GEMM, attention scratch (contexts gathered per layer by
  backends without a paged-attention kernel; split-KV partials), logits and sampling for ``max_batch_size`` rows.
* **KV pool**: blocks of ``block_size`` tokens, each token costing
  :meth:`backends.kv_cache.KVCacheSpec.bytes_per_token` (all layers, keys and values, int8/int4 scales included).
* **reserve** (accelerators only, planner only): CUDA/ROCm/NPU context, library workspaces and allocator slack,
  :data:`ACCELERATOR_RESERVE`. At start-up the engine measures free memory instead, which already excludes it.

Pool sizing (:func:`size_pool`, used by the engine and by :func:`turbo.plan.plan`): ``available = free − workspace`` where
``free`` is the memory left once the weights are loaded (what the device reports, so memory other processes use is
accounted for); the pool takes ``cache_max_entry_count`` (default :data:`POOL_FRACTION` on accelerators) of
``available``, or the fixed size asked for (``num_blocks``, ``kv_cache_gib``, ``max_kv_tokens``; on CPUs the default
is :data:`CPU_DEFAULT_KV_TOKENS` tokens), which must fit in ``available``. The workspace grows with the prefill chunk,
so a larger chunk never makes the pool hold more tokens.

Tensor parallelism (``tp`` ranks, :mod:`turbo.core.tp`): every figure is per rank, for rank 0 (the largest: it holds
the row-parallel biases and the widest vocabulary range, and samples from the gathered logits); each rank has its
own device and a pool of as many blocks, each block holding that rank's KV heads.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from backends import Backend, KVCacheSpec, LinearSpec
from lite.formats import LiteturboError

from .tp.shard import rank_config

GiB = 2**30
MiB = 2**20
ACCELERATOR_RESERVE = GiB  # context + cuBLAS/Triton workspaces + allocator slack on a GPU/NPU (planner estimate)
POOL_FRACTION = 0.9  # share of the memory left after weights and workspace the KV pool takes by default (GPU/NPU)
CPU_DEFAULT_KV_TOKENS = 16384
SAMPLING_BYTES_PER_LOGIT = 16  # float32 probabilities + sorted float32 values + int64 indices (top-k/top-p)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_UNITS = {"": GiB, "b": 1, "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000, "m": MiB, "mi": MiB, "mib": MiB,
          "mb": 10**6, "g": GiB, "gi": GiB, "gib": GiB, "gb": 10**9, "t": 2**40, "ti": 2**40, "tib": 2**40,
          "tb": 10**12}


def parse_memory(text: str | int | float) -> int:
    """Bytes from ``"24GiB"`` / ``"24Gi"`` / ``"24G"`` (binary), ``"24 GB"`` (10^9), ``"24000MiB"``, ``"24"`` (a bare
    number is GiB). Raises ``LiteturboError`` for anything else or a size that is not positive and finite."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise LiteturboError(f"cannot read the memory size {text!r}; write it as 24GiB (or 24Gi, 24G), 24GB "
                                 f"(10^9 bytes), 24000MiB or 24 (GiB)")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not (0 < value < math.inf):
        raise LiteturboError(f"the memory size must be positive and finite, got {text!r}")
    return int(value * _UNITS[unit])


def gib(n: int | float) -> str:
    """``n`` bytes as GiB with two decimals (``"1.25 GiB"``)."""
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class WeightChoice:
    """How the decoder linears are stored: ``bits`` 16 (dense, compute dtype) or 2..8 (group-quantized with
    ``group_size``, ``act_order`` g_idx, scales in ``scales_dtype``); ``lm_head_int8``: the output projection as
    weight-only int8 (what the engine does for quantized checkpoints on CPU, ``lm_head="auto"``)."""

    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    scales_dtype: torch.dtype = torch.float16
    lm_head_int8: bool = False


def _specs(shapes, w: WeightChoice) -> list[LinearSpec]:
    return [LinearSpec(o, i, bits=w.bits, group_size=w.group_size if w.bits < 16 else -1, act_order=w.act_order,
                       bias=b, scales_dtype=w.scales_dtype) for o, i, b in shapes]


def decoder_linear_specs(cfg, w: WeightChoice, layer: int | None = None) -> list[LinearSpec]:
    """The linears of one decoder layer as the loader builds them (q/k/v fused, gate/up fused); the dense MLP is
    left out for a sparse layer ``layer`` of a Mixture-of-Experts model (:func:`expert_linear_specs` holds its
    experts). ``cfg`` is a :class:`turbo.core.model.ModelConfig`."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = [(q + 2 * kv, h, cfg.qkv_bias), (h, q, cfg.o_bias)]
    if cfg.moe is None or layer is None or not cfg.moe.sparse[layer]:
        shapes += [(2 * inter, h, cfg.mlp_bias), (h, inter, cfg.mlp_bias)]
    return _specs(shapes, w)


def expert_linear_specs(cfg, w: WeightChoice) -> tuple[list[LinearSpec], list[LinearSpec]]:
    """One sparse layer's ``(expert linears, shared-expert linears)``: each expert's fused gate/up and down (the
    first list has ``2 * num_experts`` entries) and the shared expert's, if any."""
    h, moe = cfg.hidden_size, cfg.moe
    one = [(2 * moe.intermediate_size, h, False), (h, moe.intermediate_size, False)]
    shared = moe.shared_intermediate_size
    return (_specs(one * moe.num_experts, w),
            _specs([(2 * shared, h, False), (h, shared, False)] if shared else [], w))


def parameter_counts(cfg) -> tuple[int, int]:
    """``(total, active)`` parameters of ``cfg`` (a :class:`turbo.core.model.ModelConfig`): every weight, and those
    one token uses (the ``top_k`` selected experts of each sparse layer, not the others; the embedding table counted
    whole in both, a tied lm_head once), as the model cards count them."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.qkv_bias else 0)
    qk = (2 * hd if cfg.qk_norm_per_head else q + kv) if cfg.qk_norm else 0
    per_layer_fixed = attn + 2 * h + qk
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    total = active = embed + cfg.num_layers * per_layer_fixed
    for i in range(cfg.num_layers):
        if cfg.moe is not None and cfg.moe.sparse[i]:
            m = cfg.moe
            one = 3 * h * m.intermediate_size
            shared = 3 * h * m.shared_intermediate_size + (h if m.shared_intermediate_size else 0)
            total += m.num_experts * one + shared + m.num_experts * h
            active += m.top_k * one + shared + m.num_experts * h
        else:
            dense = 3 * h * cfg.intermediate_size
            total += dense
            active += dense
    return total, active


def decode_weight_bytes(cfg, backend_cls: type[Backend], device_type: str, dtype: torch.dtype, w: WeightChoice,
                        tp: int = 1) -> dict[str, int]:
    """Bytes of weights one batch-1 decode step reads (per rank), by part: ``decoder linears`` (attention, dense
    MLPs), ``experts`` (the ``top_k`` selected experts of each sparse layer and the shared expert: what a
    Mixture-of-Experts model reads per token), ``routers``, ``lm_head``, ``norms``. For a dense model it is the weight
    breakdown without the embedding table (one row is read) and the rotary tables."""
    full = weight_breakdown(cfg, backend_cls, device_type, dtype, w, tp)
    out = {k: full[k] for k in ("decoder linears", "routers", "lm_head", "norms")}
    out["experts"] = 0
    if cfg.moe is not None:
        rc = rank_config(cfg, tp)
        experts, shared = expert_linear_specs(rc, w)
        one = sum(backend_cls.linear_nbytes(s, dtype, device_type) for s in experts[:2])
        sh = sum(backend_cls.linear_nbytes(s, dtype, device_type) for s in shared)
        out["experts"] = sum(cfg.moe.sparse) * (cfg.moe.top_k * one + sh)
    if not w.lm_head_int8 and cfg.tie_word_embeddings:
        out["lm_head"] = full["embeddings"]
    return out


def weight_breakdown(cfg, backend_cls: type[Backend], device_type: str, dtype: torch.dtype,
                     w: WeightChoice, tp: int = 1) -> dict[str, int]:
    """Bytes the engine holds for the weights, by part: ``decoder linears`` (attention and dense MLPs), ``experts``
    (every expert of every sparse layer, and the shared experts), ``routers`` (float32 routers and the compute-dtype
    shared-expert gates),
    ``embeddings``, ``lm_head``, ``norms``, ``rotary tables`` (see the module docstring); per rank (rank 0) with ``tp``
    ranks. ``cfg`` is a
    :class:`turbo.core.model.ModelConfig` of the whole model."""
    cfg = rank_config(cfg, tp)
    e = torch.empty((), dtype=dtype).element_size()
    nbytes = lambda specs: sum(backend_cls.linear_nbytes(s, dtype, device_type) for s in specs)  # noqa: E731
    linears = sum(nbytes(decoder_linear_specs(cfg, w, i)) for i in range(cfg.num_layers))
    experts = routers = 0
    if cfg.moe is not None:
        sparse = sum(cfg.moe.sparse)
        experts = sparse * sum(nbytes(specs) for specs in expert_linear_specs(cfg, w))
        # the routers in float32 (turbo.core.model), the shared-expert gate in the compute dtype
        routers = sparse * (cfg.moe.num_experts * 4 + (e if cfg.moe.shared_intermediate_size else 0)) * cfg.hidden_size
    embed = cfg.vocab_size * cfg.hidden_size * e
    if w.lm_head_int8:
        lm_head = backend_cls.linear_nbytes(LinearSpec(cfg.vocab_size, cfg.hidden_size, int8_per_channel=True),
                                            dtype, device_type)
    else:
        lm_head = 0 if cfg.tie_word_embeddings else embed
    qk = 0
    if cfg.qk_norm:
        qk = 2 * cfg.head_dim if cfg.qk_norm_per_head else (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    norms = (cfg.num_layers * (2 * cfg.hidden_size + qk) + cfg.hidden_size) * e
    rotary = 2 * max(cfg.max_position_embeddings, 1) * cfg.head_dim * 4
    return {"decoder linears": linears, "experts": experts, "routers": routers, "embeddings": embed,
            "lm_head": lm_head, "norms": norms, "rotary tables": rotary}


def workspace_breakdown(cfg, backend_cls: type[Backend], dtype: torch.dtype, kv_cache_dtype: str,
                        quantized: bool, lm_head_int8: bool, max_num_batched_tokens: int, max_batch_size: int,
                        session_len: int, batch_invariant: bool = False,
                        context_tokens: int | None = None, tp: int = 1,
                        kv_in_place: bool | None = None) -> dict[str, int]:
    """Upper-bound estimate of the transient memory of one step, by part (bytes); per rank (rank 0) with ``tp``
    ranks: its heads and MLP features, its vocabulary rows' logits and the whole vocabulary's gathered float32
    logits it samples from.

    T = ``max_num_batched_tokens`` (tokens of one step), B = ``max_batch_size`` (rows that need logits),
    C = ``session_len`` (longest context), E = bytes of ``dtype``:

    * ``activations``: everything a layer keeps alive at once for T tokens: residual, normed input, fused QKV,
      rotated q/k, attention output, gate/up, SiLU product and the MLP output, plus float32 norm statistics.
    * ``dequantized weight``: the largest quantized linear as a dense ``dtype`` weight plus its uint8 codes, when
      T reaches the backend's ``dequant_min_rows`` (never with ``batch_invariant``).
    * ``attention``: a backend that does not read K/V in place (``kv_in_place``; default the backend class's
      ``paged_attention``, :meth:`backends.base.Backend.reads_kv_in_place` says it for a cache dtype) gathers
      contexts per layer (keys and values in ``dtype``; with an int8/int4 cache also the codes and a float32 copy):
      for a chunked prefill of T tokens over C, with the ``T x C`` mask (and, with ``batch_invariant``, float32
      scores and probabilities ``H x T x C``: the matmul path; otherwise SDPA's fused kernel keeps no scores), or
      for a decode batch over ``context_tokens`` (default ``B x C``; the engine caps it by the pool) with its
      float32 scores; one sequence's C is capped by ``context_tokens`` too (no sequence outgrows the pool). A paged
      kernel gathers only a whole prompt's own keys and values and keeps float32 split-KV partials.
    * ``logits and sampling``: B rows of logits in ``dtype`` and float32, :data:`SAMPLING_BYTES_PER_LOGIT` per logit
      for sampling, and the int8 lm_head's dequantized tile.
    """
    e = torch.empty((), dtype=dtype).element_size()
    vocab, cfg = cfg.vocab_size, rank_config(cfg, tp)
    t, b, c = max_num_batched_tokens, max_batch_size, session_len
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    qkv = (nh + 2 * nkv) * hd
    act = t * e * (3 * h + qkv + 2 * (nh + nkv) * hd + nh * hd + 4 * inter) + t * h * 8
    if cfg.moe is not None:  # T x top_k expert rows: gathered inputs, gate/up, SiLU product, outputs; routing
        rows = t * cfg.moe.top_k
        act += rows * e * (2 * h + 3 * cfg.moe.intermediate_size) + rows * 24 + t * cfg.moe.num_experts * (e + 4)
    dequant = 0
    if quantized and not batch_invariant and t >= backend_cls.dequant_min_rows:
        dequant = max(qkv * h, h * nh * hd, 2 * inter * h, h * inter) * (e + 1)
    kv_quant = kv_cache_dtype in ("int8", "int4")
    gather_per_token = 2 * nkv * hd * (e + (5 if kv_quant else 0))
    if kv_in_place is None:
        kv_in_place = backend_cls.paged_attention
    if kv_in_place:
        if context_tokens is not None:
            c = min(c, context_tokens)
        parts = -(-c // 512)
        attn = t * gather_per_token + b * nh * parts * (hd + 2) * 4
    else:
        ctx = b * c if context_tokens is None else min(context_tokens, b * c)
        c = min(c, ctx)  # one sequence's context: at most what the pool holds
        prefill = c * gather_per_token + t * c + (nh * t * c * (8 + e) if batch_invariant else 0)
        decode = ctx * (gather_per_token + nh * (8 + e))
        attn = max(prefill, decode)
    rows = min(b, t)
    logits = rows * cfg.vocab_size * (e + 4) + rows * vocab * (SAMPLING_BYTES_PER_LOGIT + (4 if tp > 1 else 0))
    if lm_head_int8:
        logits += min(4096, cfg.vocab_size) * h * e
    return {"activations": act, "dequantized weight": dequant, "attention": attn, "logits and sampling": logits}


def kv_spec(cfg, kv_cache_dtype: str, block_size: int, num_blocks: int = 1, tp: int = 1) -> KVCacheSpec:
    """The :class:`~backends.kv_cache.KVCacheSpec` the engine allocates for ``cfg`` (on each rank, with ``tp``
    ranks). Raises ``LiteturboError`` for a dtype the cache cannot hold (e.g. int4 with an odd head_dim)."""
    cfg = rank_config(cfg, tp)
    try:
        return KVCacheSpec(kv_cache_dtype, num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    except ValueError as e:
        raise LiteturboError(str(e)) from None


@dataclass
class PoolSize:
    """Result of :func:`size_pool`: ``blocks`` to allocate (0 = does not fit), ``available`` bytes for the pool
    (free − workspace), ``asked`` bytes the option asks for, and ``what`` (the option that decided)."""

    blocks: int
    available: int
    asked: int
    what: str


def _requested(bytes_per_block: int, block_size: int, num_blocks, kv_cache_gib, cache_max_entry_count, max_kv_tokens,
               accelerator: bool) -> tuple[int | None, float | None, str]:
    """(fixed blocks or None, fraction or None, the option's name=value) for the pool options."""
    if num_blocks is not None:
        return num_blocks, None, f"num_blocks={num_blocks}"
    if kv_cache_gib is not None:
        return int(kv_cache_gib * GiB // bytes_per_block), None, f"kv_cache_gib={kv_cache_gib}"
    if cache_max_entry_count is not None or (accelerator and max_kv_tokens is None):
        frac = POOL_FRACTION if cache_max_entry_count is None else cache_max_entry_count
        return None, frac, f"cache_max_entry_count={frac}"
    tokens = CPU_DEFAULT_KV_TOKENS if max_kv_tokens is None else max_kv_tokens
    return -(-tokens // block_size), None, f"max_kv_tokens={tokens}"


def size_pool(free: int, workspace, bytes_per_block: int, block_size: int, *, num_blocks: int | None = None,
              kv_cache_gib: float | None = None, cache_max_entry_count: float | None = None,
              max_kv_tokens: int | None = None, accelerator: bool = False,
              context_cap: int | None = None) -> tuple[PoolSize, dict[str, int]]:
    """Size the KV pool and the workspace together; returns ``(PoolSize, workspace parts)``.

    ``workspace(context_tokens)`` gives the workspace parts when decode attention gathers at most ``context_tokens``
    tokens (see :func:`workspace_breakdown`; a backend that reads K/V in place is given the pool's tokens, which
    bound one sequence's context); ``context_cap`` is the most it could gather (``max_batch_size x
    session_len``), ``None`` when the backend reads K/V in place (nothing gathered). The pool option: ``num_blocks``,
    ``kv_cache_gib``, ``max_kv_tokens`` (fixed sizes), ``cache_max_entry_count`` (a fraction of ``free − workspace``);
    none: :data:`POOL_FRACTION` on accelerators, :data:`CPU_DEFAULT_KV_TOKENS` tokens on CPUs. A gathering backend
    never gathers more tokens than the pool holds, so the workspace is sized for ``min(context_cap, pool tokens)``;
    for a fractional pool the largest pool that satisfies that is found by bisection. ``blocks`` is 0 when a fixed
    size does not fit (the caller names the shortfall ``asked − available``)."""
    fixed, frac, what = _requested(bytes_per_block, block_size, num_blocks, kv_cache_gib, cache_max_entry_count,
                                   max_kv_tokens, accelerator)

    def ws_for(blocks: int | None) -> dict[str, int]:
        """The workspace parts with a pool of ``blocks`` blocks."""
        tokens = (blocks or 0) * block_size  # no step's context outgrows the pool
        return workspace(tokens if context_cap is None else min(context_cap, tokens))

    if fixed is not None:
        ws = ws_for(fixed)
        available = max(free - sum(ws.values()), 0)
        asked = fixed * bytes_per_block
        return PoolSize(fixed if 0 < asked <= available else 0, available, asked, what), ws

    def fits(n: int) -> bool:
        """Whether ``n`` blocks fit in the ``frac`` share of ``free`` bytes left after the workspace for them."""
        return n * bytes_per_block <= frac * max(free - sum(ws_for(n).values()), 0)

    lo, hi = 0, int(frac * max(free - sum(ws_for(0).values()), 0) // bytes_per_block)
    while lo < hi:  # the largest n with fits(n): fits is monotone (the workspace grows with the pool)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    ws = ws_for(lo)
    return PoolSize(lo, max(free - sum(ws.values()), 0), lo * bytes_per_block, what), ws


# --------------------------------------------------------------------------------------------------------------
def weight_choice(path, raw_config: dict, lm_head_int8: bool, bits: int | None = None,
                  group_size: int | None = None) -> WeightChoice:
    """How a checkpoint's linears are stored (its ``quantization_config`` and, when weight files are present, the
    dtype of its scales from the headers); ``bits``/``group_size`` override (a 16-bit checkpoint planned as it
    would be after ``lite``). Raises ``LiteturboError`` for a quantization config liteturbo cannot load."""
    from lite.formats import LazyStateDict, quantization_spec
    from lite.formats.checkpoint import weight_files

    qspec = quantization_spec(raw_config)
    qc = raw_config.get("quantization_config") or {}
    act = bool(qc.get("desc_act"))
    for g in (qc.get("config_groups") or {}).values():
        act = act or (g.get("weights") or {}).get("actorder") in ("group", "weight", "static", True)
    scales_dtype = torch.float16
    if qspec is not None and path is not None and weight_files(path) and all(f.is_file() for f in weight_files(path)):
        sd = LazyStateDict(path)
        for k in sd:
            if k.endswith(".scales") or k.endswith(".weight_scale"):
                scales_dtype = sd.dtype(k)
                break
    if bits is None:
        bits = qspec.bits if qspec else 16
    if group_size is None:
        group_size = qspec.group_size if qspec else 128
    if bits >= 16:
        return WeightChoice(16, -1, False, scales_dtype, lm_head_int8)
    return WeightChoice(bits, group_size, act and qspec is not None, scales_dtype, lm_head_int8)
