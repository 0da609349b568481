"""Reference backend in plain torch; runs on any device.

On CPU the W4A16 linear uses torch's fused int4 kernel ``aten._weight_int4pack_mm_for_cpu`` (weights repacked
once by ``aten._convert_weight_to_int4pack_for_cpu``); elsewhere, or for layouts that kernel cannot take
(bits != 4, act-order ``g_idx``, odd group sizes), it dequantizes then multiplies. Attention reads the paged KV
cache object of :mod:`backends.kv_cache` (16-bit, int8 or int4, dequantized on gather).

On CPUs where liteturbo's C++ extension builds (:mod:`backends.cpu_ext`), RMSNorm, residual add + RMSNorm and
rotary and SiLU-and-mul run as one fused call each, and attention over a 16-bit cache (prefill, chunked prefill and decode rows of a
step together) runs in its paged-attention kernel, reading K/V in place through the block tables
(``cpu_kernels=False`` keeps the torch ops); 4-bit linears of many rows (prefill chunks, decode batches) in bf16 run
its W4A16 kernels (AVX-512 BF16; one packed copy of the codes: a few rows read them in place, many rows dequantize
each tile once per call); elsewhere torch's int4pack.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .base import Backend
from .kv_cache import PagedKVCache
from .torch_attention import attention_plan, paged_rows, rowwise_attention
from .types import AttentionMetadata, ExpertsHandle, LinearSpec, QuantizedWeight

_INT4PACK_GROUP_SIZES = (32, 64, 128, 256)
# the aten kernels through their torch._* bindings where present (about 1 us less per call than torch.ops.aten's
# Python-level dispatch, which a batch-1 decode step pays ~150 times)
_int4pack_mm = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or getattr(
    torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_int8pack_mm = getattr(torch, "_weight_int8pack_mm", None) or getattr(torch.ops.aten, "_weight_int8pack_mm", None)


# bump when a prepared layout below (W4TilesHandle, W8TilesHandle, Int4PackHandle) changes: saved serving layouts
# (turbo/core/serving_layout.py) of an older version are then ignored and the checkpoint is repacked
SERVING_LAYOUT_VERSION = 2  # 2: MoE layers (stacked experts, float32 routers)


@dataclass
class W4TilesHandle:
    """A bf16 4-bit weight held once, in the layout of liteturbo's C++ W4A16 kernels (AVX-512 BF16 CPUs,
    ``out`` a multiple of 32; ``backends/cpu_ext.py:pack_w4_tiles``): ``tiles`` = (packed codes uint8
    ``[out/32, in/4, 64]``, zero points int16 ``[out/32, in/g, 2, 16]``, scales bf16 ``[out/32, in/g, 2, 16]``), half
    a byte per weight plus 4 bytes per group and output channel. A few rows run ``w4a16_tiles_gemv`` (the codes read
    in place), from ``tiles_min_rows`` rows (and every row count in ``batch_invariant`` mode: each row's numbers are
    its own) ``w4a16_tiles_mm``."""

    tiles: tuple
    group_size: int
    out_features: int
    bias: torch.Tensor | None
    dtype: torch.dtype
    in_perm: torch.Tensor | None = None  # act-order: input channels sorted by group, applied to x per call


@dataclass
class W8TilesHandle:
    """An int8 weight (per output channel, symmetric) in the tiled layout of liteturbo's C++ int8 GEMV (AVX-512 VNNI
    CPUs, ``out`` a multiple of 4 and ``in`` of 32; ``backends/csrc/w8a16_gemv_cpu.cpp``): ``q`` int8
    ``[out/4, in/32, 4, 32]`` (for each 32 inputs, the codes of 4 channels are 128 contiguous bytes), ``scales``
    ``[out]`` in the compute dtype. One byte per weight, as the row-major layout; :meth:`rows` gives rows back."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)`` of the weight the codes hold."""
        return self.q.shape[0] * 4, self.q.shape[1] * 32

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Codes of output channels ``[start, stop)`` (multiples of 4) as row-major int8 ``[stop - start, in]``."""
        blk = self.q[start // 4:stop // 4]
        return blk.transpose(1, 2).reshape(stop - start, self.q.shape[1] * 32)


@dataclass
class Int4PackHandle:
    """torch CPU int4pack weight plus the same codes for many-row inputs (CPUs or dtypes the C++ W4A16 kernels do
    not take; see :class:`W4TilesHandle`).

    ``packed`` uint8 ``[out, in/2]`` and ``scale_zeros`` ``[in/g, out, 2]`` feed
    ``aten._weight_int4pack_mm_for_cpu`` (fast for a few rows: its cost grows linearly with the rows).
    For many rows ``nibbles`` uint8 ``[out, in/2]`` (byte ``j`` of a row: low nibble = code ``j``, high nibble = code
    ``j + in/2``), ``scales``/``scaled_zeros`` ``[out, in/g, 1]`` in ``dtype``, which rebuild the dense weight for
    inputs of ``dequant_min_rows`` rows or more, then one dense GEMM (see :func:`dequantize_nibbles`).

    The codes are thus held twice: 1 byte per weight in all (a 16-bit weight takes 2).
    """

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    group_size: int
    out_features: int
    bias: torch.Tensor | None
    dtype: torch.dtype
    in_perm: torch.Tensor | None = None  # act-order: input channels sorted by group, applied to x per call
    nibbles: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    scaled_zeros: torch.Tensor | None = None


@dataclass
class W4ExpertsHandle:
    """The 4-bit experts of one sparse layer stacked in the layout of liteturbo's C++ grouped W4A16 kernel
    (``backends/csrc/moe_cpu.cpp``, AVX-512 BF16): ``gate_up`` = (packed uint8 ``[E, 2I/32, H/4, 64]``, zero points
    int16 ``[E, 2I/32, H/g, 2, 16]``, scales bf16 ``[E, 2I/32, H/g, 2, 16]``), each expert's fused gate (first I rows)
    and up projections as :func:`backends.cpu_ext.pack_w4_tiles` lays out one weight; ``down`` the same for the
    down projections ``[E, H/32, I/4, 64]``. Half a byte per weight plus 4 bytes per group and output channel, as
    the experts' :class:`W4TilesHandle` would hold them one by one."""

    gate_up: tuple
    down: tuple
    group_size_gate_up: int
    group_size_down: int
    intermediate_size: int
    num_experts: int


