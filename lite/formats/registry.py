"""The registry of on-disk W4A16 weight formats: one small object per format (pack, unpack, config, defaults).

Both directions go through it: ``lite`` packs and writes ``quantization_config`` with :func:`weight_format`
(``--format``), and the loader (:mod:`lite.formats.quantized`) unpacks with :func:`format_for_spec`. The byte
layouts themselves live in :mod:`.awq`, :mod:`.gptq` and :mod:`.compressed_tensors`.

Default symmetry per format is what the common readers load (checked by ``bench/compat.py``):

| ``--format`` | default | readers |
| --- | --- | --- |
| ``awq`` (AWQ GEMM) | zero point (asymmetric) | AutoAWQ, vLLM ``awq``, transformers (autoawq) |
| ``gptq`` (GPTQ v1) | symmetric | AutoGPTQ/GPTQModel, vLLM (refuses ``sym=False`` v1), transformers (optimum) |
| ``compressed-tensors`` (pack-quantized) | zero point (asymmetric) | llm-compressor, vLLM |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.types import QuantizedWeight

from .awq import awq_quantization_config, pack_awq, unpack_awq
from .compressed_tensors import compressed_quantization_config, pack_compressed, unpack_compressed
from .errors import LiteturboError
from .gptq import gptq_quantization_config, pack_gptq, unpack_gptq


@dataclass(frozen=True)
class FormatOptions:
    """What a format's ``quantization_config`` records about a run: bits, group size (-1 = per channel),
    symmetry, act-order (``g_idx``), static groups, GPTQ dampening and true-sequential order, and ``unquantized``:
    the full module paths of the decoder linears kept 16-bit (a MoE's routers and shared-expert gates,
    :func:`lite.formats.arch.unquantized_modules`), which the formats that list exclusions name."""

    bits: int
    group_size: int
    sym: bool
    act_order: bool = False
    static_groups: bool = False
    damp_percent: float = 0.01
    true_sequential: bool = True
    unquantized: tuple[str, ...] = ()


class WeightFormat:
    """One on-disk format. ``name``: the ``--format`` value; ``tensors``: the per-linear tensor suffixes, the
    packed codes first (the loader finds quantized linears by it); ``default_sym``: what its readers expect."""

    name: str = ""
    quant_method: str = ""
    tensors: tuple[str, ...] = ()
    default_sym: bool = False
    stores_g_idx: bool = True
    readers: str = ""

    def pack(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """Canonical weight → this format's tensors (suffix → tensor)."""
        raise NotImplementedError

    def unpack(self, parts: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool,
               bias: torch.Tensor | None = None) -> QuantizedWeight:
        """This format's tensors of one linear (suffix → tensor) → canonical weight. Raises ``KeyError`` naming
        a missing tensor, ``LiteturboError`` for inconsistent shapes."""
        raise NotImplementedError

    def config(self, opts: FormatOptions) -> dict:
        """The ``quantization_config`` block of ``config.json``."""
        raise NotImplementedError

    def extra_files(self, qc: dict) -> dict[str, dict]:
        """Other JSON files its readers expect beside ``config.json`` (name → content)."""
        return {}

    def min_zero(self, sym: bool) -> int:
        """Smallest storable asymmetric zero point (GPTQ v1 stores ``zero - 1``)."""
        return 0

    def check(self, opts: FormatOptions) -> None:
        """Raise ``LiteturboError`` when ``opts`` cannot be stored in this format."""


class AwqGemmFormat(WeightFormat):
    """AWQ GEMM (:mod:`.awq`): no ``g_idx``, so act-order only with static groups."""

    name, quant_method = "awq", "awq"
    tensors = ("qweight", "qzeros", "scales")
    stores_g_idx = False
    readers = "AutoAWQ, vLLM (awq), transformers (autoawq)"

    def pack(self, qw):
        """The checkpoint tensors of one linear (see :meth:`WeightFormat.pack`)."""
        return pack_awq(qw)

    def unpack(self, parts, bits, group_size, sym, bias=None):
        """One linear's :class:`QuantizedWeight` from its tensors (see :meth:`WeightFormat.unpack`)."""
        if not sym and "qzeros" not in parts:
            raise KeyError("qzeros")
        return unpack_awq(parts["qweight"], parts.get("qzeros"), parts["scales"], bits, group_size, not sym, bias)

    def config(self, opts):
        """``config.json``'s ``quantization_config`` (see :meth:`WeightFormat.config`)."""
        return awq_quantization_config(opts.bits, opts.group_size, not opts.sym, opts.unquantized)

    def check(self, opts):
        """Refuse options this format cannot store (see :meth:`WeightFormat.check`)."""
        if opts.act_order and not opts.static_groups:
            raise LiteturboError("act-order (on by default) with --no-static-groups needs a g_idx, which the AWQ "
                                 "format cannot store; drop --no-static-groups (groups fixed before reordering) or "
                                 "use --format gptq or compressed-tensors")


