"""TritonBackend: the torch reference with Triton kernels where they matter on a GPU.

- W4A16 linears: weights repacked once at load (byte-level) into the tiled layout of :mod:`backends.triton.w4a16`
  (scales in the compute dtype, uint8 zero points; act-order ``g_idx`` turned into an input permutation when its
  groups are regular; irregular ``g_idx`` keeps the older :func:`~backends.triton.kernels.pack_w4` layout and
  kernel); inputs with fewer than ``dequant_min_rows`` rows run the fused kernels (a GEMV for a few rows, a
  tensor-core GEMM beyond, split-K reduced inside the kernel), larger ones dequantize into a dense weight and call
  ``torch.matmul`` (cuBLAS).
- Attention: decode rows (and, with ``batch_invariant``, every row) run the paged attention kernel over the block
  tables, dequantizing int8/int4 KV in the kernel; multi-token prefill sequences use the torch reference's SDPA.
- The KV cache is the torch backend's :class:`~backends.kv_cache.PagedKVCache` layout; int8/int4 writes
  quantize in a kernel (bit-identical to :func:`~backends.kv_cache.quantize_per_token`).
- RMSNorm (fused with the residual add) and SiLU-and-mul run as kernels on rows with a contiguous last dim.
- Mixture-of-Experts (:mod:`backends.triton.moe`): the experts' 4-bit weights, each prepared as a W4A16 linear,
  stacked on a leading expert dim (:class:`TritonW4ExpertsHandle`); the (token, expert) pairs sorted and padded by
  expert into row blocks, then two fused launches: gate and up with ``silu(gate) * up`` in the epilogue, and down
  with the routing weight multiplied in; the top-k sum in torch. Dense experts and weights the kernel does not take
  use the per-expert reference of :class:`~backends.base.Backend`.

The crossover and split-K choices are heuristics not yet tuned on a GPU (`bench/kernel_choices.py` measures them;
`bench/gpu.sh` runs it on a lent GPU).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from ..kv_cache import KVCacheSpec, KVQuantParams, PagedKVCache
from ..platform import triton_interpret
from ..torch_backend import TorchBackend, act_order_permutation
from ..types import AttentionMetadata, LinearSpec, QuantizedWeight


def triton_version() -> str | None:
    """The installed triton's version, or None."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("triton").__version__


def _kernels():
    from . import kernels

    return kernels


@dataclass
class TritonW4Handle:
    """A W4A16 weight in the kernels' layout. ``layout == "tiled"`` (:mod:`backends.triton.w4a16`): qweight int32
    ``[ceil(N/128), ceil(K/128)*16, 128]`` (:func:`~backends.triton.w4a16.pack_tiled`); ``"gptq"`` (the pre-issue-22
    kernel, :func:`~backends.triton.kernels.w4a16_gemm`, kept for irregular act-order ``g_idx``, group sizes that
    are not multiples of 8, and as the reference path): int32 ``[ceil(K/8), N]``. Both: scales ``[groups, N]``
    (compute dtype), zeros uint8 ``[groups, N]``, g_idx int32 ``[K]`` or None, in_perm int64 ``[K]`` or None
    (inputs are permuted by it first), bias ``[N]`` or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None
    in_perm: torch.Tensor | None
    group_size: int
    n: int
    k: int
    bias: torch.Tensor | None
    dtype: torch.dtype
    layout: str = "gptq"


@dataclass
class TritonW4ExpertsHandle:
    """The 4-bit experts of one sparse layer for :func:`backends.triton.moe.fused_moe_w4a16`: each expert's
    :class:`TritonW4Handle` (tiled layout) stacked on a leading expert dim. ``gate_up`` = (qweight int32
    ``[E, ceil(2I/128), ceil(H/128)*16, 128]``, scales ``[E, groups, 2I]`` in ``dtype``, zero points uint8
    ``[E, groups, 2I]``), the fused gate (first ``I`` rows) and up projections; ``down`` the same for ``[H, I]``.
    The bytes of the experts' :class:`TritonW4Handle` one by one (what :meth:`TritonBackend.linear_nbytes` counts)."""

    gate_up: tuple
    down: tuple
    group_size_gate_up: int
    group_size_down: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    dtype: torch.dtype