@dataclass
class DequantHandle:
    """Fallback: keeps the canonical uint8 codes and dequantizes on every call (memory stays ~1 byte/weight)."""

    qw: QuantizedWeight
    dtype: torch.dtype
    bias: torch.Tensor | None


def act_order_permutation(qw: QuantizedWeight) -> torch.Tensor | None:
    """For an act-order ``g_idx`` whose groups all have ``group_size`` members: the input permutation that
    makes groups contiguous (``x[:, perm] @ W[:, perm].T == x @ W.T``); ``None`` for trivial or irregular g_idx."""
    if qw.has_trivial_g_idx():
        return None
    gs = qw.effective_group_size
    perm = torch.argsort(qw.g_idx.long(), stable=True)
    if not torch.equal(qw.g_idx.long()[perm], torch.arange(qw.in_features) // gs):
        return None
    return perm


def int4pack_supported(qw: QuantizedWeight, device: torch.device) -> bool:
    """Whether torch's CPU int4pack kernel can hold ``qw`` without changing its numbers (act-order g_idx
    is accepted when a permutation of the inputs makes its groups contiguous)."""
    return (_int4pack_shape_ok(qw.bits, qw.out_features, qw.in_features, qw.effective_group_size, device.type)
            and (qw.has_trivial_g_idx() or act_order_permutation(qw) is not None))


def _int4pack_shape_ok(bits: int, out_features: int, in_features: int, group_size: int, device_type: str) -> bool:
    return (
        device_type == "cpu"
        and bits == 4
        and out_features % 16 == 0  # the packer tiles N by 16
        and group_size in _INT4PACK_GROUP_SIZES
        and in_features % group_size == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


def _tiles_shape_ok(dtype: torch.dtype, out_features: int, in_features: int, group_size: int) -> bool:
    """Whether liteturbo's C++ W4A16 kernels take this weight (given the extension built with AVX-512 BF16)."""
    return dtype == torch.bfloat16 and out_features % 32 == 0 and in_features % 4 == 0 and group_size % 8 == 0


def pack_int4_for_cpu(qw: QuantizedWeight, dtype: torch.dtype,
                      tiles: bool = False) -> Int4PackHandle | W4TilesHandle:
    """``tiles=True``: the one copy of :class:`W4TilesHandle` (the C++ layout, which needs ``out_features % 32 ==
    0`` and ``in_features % 4 == 0``). Else canonical codes repacked for ``aten._weight_int4pack_mm_for_cpu`` plus
    the nibble copy for many rows (:class:`Int4PackHandle`).

    That kernel computes ``W = (q - 8) * scale + zero``; the canonical ``W = (q - z) * s`` maps onto it
    with ``zero = (8 - z) * s`` (exact up to the rounding of ``zero`` in ``dtype``).
    """
    perm = act_order_permutation(qw)
    codes = qw.qweight if perm is None else qw.qweight[:, perm]
    bias = None if qw.bias is None else qw.bias.to(dtype)
    if tiles:
        from .cpu_ext import pack_w4_tiles

        return W4TilesHandle(pack_w4_tiles(codes, qw.qzeros.T, qw.scales.T), qw.effective_group_size,
                             qw.out_features, bias, dtype, perm)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
    s = qw.scales.float()
    zero = (8.0 - qw.qzeros.float()) * s
    scale_zeros = torch.stack([s, zero], dim=-1).to(dtype).contiguous()
    half = qw.in_features // 2
    nibbles = (codes[:, :half] | (codes[:, half:] << 4)).contiguous()
    scales = s.T.unsqueeze(-1).to(dtype).contiguous()  # [out, groups, 1]
    scaled_zeros = (qw.qzeros.float() * s).T.unsqueeze(-1).to(dtype).contiguous()
    return Int4PackHandle(packed, scale_zeros, qw.effective_group_size, qw.out_features, bias, dtype, perm,
                          nibbles, scales, scaled_zeros)


def dequantize_tiles(h: W4TilesHandle, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[out, in]`` weight ``(q - z) * s`` in ``dtype`` from the C++ layout of ``h`` (in the handle's possibly
    act-order permuted input order): the inverse of :func:`backends.cpu_ext.pack_w4_tiles`, for checks and
    benchmarks."""
    packed, zeros, scales = h.tiles
    nb, quads, _ = packed.shape
    n, k = nb * 32, quads * 4
    c = packed.view(nb, quads, 2, 16, 2)  # [block, quad, sub-block, channel, pair]
    codes = torch.stack([c & 15, c >> 4], dim=-2)  # [block, quad, sub-block, channel, high, pair]
    codes = codes.permute(0, 2, 3, 1, 4, 5).reshape(n, k)

    def per_channel(t: torch.Tensor) -> torch.Tensor:
        """``[out/32, G, 2, 16]`` lanes -> float32 ``[out, in]`` (each group's value repeated over its inputs)."""
        return t.permute(0, 2, 3, 1).reshape(n, -1).float().repeat_interleave(h.group_size, dim=1)
    return ((codes.float() - per_channel(zeros)) * per_channel(scales)).to(dtype)


def dequantize_nibbles(h: Int4PackHandle) -> torch.Tensor:
    """Dense ``[out, in]`` weight in ``h.dtype`` from ``h.nibbles``: ``W = q * s - z * s`` per group
    (``z * s`` rounded once to ``dtype``); in the handle's (possibly act-order permuted) input order."""
    n, half = h.nibbles.shape
    codes = torch.empty(n, 2 * half, dtype=torch.uint8, device=h.nibbles.device)
    torch.bitwise_and(h.nibbles, 15, out=codes[:, :half])
    torch.bitwise_right_shift(h.nibbles, 4, out=codes[:, half:])
    groups = h.scales.shape[1]
    w = torch.empty(n, groups, 2 * half // groups, dtype=h.dtype, device=h.nibbles.device)
    torch.mul(codes.view(n, groups, -1), h.scales, out=w)
    return w.sub_(h.scaled_zeros).view(n, 2 * half)


class TorchBackend(Backend):
    """Plain-torch kernels. ``int4_kernel=False`` forces the dequantize-then-matmul fallback.

    ``dequant_min_rows``: inputs with at least this many rows (prefill chunks, big decode batches) dequantize
    the int4 weight to ``dtype`` and run one dense GEMM (float32 weights: at every row count, except in
    ``batch_invariant`` mode); fewer rows use the int4pack kernel, whose cost
    grows with every row (`python bench/kernel_choices.py`, 2 threads, 3072x576 weight: 1,024 rows take ~21.6 ms in
    int4pack vs ~9.8 ms as dequant + bf16 GEMM; over SmolLM2's shapes the two cross between 64 and 96 rows).
    ``int8_tile_min_rows``: the same switch for an int8 lm_head, which is dequantized tile by tile (SmolLM2's
    49152x576 head, 2 threads, `python bench/kernel_choices.py --suite choices`: int8pack 2.7 ms vs tiled 5.2 at 12 rows,
    7.3 vs 6.4 at 32).
    ``tiles_min_rows``: from this many rows a bf16 4-bit linear runs liteturbo's C++ tiled W4A16 GEMM (each weight
    tile dequantized once per call, AVX-512 BF16 dot products; `python bench/kernel_choices.py --suite choices`: 2.3x
    int4pack at 32 rows, 3.1x at 1,024, even between 4 and 8 rows), where the CPU and the shapes allow (see
    :class:`Int4PackHandle`).
    ``dense_lm_head_min_rows``: an int8 lm_head tied to the 16-bit embedding table multiplies by that table from
    this many rows (the same script's int8 lm_head rows: the dense bf16 column against int8pack).

    ``batch_invariant=True`` keeps every token's numbers independent of the step it runs in: int4pack and
    int8pack for any row count (both compute each row on its own), the batched decode attention even for
    a lone decode row, and the same matmul/softmax/matmul operations for prefill rows (so a token recomputed
    after a preemption gets the numbers it had when it was decoded). Prefill then costs ~2x more on CPU; greedy outputs in 16-bit no longer depend on
    batching, chunking or prefix-cache hits (float32 is close enough either way for the tests).
    """

    name = "torch"
    dequant_min_rows = 96

    def __init__(self, device: torch.device | str = "cpu", int4_kernel: bool = True,
                 dequant_min_rows: int = 96, int8_tile_min_rows: int = 32, batch_invariant: bool = False,
                 cpu_kernels: bool = True, dense_lm_head_min_rows: int = 16,
                 tiles_min_rows: int = 6) -> None:
        super().__init__(device, batch_invariant)
        self.int4_kernel = int4_kernel
        # liteturbo's C++ kernels (backends/cpu_ext.py) on CPUs: fused norms, SiLU-and-mul, rotary (+ KV write),
        # paged attention, the tiled W4A16 GEMM for many rows
        self.ext = None
        if cpu_kernels and self.device.type == "cpu":
            from . import cpu_ext

            self.ext = cpu_ext.load()
        # the C++ int8 GEMV for 1-4 bf16 rows (the int8 lm_head of decode steps); not in batch-invariant mode, where
        # every row count must take the same kernel (int8pack)
        self._w8_gemv = self.ext is not None and bool(self.ext.has_w8_gemv())
        # the tiled int8 layout and its VNNI GEMV for every bf16 row count; not in batch-invariant mode (int8pack there)
        self._w8_tiles = self.ext is not None and not batch_invariant and bool(self.ext.has_w8_tiles())
        never = 1 << 62
        self.dequant_min_rows = never if batch_invariant else dequant_min_rows
        self.int8_tile_min_rows = never if batch_invariant else int8_tile_min_rows
        self.dense_lm_head_min_rows = never if batch_invariant else dense_lm_head_min_rows
        self.tiles_min_rows = 1 if batch_invariant else tiles_min_rows  # w4a16_tiles_mm: each row on its own
        # MoE: the C++ router dot products up to this many rows (torch's float32 GEMM above), experts' runs of at most
        # this many rows on the codes-in-place arithmetic; batch-invariant mode: one arithmetic for every row count
        self.moe_route_gemv_rows = never if batch_invariant else 16
        self.moe_max_gemv_rows = 0 if batch_invariant else tiles_min_rows - 1

    def serving_layout_id(self, dtype: torch.dtype) -> str | None:
        """See :meth:`Backend.serving_layout_id`: on a CPU, the layout version, ``dtype``, and which of the C++
        layouts (W4A16 tiles, int8 tiles) and int4pack :meth:`prepare_w4a16` and :meth:`prepare_w8a16` choose here
        (they follow the CPU's features and ``batch_invariant``); ``None`` on other devices."""
        if self.device.type != "cpu":
            return None
        w4 = self.ext is not None and bool(self.ext.has_w4_tiles())
        return (f"torch-cpu-v{SERVING_LAYOUT_VERSION}:{str(dtype).removeprefix('torch.')}:w4tiles={int(w4)}:"
                f"w8tiles={int(self._w8_tiles)}:int4pack={int(self.int4_kernel)}:bi={int(self.batch_invariant)}")

    def serving_handle_types(self) -> tuple[type, ...]:
        """See :meth:`Backend.serving_handle_types`: every handle :meth:`prepare_w4a16` and :meth:`prepare_w8a16`
        return here (the dense ones are tuples of tensors)."""
        return (W4TilesHandle, W8TilesHandle, Int4PackHandle, DequantHandle, QuantizedWeight, W4ExpertsHandle,
                ExpertsHandle)

    @classmethod
    def op_coverage(cls, platform=None) -> dict[str, str]:
        """See :meth:`Backend.op_coverage`; the C++ CPU kernels are named where ``platform`` is a CPU (or ``None``)
        and the extension is neither turned off (LITETURBO_CPU_EXT=0) nor failed to build in this process
        (:func:`backends.cpu_ext.status`; nothing is built to answer)."""
        from . import cpu_ext

        cpu = platform is None or platform.kind == "cpu"
        ext = cpu and cpu_ext.status() not in ("off", "failed")
        ref = "torch reference"
        int4 = "torch int4pack kernel (aten._weight_int4pack_mm_for_cpu)"
        return {
            **super().op_coverage(platform),
            "linear": "torch F.linear",
            "w4a16_linear": (("bf16: liteturbo's C++ W4A16 kernels (AVX-512 BF16) over one packed copy (up to 5 rows "
                              "codes read in place, from 6 rows tiles dequantized once per call); float32 or layouts "
                              "they cannot take: " + int4 + ", dequantize + matmul for many rows")
                             if ext and cpu_ext.w4_tiles_expected() else
                             (int4 + " for up to 5 rows, dequantize + matmul for many rows or layouts int4pack cannot "
                              "take") if ext
                             else (int4 + "; dequantize + matmul for many rows or layouts it cannot take") if cpu
                             else "dequantize + matmul"),
            "w8a16_linear": (("liteturbo C++ int8 GEMV: tiled layout, every bf16 row count (AVX-512 VNNI), or row-major, "
                              "1-4 bf16 rows (AVX-512 F/BW); else " if cpu and ext else "")
                             + ("torch int8pack kernel (aten._weight_int8pack_mm, 16-bit activations); tiled "
                                "dequantize + matmul for many rows" if cpu else "dequantize + matmul")),
            "rms_norm": ("liteturbo C++ kernel (fused)" if ext else ref),
            "add_rms_norm": ("liteturbo C++ kernel (add fused with rms_norm)" if ext else
                             ref + " (unfused add, then rms_norm)"),
            "silu_and_mul": ("liteturbo C++ kernel (AVX-512 exp)" if ext else ref),
            "rotary": ("liteturbo C++ kernel (q and k read in place from the fused QKV; with a 16-bit cache fused with "
                       "the KV write)" if ext else ref),
            "attention": ("torch SDPA (prefill) + batched matmul decode over the gathered paged KV"
                          + ("; a 16-bit cache: liteturbo C++ paged attention over the block tables, all rows of a "
                             "step in one call" if ext else "")),
            "moe_route": ("bf16: liteturbo C++ routing (router dot products up to 16 rows, softmax, top-k in one call)"
                          if ext else ref),
            "experts": (("bf16 4-bit experts: liteturbo's C++ grouped W4A16 kernel (AVX-512 BF16), sorting, every "
                         "selected expert and the weighted sum in one call, gate+up+SiLU fused, work split by (expert, "
                         "channel block); else "
                         if ext and cpu_ext.w4_tiles_expected() else "") +
                        "grouped by expert, each selected expert's linears once over its rows"),
            "kv_write_int8": ref + " (quantize per token + index_copy)",
            "kv_write_int4": ref + " (quantize per token, pack nibbles + index_copy)",
        }

    # --- W4A16 ---------------------------------------------------------------------------------
    @classmethod
    def linear_nbytes(cls, spec: LinearSpec, dtype: torch.dtype, device_type: str = "cpu") -> int:
        """See :meth:`Backend.linear_nbytes`. On a CPU where liteturbo's C++ W4A16 kernels build with AVX-512 BF16
        (:func:`backends.cpu_ext.w4_tiles_expected`), a bf16 4-bit weight is held once (:class:`W4TilesHandle`: half a
        byte per weight, int16 zero point and bf16 scale per group and output); elsewhere a weight the int4pack kernel
        takes is held twice (:class:`Int4PackHandle`: int4pack codes ``[out, in/2]`` plus nibbles ``[out, in/2]``,
        i.e. 1 byte per weight; ``scale_zeros``, ``scales`` and ``scaled_zeros`` in ``dtype``, 4 values per group and
        output). Plus the bias in ``dtype`` and the int64 input permutation for act-order."""
        gs = spec.in_features if spec.group_size == -1 else spec.group_size
        e = torch.empty((), dtype=dtype).element_size()
        out = spec.out_features
        if not (spec.quantized and _int4pack_shape_ok(spec.bits, spec.out_features, spec.in_features, gs, device_type)):
            return super().linear_nbytes(spec, dtype, device_type)
        extra = (out * e if spec.bias else 0) + (8 * spec.in_features if spec.act_order else 0)
        from . import cpu_ext

        if _tiles_shape_ok(dtype, out, spec.in_features, gs) and cpu_ext.w4_tiles_expected():
            return out * spec.in_features // 2 + 4 * spec.groups * out + extra
        return out * spec.in_features + 4 * spec.groups * out * e + extra

    def prepare_w4a16(self, qw: QuantizedWeight, dtype: torch.dtype) -> Any:
        """int4pack on CPU when the layout allows (see :func:`int4pack_supported`), else a :class:`DequantHandle`
        (a trivial g_idx is dropped: it costs 4 bytes per input channel and says nothing)."""
        if self.int4_kernel and int4pack_supported(qw, self.device):
            tiles = (self.ext is not None and self.ext.has_w4_tiles()
                     and _tiles_shape_ok(dtype, qw.out_features, qw.in_features, qw.effective_group_size))
            return pack_int4_for_cpu(qw, dtype, tiles)
        g_idx = None if qw.has_trivial_g_idx() else qw.g_idx.to(self.device)
        moved = QuantizedWeight(
            bits=qw.bits, group_size=qw.group_size, sym=qw.sym,
            qweight=qw.qweight.to(self.device), qzeros=qw.qzeros.to(self.device),
            scales=qw.scales.to(self.device), g_idx=g_idx,
        )
        return DequantHandle(moved, dtype, None if qw.bias is None else qw.bias.to(self.device, dtype))

    def w4a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """See :meth:`Backend.w4a16_linear`; computes in the handle's dtype, returns ``x.dtype``."""
        if isinstance(handle, W4TilesHandle):
            xin = x if x.dtype == handle.dtype else x.to(handle.dtype)
            if handle.in_perm is not None:
                xin = xin.index_select(-1, handle.in_perm)
            kernel = self.ext.w4a16_tiles_mm if xin.shape[0] >= self.tiles_min_rows else self.ext.w4a16_tiles_gemv
            y = kernel(xin.contiguous(), *handle.tiles, handle.group_size)
            if handle.bias is not None:
                y = y + handle.bias
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if isinstance(handle, Int4PackHandle):
            xin = x if x.dtype == handle.dtype else x.to(handle.dtype)
            if handle.in_perm is not None:
                xin = xin.index_select(-1, handle.in_perm)
            if handle.nibbles is not None and (xin.shape[0] >= self.dequant_min_rows or (
                    handle.dtype == torch.float32 and not self.batch_invariant)):
                # float32: torch 2.13's int4pack kernel is ~35x slower than in bf16 (0.65 vs 0.019 ms for one row of
                # 1536x576), dequantize + sgemm is faster at every row count
                y = F.linear(xin, dequantize_nibbles(handle), handle.bias)
            else:
                y = _int4pack_mm(xin, handle.packed, handle.group_size, handle.scale_zeros)
                if handle.bias is not None:
                    y = y + handle.bias
            return y if y.dtype == x.dtype else y.to(x.dtype)
        w = handle.qw.dequantize(x.dtype)
        return F.linear(x, w, None if handle.bias is None else handle.bias.to(x.dtype))

    # --- Mixture-of-Experts ----------------------------------------------------------------------
    def _stack_experts_ok(self, gate_up: list, down: list, dtype: torch.dtype) -> bool:
        """Whether the C++ grouped kernel takes these experts: bf16, the extension with AVX-512 BF16, 4-bit weights
        without act-order, one group size per projection, widths the tiled layout and the fused SiLU take (``I`` and
        ``hidden`` multiples of 32); not in batch-invariant mode (the kernel picks its path by how many rows share an
        expert)."""
        if not (dtype == torch.bfloat16 and self.ext is not None and not self.batch_invariant and self.int4_kernel
                and getattr(self.ext, "has_w4_experts", lambda: False)()):
            return False
        for ws in (gate_up, down):
            if not all(isinstance(w, QuantizedWeight) and w.bits == 4 and w.has_trivial_g_idx() and w.bias is None
                       for w in ws):
                return False
            if len({(w.effective_group_size, w.out_features, w.in_features) for w in ws}) != 1:
                return False
            w = ws[0]
            if not (w.out_features % 32 == 0 and w.in_features % 4 == 0 and w.effective_group_size % 8 == 0
                    and w.in_features % w.effective_group_size == 0):
                return False
        return gate_up[0].out_features % 64 == 0  # I a multiple of 32: gate block c pairs with up block c + I/32

    def prepare_experts(self, gate_up: list, down: list, dtype: torch.dtype) -> Any:
        """See :meth:`Backend.prepare_experts`. On CPUs where the C++ grouped kernel runs (:meth:`_stack_experts_ok`):
        one :class:`W4ExpertsHandle`, each expert packed straight into the stacked tensors (no second copy of the
        layer); else the generic :class:`~backends.types.ExpertsHandle` of per-expert handles."""
        if not self._stack_experts_ok(gate_up, down, dtype):
            return super().prepare_experts(gate_up, down, dtype)
        from .cpu_ext import pack_w4_tiles

        def stack(ws: list) -> tuple:
            """The experts' tiled layouts stacked on a new leading dim, written expert by expert."""
            out = None
            for e, w in enumerate(ws):
                parts = pack_w4_tiles(w.qweight, w.qzeros.T, w.scales.T)
                if out is None:
                    out = tuple(torch.empty((len(ws), *t.shape), dtype=t.dtype) for t in parts)
                for dst, src in zip(out, parts):
                    dst[e].copy_(src)
            return out
        return W4ExpertsHandle(stack(gate_up), stack(down), gate_up[0].effective_group_size,
                               down[0].effective_group_size, gate_up[0].out_features // 2, len(gate_up))

    def moe_route(self, x: torch.Tensor, router: torch.Tensor, top_k: int,
                  norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`Backend.moe_route`. bf16 on CPUs with the extension: liteturbo's C++ routing
        (``csrc/moe_route_cpu.cpp``: softmax and top-k in one call, equal logits ordered by expert id, int32 ids), with
        the router's dot products in it up to ``moe_route_gemv_rows`` rows and torch's float32 GEMM above; so every
        row count of this backend breaks ties alike."""
        if self.ext is None or x.dtype != torch.bfloat16 or x.dim() != 2 or router.dtype != torch.float32:
            return super().moe_route(x, router, top_k, norm_topk_prob)
        logits = None if x.shape[0] <= self.moe_route_gemv_rows else torch.nn.functional.linear(x.float(), router)
        return self.ext.moe_route(x, router, top_k, norm_topk_prob, logits)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: Any) -> torch.Tensor:
        """See :meth:`Backend.experts`. A :class:`W4ExpertsHandle` with bf16 activations: one call of the C++
        ``w4a16_moe`` (``csrc/moe_cpu.cpp``): the ``T x k`` (token, expert) rows sorted by expert (a counting sort),
        gate and up with the SiLU product fused (``act``: ik_llama.cpp's fused MoE), then down, over every selected
        expert at once; its work units are (run of rows of one expert, block of 32 output channels) spread over the
        threads, so 8 small experts of a batch-1 decode keep every core busy, and an expert's rows share each decoded
        weight tile (prefill: each expert's W4A16 GEMM runs once over its tokens). The weighted products are summed
        per token in float32, rounded once. ``batch_invariant``: every run takes the many-row arithmetic, so a row's
        numbers do not depend on how many rows share its expert."""
        if not isinstance(handle, W4ExpertsHandle):
            return super().experts(x, topk_ids, topk_weights, handle)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        out = self.ext.w4a16_moe(xb, topk_ids, topk_weights.to(torch.bfloat16), *handle.gate_up,
                                 handle.group_size_gate_up, *handle.down, handle.group_size_down,
                                 self.moe_max_gemv_rows)
        return out.to(x.dtype)

    def prepare_w8a16(self, weight: torch.Tensor, dtype: torch.dtype) -> Any:
        """See :meth:`Backend.prepare_w8a16` (the same codes and scales). In bf16 on CPUs whose C++ extension has
        the VNNI int8 GEMV (not in ``batch_invariant`` mode), for ``out`` a multiple of 4 and ``in`` of 32: a
        :class:`W8TilesHandle`, written chunk by chunk (no second copy of the head at load); else ``(q, scales)``."""
        out, inp = weight.shape
        if not (self._w8_tiles and dtype == torch.bfloat16 and out % 4 == 0 and inp % 32 == 0):
            return super().prepare_w8a16(weight, dtype)
        from .base import int8_row_chunks

        q = torch.empty(out // 4, inp // 32, 4, 32, dtype=torch.int8)
        scales = torch.empty(out, dtype=torch.float32)
        for i, qc, sc in int8_row_chunks(weight):
            q[i // 4:(i + len(qc)) // 4] = qc.view(-1, 4, inp // 32, 32).transpose(1, 2)
            scales[i:i + len(sc)] = sc
        return W8TilesHandle(q, scales.to(dtype))

    def w8a16_linear(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """A :class:`W8TilesHandle`: bf16 rows on liteturbo's C++ VNNI GEMV (``w8a16_tiles_gemv``: every row count;
        against int8pack: ``python bench/lm_head.py --rows R``), other dtypes tiled dequantize + matmul. Row-major ``(q, scales)``: bf16,
        1-4 rows on the C++ float GEMV where compiled (AVX-512; ``csrc/w8a16_gemv_cpu.cpp``); else
        ``aten._weight_int8pack_mm`` for 16-bit CPU activations (tiled dequantize + matmul from
        ``int8_tile_min_rows``), else the generic path."""
        if isinstance(handle, W8TilesHandle):
            if x.dtype == torch.bfloat16 and x.dim() == 2:
                return self.ext.w8a16_tiles_gemv(x, handle.q, handle.scales)
            return _int8_tiled_mm(x, handle.rows, handle.scales.to(x.dtype), handle.shape)
        q, scales = handle
        if (self._w8_gemv and x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.shape[0] <= 4
                and not self.batch_invariant and q.shape[1] % 16 == 0 and q.is_contiguous()):
            return self.ext.w8a16_gemv(x, q, scales)
        if self.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and hasattr(
                torch.ops.aten, "_weight_int8pack_mm"):
            if x.shape[0] >= self.int8_tile_min_rows:
                return _int8_tiled_mm(x, lambda i, j: q[i:j], scales.to(x.dtype), q.shape)
            return _int8pack_mm(x, q, scales if scales.dtype == x.dtype else scales.to(x.dtype))
        return super().w8a16_linear(x, handle)

    # --- elementwise ----------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As transformers' LlamaRMSNorm: statistics in float32, scaled in ``x.dtype`` (one fused C++ call on CPUs
        with the extension, else torch ops)."""
        if self.ext is not None and weight.dtype == x.dtype:
            return self.ext.rms_norm(x, weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`Backend.add_rms_norm` (fused in C++ on CPUs with the extension)."""
        if self.ext is not None and weight.dtype == x.dtype == residual.dtype:
            return self.ext.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See :meth:`Backend.silu_and_mul` (one C++ call on CPUs with the extension: silu rounded to the dtype, then
        the product, within 2 ulps of the torch ops)."""
        if self.ext is not None and gate_up.dtype != torch.float64:
            return self.ext.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Rotate-half RoPE of q and k with precomputed cos/sin ``[T, 1, D]`` (one C++ call each on CPUs with the
        extension, reading q/k in place from the fused QKV output)."""
        if self.ext is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            return self.ext.rotary(q, cos, sin), self.ext.rotary(k, cos, sin)
        return _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)

    def rotary_write(self, q, k, v, cos, sin, cache: PagedKVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """See :meth:`Backend.rotary_write`: one C++ call for a 16/32-bit cache of q's dtype on CPUs with the
        extension (q/k/v read in place from the fused QKV output), else rotary then ``cache.write``."""
        if (self.ext is not None and not cache.spec.quantized and cache.k[layer].dtype == q.dtype == k.dtype == v.dtype
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
            return self.ext.rotary_kv_write(q, k, v, cos, sin, cache.k[layer], cache.v[layer], slots)
        return super().rotary_write(q, k, v, cos, sin, cache, layer, slots)

    # --- paged KV --------------------------------------------------------------------------------
    @classmethod
    def reads_kv_in_place(cls, kv_cache_dtype: str, dtype: torch.dtype, device_type: str,
                          batch_invariant: bool = False) -> bool:
        """The C++ ``paged_attention`` (:meth:`attention`) reads a 16-bit cache of the compute dtype in place on CPUs
        where the extension loads (not ``LITETURBO_CPU_EXT=0``, not a failed build) and not in batch-invariant mode;
        int8/int4 caches and the torch fallback gather."""
        if device_type != "cpu" or batch_invariant or kv_cache_dtype in ("int8", "int4"):
            return False
        if getattr(torch, kv_cache_dtype, None) != dtype:  # a 16-bit cache of another dtype: gathered and cast
            return False
        from . import cpu_ext

        return cpu_ext.status() not in ("off", "failed")

    def attention(self, q, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """With the C++ extension and a 16-bit cache (not ``batch_invariant``): every row of the step in one
        ``paged_attention`` call (``backends/csrc/attention_cpu.cpp``; `python bench/cpu_ops.py`). Otherwise: SDPA
        per multi-token (prefill) sequence and for a lone decode row; two or more one-token (decode)
        queries of the step together as two batched matmuls over their K/V, gathered and padded to the
        longest context (softmax in float32, padding masked): CPU SDPA takes ~10x longer for a batch of 32
        decode rows in bf16. K/V come from ``cache.gather`` (dequantized there for int8/int4 caches), in the
        space of ``cache.attention_query(q)``; ``cache.attention_output`` maps the result back. With
        ``batch_invariant``: every row alone over exactly its keys (:func:`backends.torch_attention.rowwise_attention`)."""
        # a 16-bit cache on a CPU with the C++ extension: every row (prefill, chunked prefill, decode) in one call
        # that reads K/V in place through the block tables (decided once per step; such a cache has no calibrated
        # transform, so attention_query/attention_output are the identity)
        paged = meta.scratch.get("cpu_paged_attn")
        if paged is None:
            fast = (self.ext is not None and not cache.spec.quantized and not self.batch_invariant
                    and cache.k[layer].dtype == q.dtype and meta.query_start[-1] == q.shape[0])
            paged = meta.scratch["cpu_paged_attn"] = paged_rows(meta) if fast else ()
        if paged:
            return self.ext.paged_attention(q, cache.k[layer], cache.v[layer], paged[0], meta.block_size, paged[1],
                                            paged[2], scale)
        kvh, d = cache.spec.num_kv_heads, cache.spec.head_dim
        q = cache.attention_query(layer, q)
        if self.batch_invariant:
            return cache.attention_output(layer, rowwise_attention(q, cache, layer, meta, scale))
        plan = meta.scratch.get("torch_attn")
        if plan is None:  # gather indices and masks are the same for every layer of the step
            plan = meta.scratch["torch_attn"] = attention_plan(meta, meta.block_size, q.device)
        singles, decode = plan
        out = q.new_empty(q.shape) if len(singles) > 1 or decode is not None else None
        for qs, qe, slots, mask, causal in singles:
            kb, vb = cache.gather(layer, slots)  # [KVH, ctx, D]
            if kb.dtype != q.dtype:
                kb, vb = kb.to(q.dtype), vb.to(q.dtype)
            qb = q[qs:qe].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
            o = F.scaled_dot_product_attention(qb, kb.unsqueeze(0), vb.unsqueeze(0), attn_mask=mask,
                                               is_causal=causal, scale=scale, enable_gqa=True)
            o = o.squeeze(0).transpose(0, 1)
            if out is None:
                return cache.attention_output(layer, o)
            out[qs:qe] = o
        if decode is not None:
            rows, idx, pad = decode  # idx [B, L] slots (padded with a row's own last slot), pad [1, B, 1, L]
            b, length = idx.shape
            kb, vb = cache.gather(layer, idx.view(-1))
            kb, vb = kb.view(kvh, b, length, d), vb.view(kvh, b, length, d)  # [KVH, B, L, D]
            if kb.dtype != q.dtype:
                kb, vb = kb.to(q.dtype), vb.to(q.dtype)
            h = q.shape[1]
            qb = q.index_select(0, rows).view(b, kvh, h // kvh, d).transpose(0, 1)  # [KVH, B, G, D]
            scores = torch.matmul(qb, kb.transpose(-1, -2)).float().mul_(scale)  # [KVH, B, G, L]
            scores.masked_fill_(pad, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            o = torch.matmul(probs, vb).transpose(0, 1).reshape(b, h, d)
            out.index_copy_(0, rows, o)
        return cache.attention_output(layer, out)


def _int8_tiled_mm(x: torch.Tensor, rows, scales: torch.Tensor, shape: tuple[int, int],
                   tile: int = 4096) -> torch.Tensor:
    """``x [M, in] @ (q * scales[:, None]).T`` for int8 codes of ``shape`` ``[out, in]`` given by ``rows(i, j)``
    (output channels ``[i, j)`` as row-major int8), dequantizing ``tile`` output rows at a time into a buffer that
    stays in cache, so a many-row input costs about one dense GEMM (``_weight_int8pack_mm`` grows per row)."""
    n, k = shape
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    buf = torch.empty(min(tile, n), k, dtype=x.dtype, device=x.device)
    s = scales.unsqueeze(1)
    for i in range(0, n, tile):
        j = min(i + tile, n)
        w = buf[: j - i]
        torch.mul(rows(i, j), s[i:j], out=w)
        torch.mm(x, w.t(), out=y[:, i:j])
    return y


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