class GptqFormat(WeightFormat):
    """GPTQ v1 or v2 (:mod:`.gptq`, ``checkpoint_format``); writes ``quantize_config.json`` too; v1 asymmetric zero
    points must be >= 1."""

    quant_method = "gptq"
    tensors = ("qweight", "qzeros", "scales", "g_idx")
    default_sym = True
    readers = "AutoGPTQ, GPTQModel, vLLM (gptq; v1 symmetric only), transformers (optimum)"

    def __init__(self, checkpoint_format: str = "gptq") -> None:
        self.checkpoint_format = checkpoint_format
        self.name = "gptq" if checkpoint_format == "gptq" else checkpoint_format

    def pack(self, qw):
        """The checkpoint tensors of one linear (see :meth:`WeightFormat.pack`)."""
        return pack_gptq(qw, self.checkpoint_format)

    def unpack(self, parts, bits, group_size, sym, bias=None):
        """One linear's :class:`QuantizedWeight` from its tensors (see :meth:`WeightFormat.unpack`)."""
        return unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), bits, group_size,
                           sym, self.checkpoint_format, bias)

    def config(self, opts):
        """``config.json``'s ``quantization_config`` (see :meth:`WeightFormat.config`)."""
        # desc_act says the stored g_idx is not the contiguous one; with static groups it is (the act-order only
        # changed the rounding order), and vLLM 0.32 refuses desc_act=True
        desc_act = opts.act_order and not opts.static_groups
        # routers stay 16-bit tensors with no exclusion field, as GPTQModel writes MoE checkpoints (vLLM builds the
        # MoE routers unquantized whatever the GPTQ config; Qwen/Qwen3-30B-A3B-GPTQ-Int4 has none either)
        return gptq_quantization_config(opts.bits, opts.group_size, opts.sym, desc_act, opts.static_groups,
                                        opts.damp_percent, opts.true_sequential, self.checkpoint_format)

    def extra_files(self, qc):
        """``quantize_config.json`` for AutoGPTQ / GPTQModel readers: the config without ``quant_method``."""
        return {"quantize_config.json": {k: v for k, v in qc.items() if k != "quant_method"}}

    def min_zero(self, sym):
        """Smallest storable zero point: 1 for asymmetric GPTQ v1 (it stores ``zero - 1``), else 0."""
        return 1 if (self.checkpoint_format == "gptq" and not sym) else 0


class CompressedTensorsFormat(WeightFormat):
    """compressed-tensors ``pack-quantized`` (:mod:`.compressed_tensors`), act-order as ``actorder``."""

    name, quant_method = "compressed-tensors", "compressed-tensors"
    tensors = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
    readers = "llm-compressor, vLLM (compressed-tensors), transformers (compressed-tensors)"

    def pack(self, qw):
        """The checkpoint tensors of one linear (see :meth:`WeightFormat.pack`)."""
        return pack_compressed(qw)

    def unpack(self, parts, bits, group_size, sym, bias=None):
        """One linear's :class:`QuantizedWeight` from its tensors (see :meth:`WeightFormat.unpack`)."""
        return unpack_compressed(parts, bits, group_size, sym, bias)

    def config(self, opts):
        """``config.json``'s ``quantization_config`` (see :meth:`WeightFormat.config`)."""
        actorder = ("static" if opts.static_groups else "group") if opts.act_order else None
        return compressed_quantization_config(opts.bits, opts.group_size, opts.sym, actorder, opts.unquantized)


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (AwqGemmFormat(), GptqFormat("gptq"),
                                                                CompressedTensorsFormat())}
_LOAD_ONLY = {"gptq_v2": GptqFormat("gptq_v2")}


def weight_format(name: str) -> WeightFormat:
    """The writable format called ``name`` (``--format``). Raises ``LiteturboError`` listing the known ones."""
    if name not in WEIGHT_FORMATS:
        raise LiteturboError(f"--format must be one of {', '.join(WEIGHT_FORMATS)}, got {name!r}")
    return WEIGHT_FORMATS[name]


def format_for_spec(method: str, checkpoint_format: str = "") -> WeightFormat:
    """The format object that reads a checkpoint's ``quant_method`` (and GPTQ ``checkpoint_format``)."""
    if method == "gptq":
        fmt = checkpoint_format or "gptq"
        return WEIGHT_FORMATS["gptq"] if fmt == "gptq" else _LOAD_ONLY[fmt]
    return WEIGHT_FORMATS[method]