class TritonCache(PagedKVCache):
    """The paged KV cache with quantizing writes done by a Triton kernel (same layout and numbers)."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """See :meth:`PagedKVCache.write`."""
        if not self.spec.quantized:
            return super().write(layer, k, v, slots)
        kern = _kernels()
        kt, vt = self.stored_space(layer, k.transpose(0, 1), v.transpose(0, 1))  # [KVH, T, D]
        for x, store, sc, zp in ((kt, self.k, self.k_scale, self.k_zero), (vt, self.v, self.v_scale, self.v_zero)):
            kern.kv_write_quantized(x.transpose(0, 1), slots, store[layer], sc[layer], zp[layer], self.spec.bits)


class TritonBackend(TorchBackend):
    """Triton kernels on CUDA/ROCm (or in Triton's interpreter on CPU, for tests).

    ``dequant_min_rows``: inputs with at least this many rows dequantize the W4A16 weight and run a dense GEMM
    (not measured on a GPU yet; 128 is where AutoAWQ and vLLM's AWQ path switch). ``split_k``: fixed split-K
    factor for the fused GEMM, ``None`` = chosen per call from the tile count and the GPU's multiprocessors.
    ``fused_elementwise``: RMSNorm/SiLU kernels on (else the torch reference ops). ``attention_partition``: tokens
    per context partition of the paged attention (flash-decoding split), 0 = never split, ``None`` = 512 on a GPU
    when contexts exceed 1,024 tokens and rows x KV heads are fewer than twice the multiprocessors; with
    ``batch_invariant`` the partition never depends on the step (``None`` = 512) and every row goes through the
    partials and the combine kernel.
    """

    name = "triton"
    paged_attention = True
    graph_safe_decode = True  # decode steps read only the runner's device step plan (see _plan)
    dequant_min_rows = 128

    def __init__(self, device: torch.device | str = "cuda", batch_invariant: bool = False,
                 dequant_min_rows: int = 128, split_k: int | None = None, fused_elementwise: bool = True,
                 attention_partition: int | None = None) -> None:
        super().__init__(device, int4_kernel=False, batch_invariant=batch_invariant, cpu_kernels=False)
        self.kernels = _kernels()
        never = 1 << 62
        self.w4_dequant_min_rows = never if batch_invariant else dequant_min_rows
        self.split_k = split_k
        self.attention_partition = attention_partition
        self.fused_elementwise = fused_elementwise
        self._sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                     if self.device.type == "cuda" else 1)

    @classmethod
    def unsupported_reason(cls, platform) -> str | None:
        """Needs triton, and a CUDA/ROCm GPU or ``TRITON_INTERPRET=1`` on CPU."""
        if triton_version() is None:
            return "triton is not installed; pip install triton (Linux), or use backend='torch'"
        if platform.kind in ("cuda", "rocm"):
            return None
        if platform.kind == "cpu":
            if triton_interpret():
                return None
            return ("Triton kernels need a CUDA or ROCm GPU; on a CPU they run only in Triton's interpreter "
                    "(TRITON_INTERPRET=1, slow, for testing); use backend='torch'")
        return f"Triton does not target {platform.kind} here; use backend='ascend' or 'torch'"

    @classmethod
    def op_coverage(cls, platform=None) -> dict[str, str]:
        """See :meth:`Backend.op_coverage`."""
        interp = " (Triton interpreter)" if platform is not None and platform.kind == "cpu" else ""
        k = "triton kernel" + interp
        cov = {
            **super().op_coverage(platform),
            "linear": "torch F.linear (cuBLAS)" if not interp else "torch F.linear",
            "w4a16_linear": (f"{k}: int4 GEMV (magic-number int4 conversion, no tl.dot) up to a few rows, "
                             f"tensor-core GEMM beyond, split-K reduced in the kernel; dequantize ({k}) + matmul "
                             f"from 128 rows; torch reference for bits != 4"),
            "w8a16_linear": "dequantize + matmul (torch)",
            "rms_norm": k + " on 2-D rows (torch reference for per-head q/k norms)",
            "add_rms_norm": k + ": residual add fused with RMSNorm",
            "silu_and_mul": k, "rotary": k + " (fused with the 16-bit KV write; int8/int4: rotary, then the write kernel)",
            "attention": f"{k}: paged decode attention over block tables for decode and chunked rows (Q·Kᵀ and P·V "
                         f"as tensor-core dots over the GQA group padded to 16 rows, int8/int4 codes dotted with "
                         f"scales and zero points folded in, split-KV merged by one combine kernel); torch SDPA "
                         f"for whole-prompt prefill",
            "kv_write_int8": k + " (quantize per token and head, store)",
            "kv_write_int4": k + " (quantize, pack nibbles, store)",
            "experts": (f"{k}: fused MoE W4A16 (pairs sorted and padded by expert into 16-64-row blocks; gate and up "
                        f"with SiLU fused, then down with the routing weight, stacked 4-bit experts dequantized in "
                        f"the tensor-core loop); the per-expert reference for dense experts and weights it does not "
                        f"take (act-order, bias, groups not a multiple of 16)"),
        }
        if platform is not None and cls.unsupported_reason(platform):
            return {op: "not usable here (see the reason)" for op in cov}
        return cov

    # --- W4A16 ---------------------------------------------------------------------------------------------
    # the weight layout prepare_w4a16 produces: "tiled" (backends/triton/w4a16.py: GEMV for few rows, tensor-core
    # GEMM beyond) or "gptq" (the pre-issue-22 kernel, kernels.w4a16_gemm: the reference path of the static report
    # and GPU comparisons); set on an instance before loading to switch
    w4a16_layout = "tiled"

    @classmethod
    def linear_nbytes(cls, spec: LinearSpec, dtype: torch.dtype, device_type: str = "cuda") -> int:
        """See :meth:`Backend.linear_nbytes`: a 4-bit weight as :class:`TritonW4Handle` (int32 words of the tiled
        layout, ``ceil(out/128)*128 x ceil(in/128)*128`` codes — the gptq layout's ``ceil(in/8) x out`` words for
        group sizes that are not a multiple of 8 —, scales ``[groups, out]`` in ``dtype``, uint8 zeros
        ``[groups, out]``, int64 input permutation for act-order, bias in ``dtype``); other widths as the torch
        reference holds them."""
        if not spec.quantized or spec.bits != 4:
            return super().linear_nbytes(spec, dtype, device_type)
        from . import w4a16

        e = torch.empty((), dtype=dtype).element_size()
        out = spec.out_features
        gs = spec.in_features if spec.group_size == -1 else spec.group_size
        if cls.w4a16_layout == "tiled" and w4a16.supports(gs, spec.in_features):
            words = -(-out // 128) * 128 * (-(-spec.in_features // 128) * 16)
        else:  # the gptq layout of the older kernel
            words = -(-spec.in_features // 8) * out
        return (words * 4 + spec.groups * out * (e + 1) + (out * e if spec.bias else 0)
                + (8 * spec.in_features if spec.act_order else 0))

    def prepare_w4a16(self, qw: QuantizedWeight, dtype: torch.dtype) -> Any:
        """Repack for the fused kernels (4-bit only; other widths use the torch reference's dequantize path): the
        tiled layout, or the gptq layout for irregular act-order ``g_idx`` / group sizes not a multiple of 8."""
        if qw.bits != 4:
            return super().prepare_w4a16(qw, dtype)
        from . import w4a16

        dev = self.device
        perm = act_order_permutation(qw)
        codes = qw.qweight if perm is None else qw.qweight[:, perm]
        g_idx = None
        if perm is None and not qw.has_trivial_g_idx():
            g_idx = qw.g_idx.to(dev, torch.int32).contiguous()
        gs = qw.effective_group_size
        tiled = self.w4a16_layout == "tiled" and w4a16.supports(gs, qw.in_features, g_idx)
        packed = w4a16.pack_tiled(codes) if tiled else self.kernels.pack_w4(codes)
        bias = None if qw.bias is None else qw.bias.to(dev, dtype)
        return TritonW4Handle(packed.to(dev), qw.scales.to(dev, dtype).contiguous(),
                              qw.qzeros.to(dev, torch.uint8).contiguous(), g_idx,
                              None if perm is None else perm.to(dev), gs, qw.out_features,
                              qw.in_features, bias, dtype, "tiled" if tiled else "gptq")

    def _split_k(self, m: int, n: int, k: int) -> int:
        """The old kernel's split-K (kernels.w4a16_gemm, gptq layout)."""
        if self.split_k is not None:
            return self.split_k
        if self.device.type != "cuda" or m > 64:
            return 1
        tiles = -(-m // 16) * -(-n // 64)
        # enough programs for ~2 waves over the multiprocessors, each keeping >= 512 input channels
        return max(1, min(-(-2 * self._sms // tiles), k // 512, 16))

    def w4a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """See :meth:`Backend.w4a16_linear`."""
        if not isinstance(handle, TritonW4Handle):
            return super().w4a16_linear(x, handle)
        h = handle
        xin = x if x.dtype == h.dtype else x.to(h.dtype)
        if h.in_perm is not None:
            xin = xin.index_select(-1, h.in_perm)
        xin = xin.reshape(-1, h.k)
        if xin.stride(-1) != 1:
            xin = xin.contiguous()
        m = xin.shape[0]
        if h.layout == "tiled":
            from . import w4a16

            if m >= self.w4_dequant_min_rows:
                w = w4a16.dequantize_tiled(h.qweight, h.scales, h.zeros, h.group_size, h.n, h.k, h.dtype)
                y = torch.matmul(xin, w)
                if h.bias is not None:
                    y += h.bias
            else:
                y = w4a16.w4a16_matmul(xin, h.qweight, h.scales, h.zeros, h.group_size, h.n, h.k, h.bias,
                                       split_k=self.split_k, sms=self._sms if self.device.type == "cuda" else 1,
                                       batch_invariant=self.batch_invariant)
        elif m >= self.w4_dequant_min_rows:
            w = self.kernels.dequantize_w4(h.qweight, h.scales, h.zeros, h.group_size, h.n, h.k, h.dtype, h.g_idx)
            y = torch.matmul(xin, w)
            if h.bias is not None:
                y += h.bias
        else:
            y = self.kernels.w4a16_gemm(xin, h.qweight, h.scales, h.zeros, h.group_size, h.n, h.k, h.g_idx, h.bias,
                                        split_k=self._split_k(m, h.n, h.k))
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # --- Mixture-of-Experts ---------------------------------------------------------------------------------
    def _stacked_experts_ok(self, gate_up: list, down: list) -> bool:
        """Whether the fused MoE kernel takes these experts (else the per-expert reference runs them): all 4-bit,
        no act-order ``g_idx``, no bias, one group size per projection that the kernel takes (one group over K, or
        a multiple of 16; :func:`backends.triton.moe.kernel_takes`), the tiled W4A16 layout. Raises ``ValueError``
        when 4-bit experts disagree in shape (gate_up ``[2I, H]``, down ``[H, I]`` for every expert)."""
        from . import moe

        ws = (*gate_up, *down)
        if not gate_up or len(gate_up) != len(down) or not all(isinstance(w, QuantizedWeight) and w.bits == 4
                                                               for w in ws):
            return False
        two_i, hidden = gate_up[0].out_features, gate_up[0].in_features
        for e, (gu, dn) in enumerate(zip(gate_up, down)):
            if (gu.out_features, gu.in_features) != (two_i, hidden) or two_i % 2:
                raise ValueError(f"expert {e}'s gate_up projection is {[gu.out_features, gu.in_features]}, expected "
                                 f"{[two_i, hidden]} (every expert [2I, hidden], I the same)")
            if (dn.out_features, dn.in_features) != (hidden, two_i // 2):
                raise ValueError(f"expert {e}'s down projection is {[dn.out_features, dn.in_features]}, expected "
                                 f"{[hidden, two_i // 2]} ([hidden, I])")
        if self.w4a16_layout != "tiled" or any(w.bias is not None or not w.has_trivial_g_idx() for w in ws):
            return False
        for proj in (gate_up, down):
            sizes = {w.effective_group_size for w in proj}
            if len(sizes) != 1 or not moe.kernel_takes(proj[0].group_size, proj[0].in_features):
                return False
        return True

    def prepare_experts(self, gate_up: list, down: list, dtype: torch.dtype) -> Any:
        """See :meth:`Backend.prepare_experts`. 4-bit experts the fused kernel takes (:meth:`_stacked_experts_ok`):
        one :class:`TritonW4ExpertsHandle`, each expert prepared by :meth:`prepare_w4a16` and copied into the
        stacked tensors (one expert's transient copy at a time); otherwise (dense experts, act-order, bias, other
        widths or group sizes) the generic :class:`~backends.types.ExpertsHandle` of per-expert handles."""
        if not self._stacked_experts_ok(gate_up, down):
            return super().prepare_experts(gate_up, down, dtype)

        def stack(ws: list) -> tuple:
            out = None
            for e, w in enumerate(ws):
                h = self.prepare_w4a16(w, dtype)
                assert h.layout == "tiled" and h.in_perm is None and h.g_idx is None and h.bias is None
                parts = (h.qweight, h.scales, h.zeros)
                if out is None:
                    out = tuple(torch.empty((len(ws), *t.shape), dtype=t.dtype, device=t.device) for t in parts)
                for dst, src in zip(out, parts):
                    dst[e].copy_(src)
                del h, parts
            return out

        return TritonW4ExpertsHandle(stack(gate_up), stack(down), gate_up[0].effective_group_size,
                                     down[0].effective_group_size, gate_up[0].in_features,
                                     gate_up[0].out_features // 2, len(gate_up), dtype)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: Any) -> torch.Tensor:
        """See :meth:`Backend.experts`. A :class:`TritonW4ExpertsHandle`: :func:`backends.triton.moe.fused_moe_w4a16`
        (two launches over every selected expert, ``h`` and the weighted products in the compute dtype, the top-k
        sum in torch); other handles: the per-expert reference. Raises ``ValueError`` for shapes that disagree, and,
        off CUDA devices, for expert ids outside ``[0, E)`` (on a GPU that check would synchronize every layer:
        out-of-range ids there fail in the routing's ``scatter_add_`` with a device-side assertion)."""
        if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"experts needs x [T, hidden] and topk_ids [T, k], got {tuple(x.shape)} and "
                             f"{tuple(topk_ids.shape)}")
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must have topk_ids' shape "
                             f"{tuple(topk_ids.shape)}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if not isinstance(handle, TritonW4ExpertsHandle):
            return super().experts(x, topk_ids, topk_weights, handle)
        from . import moe

        h = handle
        if x.shape[1] != h.hidden_size:
            raise ValueError(f"x has {x.shape[1]} features, the experts take hidden_size={h.hidden_size}")
        if topk_ids.device.type != "cuda" and topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < 0 or hi >= h.num_experts:
                raise ValueError(f"topk_ids must lie in [0, {h.num_experts}), got ids {lo}..{hi}")
        xin = x if x.dtype == h.dtype else x.to(h.dtype)
        if xin.stride(-1) != 1:
            xin = xin.contiguous()
        ids = topk_ids if topk_ids.dtype == torch.int64 else topk_ids.long()
        y = moe.fused_moe_w4a16(xin, ids, topk_weights, h.gate_up, h.down, h.group_size_gate_up, h.group_size_down,
                                h.intermediate_size, sms=self._sms if self.device.type == "cuda" else 1,
                                batch_invariant=self.batch_invariant)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # --- rotary + KV write -----------------------------------------------------------------------------------
    def _rotary_ok(self, q, k, v) -> bool:
        return (self.fused_elementwise and q.shape[-1] % 2 == 0 and q.dtype == k.dtype == v.dtype
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)

    def rotary(self, q, k, cos, sin):
        """See :meth:`Backend.rotary`: one Triton launch for q and k (:mod:`backends.triton.rotary`)."""
        if not self._rotary_ok(q, k, k):
            return super().rotary(q, k, cos, sin)
        from .rotary import rotary_kv_write

        return rotary_kv_write(q, k, k, cos, sin)

    def rotary_write(self, q, k, v, cos, sin, cache: PagedKVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """See :meth:`Backend.rotary_write`: rotary and, for a 16/32-bit cache, the K/V store in one Triton launch;
        an int8/int4 cache gets the rotated keys from that launch and its quantizing write kernel."""
        if not self._rotary_ok(q, k, v):
            return super().rotary_write(q, k, v, cos, sin, cache, layer, slots)
        from .rotary import rotary_kv_write

        if cache.spec.quantized:
            q_out, k_rot = rotary_kv_write(q, k, v, cos, sin)
            cache.write(layer, k_rot, v, slots)
            return q_out
        return rotary_kv_write(q, k, v, cos, sin, cache.k[layer], cache.v[layer], slots)[0]

    # --- elementwise ----------------------------------------------------------------------------------------
    def _rows(self, x: torch.Tensor) -> bool:
        return self.fused_elementwise and x.dim() == 2 and x.stride(-1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Kernel on 2-D rows; the torch reference otherwise (e.g. Qwen3's per-head q/k norms)."""
        if not self._rows(x):
            return super().rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        """``residual + x`` and its RMSNorm in one kernel (see :meth:`Backend.add_rms_norm`)."""
        if not (self._rows(x) and self._rows(residual)):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.kernels.rms_norm(x, weight, eps, residual=residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` in one kernel."""
        if not self._rows(gate_up):
            return super().silu_and_mul(gate_up)
        return self.kernels.silu_and_mul(gate_up)

    # --- paged KV -------------------------------------------------------------------------------------------
    def allocate_kv_cache(self, spec: KVCacheSpec, compute_dtype: torch.dtype,
                          params: KVQuantParams | None = None) -> PagedKVCache:
        """A :class:`TritonCache` (the reference layout; int8/int4 writes quantize in a kernel)."""
        return TritonCache(spec, self.device, compute_dtype, params)

    # which paged attention runs the kernel rows: "decode" (backends/triton/attention.py: tensor-core dots, split-KV
    # combined in one Triton launch) or "old" (kernels.paged_attention, kept as the baseline of the static report and
    # of GPU comparisons); set on an instance to switch
    attention_kernel = "decode"

    def attention(self, q, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Decode and chunked-prefill rows (every row with ``batch_invariant``) through the paged attention kernel;
        whole-prompt prefill sequences through the torch reference's SDPA over gathered K/V."""
        plan = meta.scratch.get("triton_attn")
        if plan is None:
            plan = meta.scratch["triton_attn"] = self._plan(meta, q.device, cache.spec.num_kv_heads)
        rows, row_seq, row_ctx, tables, prefill, partition, max_ctx, split = plan
        qq = cache.attention_query(layer, q)
        out = self.kernels.empty_output(qq.shape, qq.dtype, qq.device)
        if rows is not None:
            kv_bits = cache.spec.bits if cache.spec.quantized else 16
            quant = (cache.k_scale[layer], cache.k_zero[layer], cache.v_scale[layer], cache.v_zero[layer]) \
                if cache.spec.quantized else (None,) * 4
            args = (qq, out, cache.k[layer], cache.v[layer], *quant, rows, row_seq, row_ctx, tables, meta.block_size,
                    scale, kv_bits, max_ctx, partition)
            if self.attention_kernel == "old":
                self.kernels.paged_attention(*args)
            else:
                from . import attention as attn

                attn.decode_attention(*args, split=split)
        for qs, qe, slots, causal in prefill:
            kb, vb = cache.gather(layer, slots)
            qb = qq[qs:qe].transpose(0, 1).unsqueeze(0)
            o = torch.nn.functional.scaled_dot_product_attention(qb, kb.unsqueeze(0), vb.unsqueeze(0),
                                                                 is_causal=causal, scale=scale, enable_gqa=True)
            out[qs:qe] = o.squeeze(0).transpose(0, 1)
        return cache.attention_output(layer, out)

    def _plan(self, meta: AttentionMetadata, device: torch.device, kv_heads: int):
        """Per step: kernel rows (query row, sequence, context length), padded block tables, and the prefill
        sequences left to SDPA (start, end, slots, causal). When every row goes to the kernel and the runner gave the
        device step plan (``meta.row_seq``, ``row_ctx``, ``block_table``), those are used as they are: no host →
        device copy, nothing read from the host lists but their lengths, so a decode step can be captured in a CUDA
        graph (``meta.max_context`` bounds the partitions)."""
        if meta.row_seq is not None and (meta.decode_only or self.batch_invariant):
            n = meta.row_seq.shape[0]
            rows = torch.arange(n, dtype=torch.int32, device=device)
            partition, split = self._partition(n * kv_heads, meta.max_context)
            return rows, meta.row_seq, meta.row_ctx, meta.block_table, [], partition, meta.max_context, split
        bs = meta.block_size
        rows, seqs, ctxs, prefill = [], [], [], []
        for b in range(meta.num_seqs):
            qs, qe = meta.query_start[b], meta.query_start[b + 1]
            t, ctx = qe - qs, meta.context_lens[b]
            if t == 1 or self.batch_invariant:
                rows += range(qs, qe)
                seqs += [b] * t
                ctxs += range(ctx - t + 1, ctx + 1)  # query j sees keys 0 .. ctx - t + j
                continue
            table = torch.tensor(meta.block_tables[b][:(ctx + bs - 1) // bs], dtype=torch.long)
            slots = (table.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)[:ctx]
            if t < ctx:  # a chunk after cached tokens: SDPA's is_causal aligns to the top-left, so use the kernel
                rows += range(qs, qe)
                seqs += [b] * t
                ctxs += range(ctx - t + 1, ctx + 1)
                continue
            prefill.append((qs, qe, slots.to(device), True))
        if not rows:
            return None, None, None, None, prefill, None, None, None
        width = max(1, max(len(bt) for bt in meta.block_tables))
        tables = torch.zeros(meta.num_seqs, width, dtype=torch.int32)
        for b, bt in enumerate(meta.block_tables):
            tables[b, :len(bt)] = torch.tensor(bt, dtype=torch.int32)

        def dev(v):
            return torch.tensor(v, dtype=torch.int32).to(device)

        max_ctx = max(ctxs)
        partition, split = self._partition(len(rows) * kv_heads, max_ctx)
        return dev(rows), dev(seqs), dev(ctxs), tables.to(device), prefill, partition, max_ctx, split

    def _partition(self, programs: int, max_ctx: int) -> tuple[int, bool | None]:
        """(tokens per context partition, split) for ``programs`` = rows x KV heads over contexts up to ``max_ctx``."""
        partition = self.attention_partition
        if self.batch_invariant:
            # a fixed partition and always the split path: a row's bits never depend on the other rows of the step
            partition = 512 if partition is None else partition
            return partition, (True if partition else None)
        if partition is None:  # split long contexts when rows x KV heads alone leave multiprocessors idle
            long = self.device.type == "cuda" and max_ctx > 1024 and programs < 2 * self._sms
            # at most 64 partitions per row: a graph captured for a long max_context keeps small partials
            partition = max(512, -(-max_ctx // (64 * 64)) * 64) if long else 0
        return partition, None
