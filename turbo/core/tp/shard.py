"""Tensor parallelism's arithmetic: which part of every weight a rank holds, which splits are refused, and the two
collective steps of the forward that are not a plain all-reduce (the vocabulary-parallel embedding and logits).

The split is Megatron-LM's (Shoeybi et al. 2019). Column-parallel (output rows split): q, k, v, gate and up, each
projection split on its own before the loader fuses q/k/v and gate/up; row-parallel (input columns split): o_proj
and down_proj, whose partial outputs the forward sums with one all-reduce each (their bias is kept by rank 0 only).
Attention heads are split evenly; KV heads too when there are at least as many as ranks, else each KV head is
replicated on the ``tp / kv_heads`` ranks whose query heads read it. The vocabulary (embedding rows, lm_head rows)
is split in balanced ranges; the embedding sums the ranks' lookups (one rank holds each token, the others add
zeros: exact), the logits are gathered in rank order.

Quantized weights (:class:`~backends.types.QuantizedWeight`) are split along their groups: a row-parallel split must
cut the input features at group boundaries (checked from config.json before loading: :func:`split_problems`), and an
act-order ``g_idx`` must keep every group on one rank (checked per layer as it is read, the only time the g_idx is
known); the groups a rank keeps are renumbered in order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from backends import KVQuantParams, QuantizedWeight
from lite.formats import LiteturboError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW = ("o_proj", "down_proj", "w2")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's expert projections


def partition(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``n`` items are split into ``parts`` balanced ranges (the first
    ``n % parts`` ranges hold one more)."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def split_problems(cfg, tp: int, bits: int = 16, group_size: int = -1) -> list[str]:
    """Why ``tp`` ranks cannot split a model of ``cfg`` (a :class:`turbo.core.model.ModelConfig`) whose decoder
    linears have ``bits`` (< 16: quantized in groups of ``group_size`` input features, -1: one group per row);
    empty when they can."""
    if tp == 1:
        return []
    nh, nkv, hd, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    out = []
    if nh % tp:
        out.append(f"tp {tp} splits the {nh} attention heads into {nh / tp:g} per rank, not a whole number")
    elif nkv % tp and tp % nkv:
        out.append(f"tp {tp} neither splits the {nkv} KV heads evenly nor replicates them evenly (tp must divide "
                   f"{nkv} or be a multiple of it)")
    widths = [("intermediate_size", inter, "down_proj")]
    if getattr(cfg, "moe", None) is not None:
        widths = ([("intermediate_size", inter, "down_proj")] if not all(cfg.moe.sparse) else []) + [
            ("the experts' intermediate_size", cfg.moe.intermediate_size, "an expert's down_proj")]
        if cfg.moe.shared_intermediate_size:
            widths.append(("shared_expert_intermediate_size", cfg.moe.shared_intermediate_size,
                           "the shared expert's down_proj"))
        if not cfg.qk_norm_per_head and cfg.qk_norm:
            out.append(f"tp {tp} would split {cfg.model_type}'s q/k norm, taken over all heads together")
    for field, width, _ in widths:
        if width % tp:
            out.append(f"tp {tp} splits the {width} MLP features ({field}) into {width / tp:g} per rank, "
                       f"not a whole number")
    if cfg.vocab_size < tp:
        out.append(f"tp {tp} is more ranks than the {cfg.vocab_size} tokens of the vocabulary")
    if bits < 16 and group_size > 0:
        for name, width in (("o_proj", nh * hd), *((n, w) for _, w, n in widths)):
            if width % tp == 0 and (width // tp) % group_size:
                out.append(f"tp {tp} splits {name}'s {width} input features into {width // tp}, not a multiple of "
                           f"group size {group_size}")
    return out


def working_sizes(cfg, bits: int = 16, group_size: int = -1) -> list[int]:
    """Every tensor-parallel size that splits the model (up to its number of attention heads)."""
    return [n for n in range(1, cfg.num_heads + 1) if not split_problems(cfg, n, bits, group_size)]


def check_split(cfg, tp: int, bits: int = 16, group_size: int = -1) -> None:
    """Refuse (before loading) a split that breaks a head or a quantization group. Raises ``LiteturboError``
    naming the first problem and the sizes that work."""
    problems = split_problems(cfg, tp, bits, group_size)
    if problems:
        ok = ", ".join(str(n) for n in working_sizes(cfg, bits, group_size))
        raise LiteturboError(f"{problems[0]}; tensor_parallel_size in {{{ok}}} works")


def rank_config(cfg, tp: int):
    """The :class:`~turbo.core.model.ModelConfig` one rank computes (of rank 0, the largest): its attention and KV
    heads, MLP features and vocabulary rows. ``cfg`` itself at ``tp == 1``."""
    if tp == 1:
        return cfg
    moe = cfg.moe and dataclasses.replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // tp,
                                          shared_intermediate_size=cfg.moe.shared_intermediate_size // tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(cfg.num_kv_heads // tp, 1),
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=-(-cfg.vocab_size // tp),
                               moe=moe)


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: the rows and columns of each weight it holds, for a model of ``cfg`` (the whole
    model's :class:`~turbo.core.model.ModelConfig`). Build with :meth:`of`, which checks the split."""

    rank: int
    size: int
    cfg: object

    @classmethod
    def of(cls, cfg, rank: int, size: int) -> "Shard":
        """The shard of ``rank``; raises ``LiteturboError`` when heads or MLP features do not split."""
        check_split(cfg, size)
        return cls(rank, size, cfg)

    @property
    def num_heads(self) -> int:
        """Attention (query) heads of this rank."""
        return self.cfg.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this rank (1, replicated, when the model has fewer KV heads than ranks)."""
        return max(self.cfg.num_kv_heads // self.size, 1)

    def kv_head_range(self) -> tuple[int, int]:
        """``[lo, hi)`` of the model's KV heads this rank holds (those its query heads read)."""
        nkv = self.cfg.num_kv_heads
        lo = self.rank * self.num_kv_heads if nkv >= self.size else self.rank * nkv // self.size
        return lo, lo + self.num_kv_heads

    def vocab_range(self) -> tuple[int, int]:
        """``[lo, hi)`` of the token ids whose embedding and lm_head rows this rank holds."""
        return partition(self.cfg.vocab_size, self.size, self.rank)

    def features(self, short: str, name: str = "") -> tuple[int, int]:
        """``[lo, hi)`` of the output rows (column-parallel ``short``) or input columns (row-parallel) kept; ``name``
        (the module path) tells an expert's or the shared expert's projections (split on their own intermediate
        width) from the dense MLP's."""
        hd, inter = self.cfg.head_dim, self.cfg.intermediate_size
        moe = self.cfg.moe
        if moe is not None and ".experts." in name:
            inter = moe.intermediate_size
        elif moe is not None and ".shared_expert." in name:
            inter = moe.shared_intermediate_size
        short = _MIXTRAL.get(short, short)
        if short in ("q_proj", "o_proj"):
            return self.rank * self.num_heads * hd, (self.rank + 1) * self.num_heads * hd
        if short in ("k_proj", "v_proj"):
            lo, hi = self.kv_head_range()
            return lo * hd, hi * hd
        if short in ("gate_proj", "up_proj", "down_proj"):
            return self.rank * inter // self.size, (self.rank + 1) * inter // self.size
        raise ValueError(f"no tensor-parallel split for {short!r}")

    # --- weights --------------------------------------------------------------------------------------------
    def dense(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None):
        """This rank's part of the dense linear ``name`` (``...q_proj``): ``(weight [out', in'], bias or None)``,
        compact copies (the whole tensors can be freed)."""
        short = name.rsplit(".", 1)[-1]
        lo, hi = self.features(short, name)
        if short in COLUMN:
            return _copy(weight[lo:hi]), None if bias is None else _copy(bias[lo:hi])
        return _copy(weight[:, lo:hi]), bias if self.rank == 0 else None

    def quantized(self, name: str, qw: QuantizedWeight) -> QuantizedWeight:
        """This rank's part of the quantized linear ``name``. Raises ``LiteturboError`` when a row-parallel
        split would cut a group (an act-order ``g_idx`` whose groups straddle two ranks)."""
        short = name.rsplit(".", 1)[-1]
        lo, hi = self.features(short, name)
        if short in COLUMN:
            return QuantizedWeight(qw.bits, qw.group_size, qw.sym, _copy(qw.qweight[lo:hi]),
                                   _copy(qw.qzeros[:, lo:hi]), _copy(qw.scales[:, lo:hi]), qw.g_idx,
                                   None if qw.bias is None else _copy(qw.bias[lo:hi]))
        bias = qw.bias if self.rank == 0 else None
        if qw.group_size == -1:  # one group per row: every slice keeps it whole
            return QuantizedWeight(qw.bits, -1, qw.sym, _copy(qw.qweight[:, lo:hi]), qw.qzeros, qw.scales, None,
                                   bias)
        groups = qw.group_index()
        mine = groups[lo:hi]
        used = torch.unique(mine)  # sorted
        counts = torch.bincount(groups, minlength=qw.scales.shape[0])
        local = torch.bincount(mine, minlength=qw.scales.shape[0])
        if not torch.equal(local[used], counts[used]) or used.numel() * qw.group_size != hi - lo:
            raise LiteturboError(
                f"tp {self.size} splits {name}'s {qw.in_features} input features into {hi - lo} per rank, but its "
                f"act-order groups (g_idx) straddle the ranks; run this checkpoint with tensor_parallel_size=1, or "
                f"quantize it without act-order (desc_act=False)")
        renumber = torch.full((qw.scales.shape[0],), -1, dtype=torch.long)
        renumber[used] = torch.arange(used.numel())
        g_idx = None if qw.g_idx is None else renumber[mine].to(torch.int32)
        return QuantizedWeight(qw.bits, qw.group_size, qw.sym, _copy(qw.qweight[:, lo:hi]), _copy(qw.qzeros[used]),
                               _copy(qw.scales[used]), g_idx, bias)

    def rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of an embedding or lm_head table ``[vocab, hidden]``."""
        lo, hi = self.vocab_range()
        return _copy(table[lo:hi])

    def kv_params(self, params: KVQuantParams | None) -> KVQuantParams | None:
        """The KV cache transform (calibrated or rotated) of this rank's KV heads."""
        if params is None:
            return None
        lo, hi = self.kv_head_range()
        return KVQuantParams(params.k_shift[:, lo:hi], params.k_scale[:, lo:hi], params.k_rotate, params.v_rotate,
                             mode=params.mode)

    # --- the forward's vocabulary steps --------------------------------------------------------------------
    def embed(self, table: torch.Tensor, ids: torch.Tensor, backend) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of token ``ids [T]`` from this rank's rows ``table``: each rank looks up
        the ids it holds, zeros elsewhere, and the ranks' lookups are summed (``backend.all_reduce``)."""
        lo, hi = self.vocab_range()
        local = ids - lo
        outside = (local < 0) | (local >= hi - lo)
        h = table[local.clamp(0, hi - lo - 1)].masked_fill_(outside.unsqueeze(-1), 0)
        return backend.all_reduce(h)

    def gather_logits(self, logits: torch.Tensor, backend) -> torch.Tensor:
        """The whole vocabulary's logits ``[rows, vocab]`` from this rank's ``[rows, hi - lo]``: every rank's part
        (padded to the widest) gathered with ``backend.all_gather`` and laid side by side in rank order."""
        width = partition(self.cfg.vocab_size, self.size, 0)[1]  # rank 0's range is the widest
        mine = logits.shape[1]
        if mine < width:
            logits = torch.nn.functional.pad(logits, (0, width - mine))
        parts = backend.all_gather(logits)  # [size, rows, width]
        widths = [hi - lo for lo, hi in (partition(self.cfg.vocab_size, self.size, r) for r in range(self.size))]
        return torch.cat([parts[r, :, :w] for r, w in enumerate(widths)], dim=1)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A compact copy of a slice (not a view that would keep the whole tensor alive)."""
    return t.clone(memory_format=torch.contiguous_format)
