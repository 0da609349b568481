"""The small interface every kernel backend implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from .kv_cache import KVCacheSpec, KVQuantParams, PagedKVCache
from .types import AttentionMetadata, ExpertsHandle, LinearSpec, QuantizedWeight


class Backend(ABC):
    """Kernels the model runner needs. One instance per device.

    Tensors are row-major ``[T, ...]`` over the flat token batch of one step. Weights are prepared once
    at load time (``prepare_*``) into whatever the backend likes; the returned handle is opaque.
    """

    name: str = "base"
    # memory accounting (turbo.core.planner): whether decode and chunked-prefill attention read K/V in place from the
    # blocks (else they gather each sequence's context into a contiguous copy per layer), and from how many rows a
    # quantized linear is dequantized into a dense weight for one GEMM
    paged_attention: bool = False
    dequant_min_rows: int = 1 << 62
    # from how many rows an int8 lm_head whose weight is tied to the 16-bit embedding table multiplies by that
    # table instead (same storage, no extra memory); never by default
    dense_lm_head_min_rows: int = 1 << 62
    # whether a decode step (AttentionMetadata.decode_only with its device step plan) reads nothing but device
    # tensors and host ints fixed for a batch size (no host lists, no host → device copies, no synchronization), so
    # that turbo.core.cuda_graphs may capture it as a CUDA graph
    graph_safe_decode: bool = False

    def __init__(self, device: torch.device | str = "cpu", batch_invariant: bool = False) -> None:
        self.device = torch.device(device)
        # batch_invariant: a token's result must not depend on what else is in the step (kernels are then
        # chosen per token, never by the step's row count), at some speed cost; as vLLM's batch-invariant mode
        self.batch_invariant = batch_invariant

    def serving_layout_id(self, dtype: torch.dtype) -> str | None:
        """A string that names exactly how this backend lays out the weights it prepares for ``dtype`` (the kernels'
        layout versions, the CPU features and options that choose them), when those prepared weights can be saved
        and mapped back at a later load (:mod:`turbo.core.serving_layout`: their handles are tensors, plain values
        and the dataclasses of :meth:`serving_handle_types`); ``None`` (this default) when they cannot. Two
        backends with the same id prepare the same bytes from the same checkpoint."""
        return None

    def serving_handle_types(self) -> tuple[type, ...]:
        """The dataclasses of prepared weights a saved serving layout may hold for this backend (see
        :meth:`serving_layout_id`); none by default."""
        return ()

    @classmethod
    def unsupported_reason(cls, platform) -> str | None:
        """``None`` when this backend runs on ``platform`` (a :class:`~backends.platform.Platform`), else why not
        and what would fix it (one sentence, shown to users)."""
        return None

    @classmethod
    def op_coverage(cls, platform=None) -> dict[str, str]:
        """Which implementation runs each op on ``platform`` (a :class:`~backends.platform.Platform`; ``None``:
        wherever the backend runs), for ``liteturbo env``: op name → a short phrase. The keys are the ops the model
        runner calls: ``linear``, ``w4a16_linear``, ``w8a16_linear``, ``rms_norm``, ``add_rms_norm``,
        ``silu_and_mul``, ``rotary``, ``attention``, ``kv_write_int8``, ``kv_write_int4``, ``moe_route`` and ``experts``
        (a Mixture-of-Experts layer's routing and its selected experts). This default describes
        the generic methods above; backends override the entries they implement themselves."""
        generic = "torch reference (Backend default)"
        return {"linear": generic, "w4a16_linear": "backend-specific (abstract)", "w8a16_linear": generic,
                "rms_norm": "backend-specific (abstract)", "add_rms_norm": "rms_norm after an unfused add",
                "silu_and_mul": generic, "rotary": "backend-specific (abstract)",
                "attention": "backend-specific (abstract)", "kv_write_int8": "torch reference (PagedKVCache.write)",
                "kv_write_int4": "torch reference (PagedKVCache.write)",
                "moe_route": generic,
                "experts": "grouped by expert, each selected expert's linears once over its rows (Backend default)"}

    # --- memory accounting ---------------------------------------------------------------------
    @classmethod
    def reads_kv_in_place(cls, kv_cache_dtype: str, dtype: torch.dtype, device_type: str,
                          batch_invariant: bool = False) -> bool:
        """Whether this backend's attention (decode and chunked prefill) reads a ``kv_cache_dtype`` cache (``int8``,
        ``int4`` or a 16-bit dtype name) in place through the block tables, for compute ``dtype`` on
        ``device_type``; else it gathers each sequence's context into a contiguous copy per layer (the planner's
        ``attention`` workspace). This default: :attr:`paged_attention`."""
        return cls.paged_attention

    @classmethod
    def linear_nbytes(cls, spec: LinearSpec, dtype: torch.dtype, device_type: str = "cpu") -> int:
        """Bytes this backend holds on ``device_type`` (``cpu``, ``cuda``, ``npu``) for one linear prepared in the
        compute ``dtype``: what ``prepare_linear`` / ``prepare_w4a16`` / ``prepare_w8a16`` allocate for ``spec``.
        This default describes the generic handles: a dense weight (and bias) in ``dtype``; int8 codes plus one
        scale per output channel; a quantized weight kept as the canonical uint8 codes ``[out, in]``, uint8 zero
        points and scales ``[groups, out]`` (scales in ``spec.scales_dtype``), int32 g_idx for act-order. Backends
        with their own layouts override it; ``tests/test_planner.py`` checks it against the allocated tensors."""
        e = torch.empty((), dtype=dtype).element_size()
        out, inp = spec.out_features, spec.in_features
        bias = out * e if spec.bias else 0
        if spec.int8_per_channel:
            return out * inp + out * e
        if not spec.quantized:
            return out * inp * e + bias
        se = torch.empty((), dtype=spec.scales_dtype).element_size()
        return out * inp + spec.groups * out * (1 + se) + (4 * inp if spec.act_order else 0) + bias

    # --- linear layers -------------------------------------------------------------------------
    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Any:
        """Dense weight ``[out, in]`` → handle for :meth:`linear`."""
        return (weight.to(self.device, dtype).contiguous(), None if bias is None else bias.to(self.device, dtype))

    def linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """``x [T, in] @ W.T + b`` → ``[T, out]``."""
        w, b = handle
        return torch.nn.functional.linear(x, w, b)

    @abstractmethod
    def prepare_w4a16(self, qw: QuantizedWeight, dtype: torch.dtype) -> Any:
        """Repack a :class:`QuantizedWeight` once for :meth:`w4a16_linear`. Raises ``ValueError`` if unsupported."""

    @abstractmethod
    def w4a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """``x [T, in]`` (16/32-bit) times the dequantized weight → ``[T, out]`` in ``x.dtype``."""

    def prepare_w8a16(self, weight: torch.Tensor, dtype: torch.dtype) -> Any:
        """Quantize a dense weight ``[out, in]`` to int8 per output channel (symmetric, absmax) for
        :meth:`w8a16_linear`. Used for a weight-only int8 lm_head."""
        out, inp = weight.shape
        q = torch.empty(out, inp, dtype=torch.int8, device=weight.device)
        scales = torch.empty(out, dtype=torch.float32, device=weight.device)
        for i, qc, sc in int8_row_chunks(weight):
            q[i:i + len(qc)] = qc
            scales[i:i + len(sc)] = sc
        return q.to(self.device).contiguous(), scales.to(self.device, dtype)

    def w8a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """``x [T, in] @ (q * scales[:, None]).T`` → ``[T, out]`` in ``x.dtype``."""
        q, scales = handle
        return torch.nn.functional.linear(x, q.to(x.dtype)) * scales.to(x.dtype)

    # --- Mixture-of-Experts ---------------------------------------------------------------------
    def prepare_experts(self, gate_up: list, down: list, dtype: torch.dtype) -> Any:
        """The experts of one sparse layer, prepared once: ``gate_up[e]`` expert ``e``'s gate and up projections fused
        (``[2I, hidden]``, gate rows first) and ``down[e]`` its down projection (``[hidden, I]``), each a
        :class:`QuantizedWeight` (every expert) or a dense tensor (every expert). This default: an
        :class:`ExpertsHandle` of the backend's own linear handles. Raises ``ValueError`` for a mix of quantized and
        dense experts or experts of different widths."""
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"prepare_experts needs one gate_up and one down weight per expert, got {len(gate_up)} "
                             f"and {len(down)}")
        quant = [isinstance(w, QuantizedWeight) for w in (*gate_up, *down)]
        if any(quant) and not all(quant):
            raise ValueError("the experts of a layer must be all quantized or all dense")
        widths = {(w.out_features if isinstance(w, QuantizedWeight) else w.shape[0]) for w in gate_up}
        if len(widths) != 1 or next(iter(widths)) % 2:
            raise ValueError(f"the experts' gate_up weights must share one even width, got {sorted(widths)}")
        if all(quant):
            return ExpertsHandle([self.prepare_w4a16(w, dtype) for w in gate_up],
                                 [self.prepare_w4a16(w, dtype) for w in down], "w4a16", widths.pop() // 2)
        return ExpertsHandle([self.prepare_linear(w, None, dtype) for w in gate_up],
                             [self.prepare_linear(w, None, dtype) for w in down], None, widths.pop() // 2)

    def moe_route(self, x: torch.Tensor, router: torch.Tensor, top_k: int,
                  norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse MLP block's routing, as transformers' ``*SparseMoeBlock`` computes it in ``x.dtype``: logits
        ``x @ router.T`` (``router`` float32 ``[E, hidden]`` holding the checkpoint's 16-bit values; the GEMM in
        float32, rounded to ``x.dtype``), softmax in float32, the ``top_k`` largest, divided by their sum when
        ``norm_topk_prob``. ``x [T, hidden]`` → ``(topk_weights [T, k]`` in ``x.dtype``, ``topk_ids [T, k]`` int32 or
        int64 in ``[0, E))``, largest weight first. Equal logits may be ordered either way (torch.topk's choice)."""
        logits = torch.nn.functional.linear(x.float(), router).to(x.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: Any) -> torch.Tensor:
        """The routed experts of a sparse MLP block: ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) *
        up_e(x[t]))`` with ``e = topk_ids[t, j]``. ``x [T, hidden]``, ``topk_ids`` int32 or int64 ``[T, k]``, ``topk_weights``
        ``[T, k]`` in ``x.dtype`` → ``[T, hidden]`` in ``x.dtype``. This reference groups the rows by expert and runs
        each selected expert once over its rows (as ggml's ``mul_mat_id`` and vLLM's fused MoE do), through
        :meth:`linear` / :meth:`w4a16_linear` and :meth:`silu_and_mul`; each product is weighted in ``x.dtype`` and
        summed into the output in expert order (as transformers' experts loop does)."""
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=handle.num_experts).tolist()
        tokens = order // k
        weights = topk_weights.reshape(-1)[order]
        lin = self.w4a16_linear if handle.quantized == "w4a16" else self.linear
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            tok = tokens[start:start + n]
            h = self.silu_and_mul(lin(x.index_select(0, tok), handle.gate_up[e]))
            y = lin(h, handle.down[e]) * weights[start:start + n, None]
            out.index_add_(0, tok, y)
            start += n
        return out

    # --- elementwise --------------------------------------------------------------------------
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019) over the last dim, statistics in float32."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x`` (rounded to ``x.dtype``) and ``rms_norm(h)`` → ``(normed, h)``, both ``[T, hidden]``.
        Backends may fuse the two (one read of ``h``)."""
        h = residual + x
        return self.rms_norm(h, weight, eps), h

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first) → ``[T, I]`` in its dtype (SwiGLU, Shazeer 2020)."""
        inter = gate_up.shape[-1] // 2
        return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def rotary_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """RoPE of ``q [T, H, D]`` and ``k [T, KVH, D]`` (:meth:`rotary`), then the rotated keys and ``v`` stored in
        ``cache`` (:meth:`~backends.kv_cache.PagedKVCache.write`) at ``slots [T]``; returns the rotated q. Backends
        may fuse the two (the torch backend does on CPUs with its C++ extension)."""
        q, k = self.rotary(q, k, cos, sin)
        cache.write(layer, k, v, slots)
        return q

    @abstractmethod
    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Rotary position embedding (Su et al. 2021, RoFormer), rotate-half convention.

        q ``[T, H, D]``, k ``[T, KVH, D]``, cos/sin ``[T, 1, D]`` in q's dtype (gathered once per step).
        """

    # --- tensor parallelism -----------------------------------------------------------------------
    # the torch.distributed process group the ranks of a tensor-parallel engine share (set by turbo.core.tp when
    # the group is up); the two ops below are called only when the model is split (never at one rank)
    tp_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks of :attr:`tp_group` in place and return it (after a row-parallel linear and the
        vocabulary-parallel embedding). Raises ``RuntimeError`` when a rank is gone or the group timed out."""
        torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[world, *x.shape]``: every rank's ``x`` (the same shape on each) stacked in rank order (the
        vocabulary-parallel logits). Raises ``RuntimeError`` when a rank is gone or the group timed out."""
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(self.tp_group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.stack(parts)

    # --- paged KV cache -----------------------------------------------------------------------
    def allocate_kv_cache(self, spec: KVCacheSpec, compute_dtype: torch.dtype,
                          params: KVQuantParams | None = None) -> PagedKVCache:
        """The KV pool for ``spec`` on this backend's device (16-bit, int8 or int4; see :mod:`backends.kv_cache`).
        ``params``: calibrated key parameters for a quantized cache. Raises ``ValueError`` when ``params`` do not
        fit the spec, ``RuntimeError``/``MemoryError`` when the memory cannot be allocated."""
        return PagedKVCache(spec, self.device, compute_dtype, params)

    @abstractmethod
    def attention(self, q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        """Causal attention of ``q [T, H, D]`` over each sequence's context, read from ``cache`` (``layer``) after
        this step's K/V were written → ``[T, H, D]``. Scores are ``cache.attention_query(layer, q)`` against
        ``cache.gather`` keys and the result goes through ``cache.attention_output`` (identity for 16-bit and
        online caches; see :mod:`backends.kv_cache`)."""


def int8_row_chunks(weight: torch.Tensor, rows_multiple: int = 4):
    """Yield ``(first row, int8 codes [r, in], float32 scales [r])`` of ``weight [out, in]`` quantized per output
    channel (symmetric absmax: ``q = clamp(round(w / s), -127, 127)``, ``s = max |w| / 127``), about 16 MB of float32
    at a time, computed in place (a 128k-vocabulary head in float32 at once would add GBs to a load's peak memory;
    the chunk is the load's only transient beyond the weights), ``r`` a multiple of ``rows_multiple`` except in the
    last chunk."""
    out, inp = weight.shape
    step = max(rows_multiple, (16 << 20) // max(1, 4 * inp) // rows_multiple * rows_multiple)
    for i in range(0, out, step):
        w = weight[i:i + step].to(torch.float32, copy=True)
        s = (w.abs().amax(1) / 127.0).clamp(min=1e-12)
        yield i, w.div_(s[:, None]).round_().clamp_(-127, 127).to(torch.int8), s
