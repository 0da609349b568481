"""Plain data exchanged between the quantization side (``lite``), the engine (``turbo``) and the kernels.

Only torch is imported here, so every layer of the toolkit can share these types.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class QuantizedWeight:
    """A group-wise quantized linear weight in liteturbo's canonical, *unpacked* layout.

    Dequantization (the definition every format and kernel is tested against)::

        W[o, i] = (qweight[o, i] - qzeros[g_idx[i], o]) * scales[g_idx[i], o]

    Fields
    ------
    bits: bits per weight code (2..8; the kernels target 4).
    group_size: input channels per group; ``-1`` means one group over all of ``in_features``.
    sym: symmetric quantization; then ``qzeros`` holds the constant ``2**(bits-1)``.
    qweight: uint8 ``[out_features, in_features]``, codes in ``[0, 2**bits)``.
    qzeros: uint8 ``[n_groups, out_features]``, zero points in ``[0, 2**bits)``.
    scales: float16/bfloat16/float32 ``[n_groups, out_features]``.
    g_idx: int32 ``[in_features]`` group of each input channel, or ``None`` for ``i // group_size``
        (GPTQ act-order checkpoints carry an explicit, permuted ``g_idx``).
    bias: optional ``[out_features]``.

    Raises ``ValueError`` from ``__post_init__`` when the shapes disagree.
    """

    bits: int
    group_size: int
    sym: bool
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = field(default=None)

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.qweight.dim() != 2:
            raise ValueError(f"qweight must be 2-D [out, in], got shape {tuple(self.qweight.shape)}")
        out_f, in_f = self.qweight.shape
        gs = in_f if self.group_size == -1 else self.group_size
        if gs <= 0:
            raise ValueError(f"group_size must be positive or -1, got {self.group_size}")
        if self.g_idx is None and in_f % gs:
            raise ValueError(f"in_features={in_f} is not divisible by group_size={gs}")
        n_groups = (in_f + gs - 1) // gs
        for name in ("qzeros", "scales"):
            t = getattr(self, name)
            if tuple(t.shape) != (n_groups, out_f):
                raise ValueError(f"{name} must have shape {(n_groups, out_f)}, got {tuple(t.shape)}")
        if self.g_idx is not None and tuple(self.g_idx.shape) != (in_f,):
            raise ValueError(f"g_idx must have shape ({in_f},), got {tuple(self.g_idx.shape)}")
        if self.bias is not None and tuple(self.bias.shape) != (out_f,):
            raise ValueError(f"bias must have shape ({out_f},), got {tuple(self.bias.shape)}")

    @property
    def out_features(self) -> int:
        """Output channels (rows of the weight)."""
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        """Input channels (columns of the weight)."""
        return self.qweight.shape[1]

    @property
    def effective_group_size(self) -> int:
        """Group size with ``-1`` resolved to ``in_features``."""
        return self.in_features if self.group_size == -1 else self.group_size

    def group_index(self) -> torch.Tensor:
        """int64 ``[in_features]``: the group of each input channel."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.effective_group_size

    def has_trivial_g_idx(self) -> bool:
        """True when input channel ``i`` belongs to group ``i // group_size`` (no act-order permutation)."""
        if self.g_idx is None:
            return True
        ref = torch.arange(self.in_features, device=self.g_idx.device) // self.effective_group_size
        return bool(torch.equal(self.g_idx.long(), ref))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[out_features, in_features]`` weight in ``dtype`` (computed in float32, or float64 if asked; without
        ``g_idx`` in one buffer of that size)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        if self.g_idx is None:  # contiguous groups: one [out, in] buffer, per-group zero points and scales broadcast
            out_f, in_f = self.qweight.shape
            gs = self.effective_group_size
            w = self.qweight.to(work, memory_format=torch.contiguous_format).view(out_f, in_f // gs, gs)
            w.sub_(self.qzeros.to(work).t().unsqueeze(-1)).mul_(self.scales.to(work).t().unsqueeze(-1))
            return w.view(out_f, in_f).to(dtype)
        g = self.group_index()
        z = self.qzeros.to(work)[g].t()  # [out, in]
        s = self.scales.to(work)[g].t()
        return ((self.qweight.to(work) - z) * s).to(dtype)

    @staticmethod
    def concat_out(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack several weights with the same input layout along ``out_features`` (fusing q/k/v, gate/up)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size, p.sym, p.in_features) != (first.bits, first.group_size, first.sym, first.in_features):
                raise ValueError("cannot fuse quantized weights with different bits/group_size/sym/in_features")
            if (p.g_idx is None) != (first.g_idx is None) or (
                p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)
            ):
                raise ValueError("cannot fuse quantized weights with different g_idx")
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [b if b is not None else torch.zeros(p.out_features, dtype=first.scales.dtype) for b, p in zip(biases, parts)]
            )
        return QuantizedWeight(
            bits=first.bits,
            group_size=first.group_size,
            sym=first.sym,
            qweight=torch.cat([p.qweight for p in parts], 0),
            qzeros=torch.cat([p.qzeros for p in parts], 1),
            scales=torch.cat([p.scales for p in parts], 1),
            g_idx=first.g_idx,
            bias=bias,
        )


