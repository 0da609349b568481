"""Ascend NPU backend (``"ascend"``): the torch reference ops on the ``npu`` device of Huawei's ``torch_npu`` plug-in,
with the vendor's weight-quantized matmul for W4A16 (and the int8 lm_head) where ``torch_npu`` provides it.

``torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0)`` computes ``x @ ((weight + antiquant_offset)
* antiquant_scale) + bias`` (Ascend PyTorch API reference, "torch_npu.npu_weight_quant_batchmatmul",
https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000179.html; the formula is the one
of op-plugin's test ``test/test_custom_ops/test_npu_weight_quant_batchmatmul.py``, ``matmul(x, (weight + offset) *
scale)``). Facts this module relies on, from that page:

- ``x`` is 2-D ``(M, K)``, float16 or bfloat16 (Atlas A2/A3; the Atlas inference series takes float16 and int8
  weights only, per-channel only).
- ``weight`` is ``(K, N)``: int8, or int32 carrying int4 (eight signed 4-bit values in ``[-8, 7]`` per int32),
  made by ``torch_npu.npu_convert_weight_to_int4pack(weight_int32)`` from a contiguous int32 ``(K, N)`` tensor whose
  last dim is a multiple of 8 (output ``(K, N/8)`` int32).
- ``antiquant_scale`` and ``antiquant_offset`` have ``x``'s dtype, shape ``(1, N)`` or ``(N,)`` per channel and
  ``(ceil(K / antiquant_group_size), N)`` per group; ``antiquant_group_size`` is 0 (per channel) or a multiple of
  32 in ``[32, K - 1]`` (``torch_npu.contrib.module.LinearWeightQuant`` reference, 7.3.0).
- ``bias`` is float16, or float32 with bfloat16 ``x``.

liteturbo's canonical W4A16 (``W = (q - z) * s`` with unsigned codes ``q`` in ``[0, 16)``, see
:class:`~backends.types.QuantizedWeight`) maps onto it exactly: ``weight = q - 8`` (signed int4, transposed to
``(K, N)``), ``antiquant_offset = 8 - z`` (integers in ``[-7, 8]``, exact in 16-bit), ``antiquant_scale = s``
(already ``[groups, N]``). Layouts the kernel cannot take (bits != 4, a group size that is not 32k in ``[32, K)`` or
a whole row, ``N`` not a multiple of 8, an act-order ``g_idx`` whose groups are not ``group_size`` channels each,
float32 compute) fall back to dequantize + matmul on the NPU, with one warning per backend naming the op and why.

Everything else (linear, RMSNorm, SiLU-and-mul, rotary, paged attention, int8/int4 KV writes) is
:class:`~backends.torch_backend.TorchBackend`'s torch code running on the ``npu`` device. What cannot run here raises
``NotImplementedError`` naming the op and the fallback: ``batch_invariant=True`` (the torch backend's guarantee
rests on its CPU int4pack/int8pack kernels, which compute every row on its own; CANN's kernels pick tilings by row
count).

Not yet run on Ascend hardware: the tests use a stand-in ``torch_npu`` whose ops compute the documented formula on
the CPU, which checks the argument preparation (packing, offsets, scale layout, group size), not the vendor kernels.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .platform import torch_npu_module
from .torch_backend import TorchBackend, act_order_permutation
from .types import LinearSpec, QuantizedWeight

VENDOR_OP = "npu_weight_quant_batchmatmul"
PACK_OP = "npu_convert_weight_to_int4pack"
FALLBACK = "backend='torch' on device='cpu'"


@dataclass
class NpuW4A16Handle:
    """A W4A16 weight in ``npu_weight_quant_batchmatmul``'s layout.

    ``weight`` int32 ``(K, N/8)`` from ``npu_convert_weight_to_int4pack`` (signed codes ``q - 8``); ``scale`` and
    ``offset`` ``(groups, N)`` in ``dtype`` (``s`` rounded to ``dtype``, the kernel's rule, and ``8 - z``, exact); ``group_size`` the kernel's
    ``antiquant_group_size`` (0 = one group per output channel); ``bias`` ``(N,)`` float16, or float32 for bfloat16;
    ``in_perm`` int64 ``[K]`` for act-order weights (input channels sorted by group, applied to ``x`` per call).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int
    bias: torch.Tensor | None
    dtype: torch.dtype
    out_features: int
    in_perm: torch.Tensor | None = None


def vendor_w4a16_layout_problem(qw: QuantizedWeight, dtype: torch.dtype) -> str | None:
    """Why ``npu_weight_quant_batchmatmul`` cannot take ``qw`` at compute ``dtype`` (``None`` when it can)."""
    k, n, gs = qw.in_features, qw.out_features, qw.effective_group_size
    if qw.bits != 4:
        return f"bits={qw.bits} (the int4 path takes 4-bit codes)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"compute dtype {str(dtype).removeprefix('torch.')} (the kernel takes float16/bfloat16 activations)"
    if n % 8:
        return f"out_features={n} is not a multiple of 8 ({PACK_OP} packs 8 codes per int32 along N)"
    if gs != k and not (gs % 32 == 0 and 32 <= gs < k):
        return f"group size {gs} (the kernel takes a multiple of 32 in [32, {k - 1}] or one group per row)"
    if not qw.has_trivial_g_idx() and act_order_permutation(qw) is None:
        return "an act-order g_idx whose groups are not group_size channels each"
    return None


class AscendBackend(TorchBackend):
    """The torch reference ops on an Ascend NPU, with ``torch_npu``'s weight-quantized matmul for W4A16 and the
    int8 lm_head (see the module docstring for the layout and where it falls back).

    ``device``: ``"npu[:N]"`` in production (:func:`backends.get_backend` only builds it on an NPU platform); any
    torch device works for tests that install a stand-in ``torch_npu``. ``vendor_ops=False`` forces the
    dequantize + matmul path. Raises ``NotImplementedError`` for ``batch_invariant=True``, and ``RuntimeError`` when
    ``vendor_ops`` is on but ``torch_npu`` is not importable.
    """

    name = "ascend"

    def __init__(self, device: torch.device | str = "npu", batch_invariant: bool = False,
                 vendor_ops: bool = True) -> None:
        if batch_invariant:
            raise NotImplementedError(
                "the ascend backend cannot run batch_invariant=True: CANN's matmul kernels choose their tiling by "
                f"row count, so a token's numbers depend on the step; fallback: {FALLBACK}")
        # int4_kernel=False: the torch int4pack kernel is CPU-only; the fallback is dequantize + matmul
        super().__init__(device, int4_kernel=False, batch_invariant=False, cpu_kernels=False)
        self.npu = None
        if vendor_ops:
            try:
                self.npu = importlib.import_module("torch_npu")
            except ImportError as e:
                raise RuntimeError(f"the ascend backend needs torch_npu ({e}); install Ascend's torch_npu matching "
                                   f"torch {torch.__version__}, or use {FALLBACK}") from None
        self._warned: set[str] = set()

    @classmethod
    def unsupported_reason(cls, platform) -> str | None:
        """``None`` on an NPU platform (``torch_npu`` installed and seeing a device), else why not."""
        if platform.kind != "npu":
            return (f"needs an Ascend NPU (torch_npu); this device is {platform.kind} ({platform.name}); "
                    f"use backend='torch' or 'auto'")
        return None

    @classmethod
    def op_coverage(cls, platform=None) -> dict[str, str]:
        """See :meth:`Backend.op_coverage`: the vendor matmul where ``torch_npu`` has it, torch code on the NPU
        otherwise."""
        mod = _torch_npu_if_present()
        vendor = mod is not None and hasattr(mod, VENDOR_OP)
        ref = "torch reference on npu"
        missing = "torch_npu is not installed here" if mod is None else f"this torch_npu has no {VENDOR_OP}"
        w4 = (f"vendor torch_npu.{VENDOR_OP} (int4, group size 32k in [32, K) or per row); dequantize + matmul "
              "fallback for other layouts" if vendor and hasattr(mod, PACK_OP)
              else f"dequantize + matmul fallback ({missing})")
        w8 = (f"vendor torch_npu.{VENDOR_OP} (int8, per channel)" if vendor
              else f"dequantize + matmul fallback ({missing})")
        return {**super().op_coverage(None), "linear": "torch F.linear on npu", "w4a16_linear": w4,
                "w8a16_linear": w8, "rms_norm": ref, "add_rms_norm": ref + " (unfused add, then rms_norm)",
                "silu_and_mul": ref, "rotary": ref, "attention": ref + " (SDPA + batched matmul decode)",
                "kv_write_int8": ref, "kv_write_int4": ref,
                "experts": "grouped by expert, each selected expert's linears once over its rows (on npu)"}

    def _vendor_has(self, *ops: str) -> bool:
        return self.npu is not None and all(hasattr(self.npu, op) for op in ops)

    def _fallback_once(self, op: str, why: str) -> None:
        if op not in self._warned:
            self._warned.add(op)
            warnings.warn(f"ascend backend: {op} uses dequantize + matmul instead of torch_npu.{VENDOR_OP}: {why}",
                          RuntimeWarning, stacklevel=3)

    # --- W4A16 ---------------------------------------------------------------------------------
    @classmethod
    def linear_nbytes(cls, spec: LinearSpec, dtype: torch.dtype, device_type: str = "npu") -> int:
        """See :meth:`Backend.linear_nbytes`: on an NPU a 4-bit weight the vendor kernel takes is held as
        :class:`NpuW4A16Handle` (int32 ``(in, out/8)``, scale and offset ``(groups, out)`` in ``dtype``, bias in
        float32 for bfloat16 else float16, int64 input permutation for act-order); other weights as the torch
        reference holds them (assumes a torch_npu with the vendor ops)."""
        gs = spec.in_features if spec.group_size == -1 else spec.group_size
        k, n = spec.in_features, spec.out_features
        vendor = (device_type == "npu" and spec.quantized and spec.bits == 4 and dtype in (torch.float16, torch.bfloat16)
                  and n % 8 == 0 and (gs == k or (gs % 32 == 0 and 32 <= gs < k)))
        if not vendor:
            return super().linear_nbytes(spec, dtype, device_type)
        e = torch.empty((), dtype=dtype).element_size()
        return (k * n // 2 + 2 * spec.groups * n * e + (n * (4 if dtype == torch.bfloat16 else 2) if spec.bias else 0)
                + (8 * k if spec.act_order else 0))

    def prepare_w4a16(self, qw: QuantizedWeight, dtype: torch.dtype) -> Any:
        """:class:`NpuW4A16Handle` when the vendor kernel takes the layout (see
        :func:`vendor_w4a16_layout_problem`), else the torch backend's dequantize + matmul handle (warned once)."""
        why = (f"torch_npu has no {VENDOR_OP}/{PACK_OP}" if not self._vendor_has(VENDOR_OP, PACK_OP)
               else vendor_w4a16_layout_problem(qw, dtype))
        if why is not None:
            self._fallback_once("w4a16_linear", why)
            return super().prepare_w4a16(qw, dtype)
        perm = act_order_permutation(qw)
        codes = qw.qweight if perm is None else qw.qweight[:, perm]
        signed = (codes.to(torch.int32) - 8).t().contiguous().to(self.device)  # (K, N) in [-8, 7]
        packed = self.npu.npu_convert_weight_to_int4pack(signed)
        scale = qw.scales.to(self.device, dtype).contiguous()
        offset = (8.0 - qw.qzeros.float()).to(self.device, dtype).contiguous()
        n_groups = qw.scales.shape[0]
        bias = None
        if qw.bias is not None:
            bias = qw.bias.to(self.device, torch.float32 if dtype == torch.bfloat16 else torch.float16).contiguous()
        return NpuW4A16Handle(packed, scale, offset, 0 if n_groups == 1 else qw.effective_group_size, bias, dtype,
                              qw.out_features, None if perm is None else perm.to(self.device))

    def w4a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """See :meth:`Backend.w4a16_linear`; the vendor kernel computes in the handle's dtype."""
        if not isinstance(handle, NpuW4A16Handle):
            return super().w4a16_linear(x, handle)
        xin = x if x.dtype == handle.dtype else x.to(handle.dtype)
        if handle.in_perm is not None:
            xin = xin.index_select(-1, handle.in_perm)
        y = self.npu.npu_weight_quant_batchmatmul(xin, handle.weight, antiquant_scale=handle.scale,
                                                  antiquant_offset=handle.offset, bias=handle.bias,
                                                  antiquant_group_size=handle.group_size)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    # --- int8 weight-only (lm_head) ----------------------------------------------------------------
    def w8a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """The vendor kernel with the int8 weight per channel (``weight = q.T`` as a transposed view, as the
        reference recommends for per-channel) for 16-bit ``x``; dequantize + matmul otherwise."""
        q, scales = handle
        if self._vendor_has(VENDOR_OP) and x.dtype in (torch.float16, torch.bfloat16):
            return self.npu.npu_weight_quant_batchmatmul(x, q.t(), antiquant_scale=scales.to(x.dtype))
        if self.npu is not None:
            self._fallback_once("w8a16_linear", f"activations are {str(x.dtype).removeprefix('torch.')}"
                                if self._vendor_has(VENDOR_OP) else f"torch_npu has no {VENDOR_OP}")
        return F.linear(x, q.to(x.dtype)) * scales.to(x.dtype)


def _torch_npu_if_present():
    """The ``torch_npu`` module if importable (a stand-in in ``sys.modules`` counts), else None."""
    try:
        return torch_npu_module()
    except (ImportError, ValueError):  # ValueError: a sys.modules entry without __spec__
        return None


__all__ = ["AscendBackend", "NpuW4A16Handle", "vendor_w4a16_layout_problem"]