@dataclass(frozen=True)
class LinearSpec:
    """One linear weight as the model loader will hand it to a backend, described without its values: what
    :meth:`backends.base.Backend.linear_nbytes` needs to count the bytes the backend will hold for it.

    bits: 16 = a dense weight (``prepare_linear``, stored in the compute dtype); 2..8 = a group-quantized weight
    (``prepare_w4a16``, any width); ``int8_per_channel``: the weight-only int8 output projection of
    ``prepare_w8a16`` (bits ignored). group_size: input channels per group, ``-1`` = one group per output
    channel. act_order: the checkpoint carries an act-order ``g_idx`` with regular groups (a permutation of the
    inputs is then kept). bias: the linear has a bias. scales_dtype: dtype of the checkpoint's scales (float16 in
    AWQ/GPTQ files); kept as is by layouts that do not convert them.
    """

    out_features: int
    in_features: int
    bits: int = 16
    group_size: int = -1
    act_order: bool = False
    bias: bool = False
    scales_dtype: torch.dtype = torch.float16
    int8_per_channel: bool = False

    @property
    def quantized(self) -> bool:
        """True for a group-quantized weight (``prepare_w4a16``)."""
        return self.bits < 16 and not self.int8_per_channel

    @property
    def groups(self) -> int:
        """Quantization groups along the input channels."""
        gs = self.in_features if self.group_size == -1 else self.group_size
        return -(-self.in_features // gs)


@dataclass
class AttentionMetadata:
    """How the flat token batch of one model step maps onto sequences and the paged KV cache.

    Tokens of all sequences are concatenated into one ``[T, ...]`` batch (prefill, chunked prefill and
    decode are all "tokens to compute"). For sequence ``b``:

    - its query tokens are rows ``query_start[b] : query_start[b+1]`` of the batch;
    - after this step it has ``context_lens[b]`` tokens in the cache (cached ones + this step's);
    - ``block_tables[b]`` lists its KV block ids in order.

    slot_mapping: int64 ``[T]``, cache slot ``block_id * block_size + offset`` of each token's K/V.

    The step plan on the device (optional; the model runner fills them from pinned host memory with one copy, so a
    backend needs no host → device copy of its own, and a CUDA graph replays them): ``row_seq`` int32 ``[T]``, the
    sequence of each query row; ``row_ctx`` int32 ``[T]``, the keys it sees (causal: a row at position ``p`` sees
    ``p + 1``); ``block_table`` int32 ``[num_seqs, W]``, the block tables zero-padded to ``W`` blocks;
    ``max_context``: a bound on ``row_ctx`` (host int; a captured decode graph sets the longest context it serves).
    ``decode_only``: every sequence computes one token.
    """

    slot_mapping: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    row_seq: torch.Tensor | None = None
    row_ctx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    max_context: int = 0
    # backend-private values derived once per step and reused by every layer (e.g. gather indices)
    scratch: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.query_start) != len(self.context_lens) + 1:
            raise ValueError("query_start must have one more entry than context_lens")
        if len(self.block_tables) != len(self.context_lens):
            raise ValueError("one block table per sequence is required")

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return len(self.context_lens)

    @property
    def decode_only(self) -> bool:
        """Whether every sequence of the step computes exactly one token (a decode step)."""
        return self.query_start[-1] == self.num_seqs


@dataclass
class ExpertsHandle:
    """The experts of one Mixture-of-Experts layer, each prepared by the backend as its linears are
    (:meth:`~backends.base.Backend.prepare_experts`): ``gate_up[e]`` the handle of expert ``e``'s fused gate and up
    projections (``[2I, hidden]``, gate rows first), ``down[e]`` of its down projection (``[hidden, I]``);
    ``quantized``: ``"w4a16"`` or ``None`` (dense). ``intermediate_size``: ``I``."""

    gate_up: list
    down: list
    quantized: str | None
    intermediate_size: int

    @property
    def num_experts(self) -> int:
        """Experts held."""
        return len(self.gate_up)
