"""Weight-quantization methods, one small class each (RTN, AWQ, GPTQ), driven layer by layer by :mod:`lite.pipeline`.

A method gets one decoder layer (float32 weights on the run's device) and the layer's calibration inputs
(:class:`LayerBatch`), and returns ``{linear name: QuantizedWeight}``; it may also change the float layer in ways
that leave its output unchanged (AWQ folds its scales into the previous norm or linear). The algorithms are the
tensor functions of :mod:`lite.rtn`, :mod:`lite.awq` and :mod:`lite.gptq`. Which linears a layer has, which share
inputs, the AWQ scaling groups and the GPTQ order are read per layer from :mod:`lite.formats.arch`
(:func:`~lite.formats.arch.layer_linears`, ...): a Mixture-of-Experts layer lists every expert's linears, whose
hooks see only the tokens the model's router sent them (:class:`lite.moe.SparseMoeBlock`), and experts with too few
such tokens take the expert rule of :mod:`lite.moe` (round to nearest, counted in the notes).

Statistics are streamed: one forward pass over the calibration samples feeds, per linear input, the running
mean |x| (AWQ), the Hessian ``2/n XᵀX`` (GPTQ) and the first ``loss_tokens`` tokens (AWQ's loss and clipping
search), so memory does not grow with the calibration set beyond the layer's inputs and outputs. Forwards run in
the compute dtype (:func:`compute_dtype`: bfloat16 where the CPU or GPU multiplies it natively, 5x float32's
speed on this project's AVX512-BF16 CPU), the solvers in float32.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Collection
from dataclasses import dataclass

import torch

from backends.types import QuantizedWeight

from .formats.arch import (input_heads, layer_linears, layer_no_clip, layer_scaling_groups, layer_sequential,
                           moe_config)

# GPTQ: the Hessians collected in one forward stay under this many bytes (a sparse layer's experts' Hessians are
# gathered in consecutive chunks of experts, one forward each; a dense layer's set always fits one chunk: an 8B's
# MLP down projection, 14336² float32, is 0.77 GiB). Qwen3-30B-A3B's 128 experts (2.3 GiB of Hessians) take 3
# forwards, each a few percent of the layer's GPTQ time.
HESSIAN_BYTES = 1 << 30


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """``--compute-dtype`` → torch dtype of the calibration forwards. ``auto``: the platform's default compute dtype
    (:meth:`backends.platform.Platform.default_dtype`: bfloat16 where native, float32 on other CPUs)."""
    if name in ("float32", "bfloat16", "float16"):
        return getattr(torch, name)
    from backends.platform import current_platform

    return current_platform(device).default_dtype()


class StopForward(Exception):
    """Raised by a hook to end a forward pass early."""


@dataclass
class LayerBatch:
    """The calibration inputs of one decoder layer.

    inputs: hidden states ``[1, L, H]`` per sample (stored in ``dtype``); kwargs: the layer's keyword arguments
    per sample (rotary embeddings, mask); dtype: the compute dtype of forwards (autocast when not float32);
    targets: the float model's outputs of this layer for the leading samples (the float trajectory: float layers
    all the way from the embeddings), what block-wise tuning fits (required when tuning).
    """

    inputs: list[torch.Tensor]
    kwargs: list[dict]
    dtype: torch.dtype = torch.float32
    targets: list[torch.Tensor] | None = None

    def autocast(self, cache: bool = True):
        """Context in which forwards run in the compute dtype (``cache=False``: no cached cast of each weight kept
        until the context exits; the same numbers, for a forward that reads each weight once)."""
        if self.dtype == torch.float32 or not self.inputs:
            return contextlib.nullcontext()
        return torch.autocast(self.inputs[0].device.type, dtype=self.dtype, cache_enabled=cache)

    @staticmethod
    def caches_casts(layer: torch.nn.Module) -> bool:
        """Whether forwards over every sample keep autocast's cast of each weight: yes for a dense layer (cast once,
        read by every sample); no for a layer with a sparse MLP block, whose experts' 16-bit copies would add half
        the float32 layer (1.2 GB at Qwen3-30B-A3B shapes) for a cast per sample that costs little beside it."""
        from .moe import SparseMoeBlock

        return not any(isinstance(m, SparseMoeBlock) for m in layer.modules())

    def run(self, layer: torch.nn.Module) -> list[torch.Tensor]:
        """The layer's outputs for every sample (stored in the compute dtype): the next layer's inputs."""
        outs = []
        with torch.no_grad(), self.autocast(self.caches_casts(layer)):
            for h, kw in zip(self.inputs, self.kwargs):
                o = layer(h, **kw)
                outs.append((o[0] if isinstance(o, tuple) else o).to(self.dtype))
        return outs

    def loss_samples(self, loss_tokens: int) -> int:
        """How many leading samples hold ``loss_tokens`` tokens (at least one)."""
        n, tok = 0, 0
        while n < len(self.inputs) and (tok < loss_tokens or n == 0):
            tok += self.inputs[n].shape[1]
            n += 1
        return n


class InputStats:
    """Streaming statistics of one linear's inputs ``x [tokens, in]``: ``abs_sum`` (float32 ``[in]``), ``rows``,
    the Hessian ``H = 2/n Σ xxᵀ`` (float32 ``[in, in]``, when asked) and kept rows for the loss (``kept``, compute
    dtype, one entry per call): those of the first ``keep`` samples, or with ``keep_rows`` every call's rows until
    that many are kept (an expert: its routed rows, from whichever samples routed them). Non-finite rows are
    skipped (warned once)."""

    def __init__(self, in_features: int, device, hessian: bool, keep: int, dtype: torch.dtype,
                 keep_rows: int | None = None) -> None:
        self.abs_sum = torch.zeros(in_features, device=device)
        self.rows = 0
        self.H = torch.zeros(in_features, in_features, device=device) if hessian else None
        self.keep, self.kept, self.dtype, self.skipped = keep, [], dtype, 0
        self.keep_rows, self.kept_rows = keep_rows, 0

    def add(self, x: torch.Tensor, sample: int | None = None) -> None:
        """Add rows ``x [..., in]`` (any float dtype) of calibration sample ``sample`` (``None``: counted by calls)."""
        x = x.detach().reshape(-1, x.shape[-1])
        ok = torch.isfinite(x).all(-1)
        if not bool(ok.all()):
            self.skipped += int((~ok).sum())
            x = x[ok]
        if self.keep_rows is not None:
            keep = self.kept_rows < self.keep_rows
        else:
            keep = (len(self.kept) if sample is None else sample) < self.keep
        if keep:
            self.kept.append(x.to(self.dtype))
            self.kept_rows += x.shape[0]
        if x.shape[0] == 0:
            return
        self.abs_sum += x.float().abs().sum(0)
        m = x.shape[0]
        if self.H is not None:
            # one sample's xᵀx in the compute dtype (bfloat16 GEMMs accumulate in float32), summed in float32
            xc = x.to(self.dtype)
            self.H.mul_(self.rows / (self.rows + m)).add_((xc.t() @ xc).float(), alpha=2.0 / (self.rows + m))
        self.rows += m

    @property
    def mean_abs(self) -> torch.Tensor:
        """Mean |x| per input channel, float32 ``[in]``."""
        return self.abs_sum / max(self.rows, 1)


def collect_stats(layer: torch.nn.Module, batch: LayerBatch, heads: list[str], hessian: bool | Collection[str],
                  keep: int, stop_after: str | None = None,
                  keep_rows: dict[str, int] | None = None) -> dict[str, InputStats]:
    """One forward of ``layer`` over every sample with hooks on the ``heads`` modules' inputs (linears, or a sparse
    block: anything with ``in_features``); stops each sample after ``stop_after`` (its input captured) when given.
    ``hessian``: for every head, or only for the heads named. Loss rows kept: the first ``keep`` samples', or for a
    head in ``keep_rows`` that many rows (:class:`InputStats`). A head never called (an expert no token was routed
    to) has ``rows == 0``."""
    stats, handles = {}, []
    dev = batch.inputs[0].device
    sample = [0]
    for n in heads:
        mod = layer.get_submodule(n)
        wants_h = hessian if isinstance(hessian, bool) else n in hessian
        stats[n] = InputStats(mod.in_features, dev, wants_h, keep, batch.dtype, (keep_rows or {}).get(n))

        def hook(_m, args, n=n):
            """Add the module's input rows to its statistics; stop the sample after ``stop_after``."""
            stats[n].add(args[0], sample[0])
            if n == stop_after:
                raise StopForward
        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad(), batch.autocast(batch.caches_casts(layer)):
            for j, (h, kw) in enumerate(zip(batch.inputs, batch.kwargs)):
                sample[0] = j
                try:
                    layer(h, **kw)
                except StopForward:
                    pass
    finally:
        for hd in handles:
            hd.remove()
    skipped = sum(s.skipped for s in stats.values())
    if skipped:
        warnings.warn(f"skipped {skipped} calibration rows with NaN/inf activations")
    return stats


# ----------------------------------------------------------------------------------------------------
class QuantMethod:
    """A quantization method the pipeline drives. ``cfg``: the run's :class:`lite.pipeline.PipelineConfig`;
    ``model_type``: the model's config.json dict (or, for a dense family, just its ``model_type``): the per-layer
    tables of :mod:`lite.formats.arch` (linears, input heads, AWQ groups, GPTQ order) are read for
    ``layer_index``, which the pipeline sets before each layer; ``min_zero``: smallest storable zero point of the
    output format. ``notes`` collects events worth recording in the provenance file (raised dampening, limited
    scales, experts that took the expert rule of :mod:`lite.moe`), each a dict with ``layer``, ``linear`` and what
    happened."""

    name = ""
    calibrated = True

    def __init__(self, cfg, model_type: str | dict, min_zero: int = 0) -> None:
        self.arch = dict(model_type) if isinstance(model_type, dict) else {"model_type": model_type}
        self.cfg, self.model_type, self.min_zero = cfg, self.arch["model_type"], min_zero
        self.moe = moe_config(self.arch)
        self.notes: list[dict] = []
        self.layer_index = 0
        self.calibrated = type(self).calibrated or cfg.tune_steps > 0 or cfg.e2e_steps > 0
        self.tune_seconds = 0.0  # wall time spent in block-wise tuning (the provenance file reports it)

    def run(self, layer: torch.nn.Module, batch: LayerBatch) -> dict[str, QuantizedWeight]:
        """:meth:`quantize_layer`, then (``tune_steps > 0``) the block-wise tuning of :mod:`lite.tune` against
        ``batch.targets`` (the float model's outputs of this layer for the leading calibration samples). Raises
        ``ValueError`` when tuning without targets."""
        cfg = self.cfg
        if cfg.tune_steps <= 0:
            return self.quantize_layer(layer, batch)
        from .tune import tune_layer

        targets = batch.targets
        if targets is None:
            raise ValueError("block-wise tuning needs batch.targets: the float model's outputs of this layer "
                             "(lite.pipeline sets them from the float trajectory)")
        n = len(targets)
        head = LayerBatch(batch.inputs[:n], batch.kwargs[:n], batch.dtype)
        qws = self.quantize_layer(layer, batch)
        t0 = time.perf_counter()
        qws, before, after = tune_layer(layer, qws, head.inputs, head.kwargs, targets, cfg.tune_steps,
                                        dtype=batch.dtype)
        self.tune_losses = (before, after)
        self.tune_seconds += time.perf_counter() - t0
        return qws

    def quantize_layer(self, layer: torch.nn.Module, batch: LayerBatch) -> dict[str, QuantizedWeight]:
        """Quantize the decoder linears of ``layer``; returns ``{name: QuantizedWeight}``."""
        raise NotImplementedError

    # --- the current layer's tables (lite.formats.arch) ---------------------------------------------------------
    def linears(self) -> tuple[str, ...]:
        """The quantized linears of the current layer (module paths inside it)."""
        return layer_linears(self.arch, self.layer_index)

    def head_of(self) -> dict[str, str]:
        """Linear → the linear whose input statistics it shares, in the current layer (missing: itself)."""
        return input_heads(self.arch, self.layer_index)

    def experts(self) -> dict[str, int]:
        """Each routed expert's linears in the current layer → the expert's index (empty in a dense layer; the shared
        expert sees every token and is not among them)."""
        moe = self.moe
        if moe is None or not moe.sparse[self.layer_index]:
            return {}
        return {n: e for e in range(moe.num_experts) for n in moe.expert(e)}

    def expert_threshold(self, batch: LayerBatch) -> int:
        """Fewest routed calibration tokens an expert of the current layer needs
        (:func:`lite.moe.expert_token_threshold` of the tokens entering it); below it the expert takes the expert rule
        (:mod:`lite.moe`)."""
        from .moe import expert_token_threshold

        return expert_token_threshold(sum(x.shape[1] for x in batch.inputs), self.moe)

    def expert_rows(self, stats: dict[str, "InputStats"], rows: dict[int, int]) -> None:
        """Add to ``rows`` (expert → routed calibration tokens) the experts whose gate projection's inputs are in
        ``stats`` (the rows its hook saw)."""
        for e in range(self.moe.num_experts):
            gate = self.moe.expert(e)[0]
            if gate in stats and e not in rows:
                rows[e] = stats[gate].rows

    def note_expert_rule(self, rows: dict[int, int], threshold: int) -> None:
        """Note, once per sparse layer, the experts with fewer than ``threshold`` routed tokens (``rows``) when any
        (the pipeline counts them for the provenance file and its summary)."""
        few = sorted(e for e, r in rows.items() if r < threshold)
        if few:
            none = [e for e in few if rows[e] == 0]
            self.note(self.moe.spec.block, f"{len(few)} of {self.moe.num_experts} experts had fewer than {threshold} "
                                           f"routed calibration tokens ({len(none)} had none): rounded to nearest on "
                                           f"their own weights", experts_rtn_fallback=few, experts_without_tokens=none,
                      routed_tokens={str(e): rows[e] for e in few}, threshold=threshold)

    def note(self, linear: str, message: str, **fields) -> None:
        """Record an event for the log (a warning) and the provenance file."""
        warnings.warn(f"layer {self.layer_index} {linear}: {message}")
        self.notes.append({"layer": self.layer_index, "linear": linear, "event": message, **fields})

    def _gptq(self, name: str, w: torch.Tensor, H: torch.Tensor, consume_h: bool = False) -> QuantizedWeight:
        """GPTQ of one linear (``consume_h``: ``H`` is not used again and may be overwritten), its events noted."""
        from .gptq import gptq_quantize

        cfg, info = self.cfg, {}
        qw = gptq_quantize(w, H, cfg.w_bits, cfg.w_group_size, cfg.w_sym, cfg.act_order, cfg.static_groups,
                           cfg.block_size, cfg.damp_percent, min_zero=self.min_zero, mse=cfg.mse_scales, info=info,
                           consume_h=consume_h)
        if "damp_percent" in info:
            self.note(name, f"GPTQ dampening raised from {cfg.damp_percent} to {info['damp_percent']:.3g} of the "
                            f"mean Hessian diagonal (Cholesky failed: often too few calibration tokens for this "
                            f"layer; more --calib-samples usually avoid it)", damp_percent=info["damp_percent"])
        if info.get("fallback"):
            self.note(name, f"GPTQ fell back to round-to-nearest ({info['fallback']})")
        return qw


class RTN(QuantMethod):
    """Round to nearest per group (:mod:`lite.rtn`); no calibration."""

    name, calibrated = "rtn", False

    def quantize_layer(self, layer, batch):
        """See :meth:`QuantMethod.quantize_layer`."""
        from .rtn import quantize_rtn

        cfg = self.cfg
        return {n: quantize_rtn(layer.get_submodule(n).weight.data, cfg.w_bits, cfg.w_group_size, cfg.w_sym,
                                min_zero=self.min_zero, mse=cfg.mse_scales) for n in self.linears()}


class GPTQ(QuantMethod):
    """GPTQ (:mod:`lite.gptq`), true-sequential inside a layer: each set of linears
    (:func:`lite.formats.arch.layer_sequential`) gets Hessians from inputs that went through the already
    quantized sets. In a sparse layer each expert's Hessian comes from its routed tokens; an expert with too few
    takes the expert rule (:mod:`lite.moe`: round to nearest)."""

    name = "gptq"

    def quantize_layer(self, layer, batch):
        """See :meth:`QuantMethod.quantize_layer`."""
        from .rtn import quantize_rtn

        cfg = self.cfg
        heads_of, experts = self.head_of(), self.experts()

        def head(n: str) -> str:
            return heads_of.get(n, n)
        order = layer_sequential(self.arch, self.layer_index)
        seq = cfg.true_sequential
        groups = order if seq else (tuple(n for g in order for n in g),)
        threshold = self.expert_threshold(batch) if experts else 0
        rows: dict[int, int] = {}  # expert -> its routed calibration tokens, from its gate's statistics
        result = {}
        for group in groups:
            heads = list(dict.fromkeys(head(n) for n in group))
            for chunk in (_hessian_chunks(layer, heads) if seq else [heads]):
                stats = collect_stats(layer, batch, chunk, hessian=True, keep=0, stop_after=chunk[-1] if seq else None)
                if experts:
                    self.expert_rows(stats, rows)
                members = [n for n in group if head(n) in stats]
                last = {head(n): n for n in members}  # the linear after which a head's Hessian is not needed
                for n in members:
                    lin = layer.get_submodule(n)
                    st = stats[head(n)]
                    if n in experts and rows[experts[n]] < threshold:  # the expert rule (every gate precedes its down)
                        qw = quantize_rtn(lin.weight.data, cfg.w_bits, cfg.w_group_size, cfg.w_sym,
                                          min_zero=self.min_zero, mse=cfg.mse_scales)
                    else:
                        qw = self._gptq(n, lin.weight.data, st.H, consume_h=last[head(n)] == n)
                    if last[head(n)] == n:
                        st.H = None
                    # only forwards read it now, and under autocast they cast it to the compute dtype: store it there
                    lin.weight.data = qw.dequantize(torch.float32).to(lin.weight.device, batch.dtype)
                    result[n] = qw
                del stats
        if experts:
            self.note_expert_rule(rows, threshold)
        return result


def _hessian_chunks(layer: torch.nn.Module, heads: list[str]) -> list[list[str]]:
    """``heads`` in consecutive chunks whose float32 Hessians ``[in, in]`` take at most :data:`HESSIAN_BYTES`
    together (at least one head each): a dense layer's set is one chunk; a sparse layer's experts may need several
    forwards. Each chunk's statistics do not depend on the others' quantization (an expert's inputs come from the
    router and its own linears), so the result is the same as in one chunk."""
    chunks, size = [], HESSIAN_BYTES + 1
    for h in heads:
        b = 4 * layer.get_submodule(h).in_features ** 2
        if size + b > HESSIAN_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(h)
        size += b
    return chunks


class AWQ(QuantMethod):
    """AWQ (:mod:`lite.awq`): per scaling group (:func:`lite.formats.arch.layer_scaling_groups`) the scale search on
    the first ``loss_tokens`` calibration tokens, the scales folded into the previous op (limited so the folded
    weight stays finite in the checkpoint's dtype), then the clipping search and the rounding: ``rtn`` (the
    paper) or ``gptq`` (GPTQ's error compensation on the scaled inputs' Hessian, with ``act_order`` if asked).

    In a sparse layer the post-attention norm's group spans every expert's gate/up (and the shared expert's),
    scored on the whole sparse block over its input's loss tokens; the router and the shared-expert gate are
    scaled with it (never quantized); each expert's up→down group, clipping and rounding use its own routed
    tokens. Experts with too few take the expert rule (:mod:`lite.moe`): no up→down scaling, no clipping, RTN.

    ``fold_dtypes``: the checkpoint dtype of each previous op's weight, by module name in the layer.
    """

    name = "awq"

    def __init__(self, cfg, model_type: str | dict, min_zero: int = 0) -> None:
        super().__init__(cfg, model_type, min_zero)
        self.fold_dtypes: dict[str, torch.dtype] = {}

    def quantize_layer(self, layer, batch):
        """See :meth:`QuantMethod.quantize_layer`."""
        from .awq import activation_scale_limit, search_scales, weight_scale

        cfg = self.cfg
        heads_of, experts = self.head_of(), self.experts()

        def head(n: str) -> str:
            return heads_of.get(n, n)
        linears = self.linears()
        groups = layer_scaling_groups(self.arch, self.layer_index)
        heads = list(dict.fromkeys(head(n) for n in linears))
        blocks = [g.inp for g in groups if g.inp and g.inp not in heads]  # a sparse block's input (search only)
        n_loss = batch.loss_samples(cfg.loss_tokens)
        keep_rows = None
        if experts:  # each expert keeps its share of the loss tokens, from whichever samples routed them to it
            share = math.ceil(sum(x.shape[1] for x in batch.inputs[:n_loss]) * self.moe.top_k / self.moe.num_experts)
            keep_rows = {head(n): share for n in experts}
        stats = collect_stats(layer, batch, heads + blocks, hessian=heads if cfg.awq_rounding == "gptq" else False,
                              keep=n_loss, keep_rows=keep_rows)
        few: set[int] = set()
        if experts:
            rows: dict[int, int] = {}
            self.expert_rows(stats, rows)
            threshold = self.expert_threshold(batch)
            few = {e for e, r in rows.items() if r < threshold}
            self.note_expert_rule(rows, threshold)
        # every head's inputs are divided by the scales of its group once they are folded
        head_scale = {h: torch.ones(layer.get_submodule(h).in_features, device=batch.inputs[0].device) for h in heads}
        attn_kw = [{k: kw[k] for k in ("position_embeddings", "attention_mask") if k in kw}
                   for kw in batch.kwargs[:n_loss]]
        for g in groups:
            prev = layer.get_submodule(g.prev)
            lins = [layer.get_submodule(n) for n in g.linears]
            if g.needs_same_width and prev.weight.shape[0] != lins[0].weight.shape[1]:
                continue
            if experts.get(g.linears[0]) in few:  # an expert's up -> down under the expert rule: not scaled
                continue
            st = stats[g.inp or head(g.linears[0])]
            # the search assigns candidate weights as new tensors: these stay the originals, uncopied
            originals = [m.weight.data for m in lins]
            forward, reference = self._loss_forward(layer, g, lins, originals, st.kept, attn_kw, batch)
            scales, _alpha, _loss = search_scales(originals, st.mean_abs, weight_scale(originals, cfg.w_group_size),
                                                  forward, reference, cfg.w_bits, cfg.w_group_size, cfg.w_sym,
                                                  cfg.n_grid, cfg.duo_scaling)
            del forward, reference
            scales = scales.to(prev.weight.device)
            dtype = self.fold_dtypes.get(g.prev, torch.float32)
            limited = activation_scale_limit(prev.weight.data, scales, dtype)
            if limited is not None:
                self.note(g.prev, f"AWQ scales limited on {int((limited != scales).sum())} channels so that "
                                  f"{g.prev}.weight / s stays finite in {str(dtype).replace('torch.', '')}")
                scales = limited
            for m, w in zip(lins, originals):  # in place: the originals are no longer read
                m.weight.data = w.mul_(scales)
            for n in g.passengers:  # unquantized readers of prev (router, shared-expert gate): the same s
                lin = layer.get_submodule(n)
                lin.weight.data = lin.weight.data * scales
            # fold 1/s into the previous op: a norm's weight or a linear's output rows (and bias)
            prev.weight.data = prev.weight.data / scales.view(-1, *([1] * (prev.weight.dim() - 1)))
            if getattr(prev, "bias", None) is not None:
                prev.bias.data = prev.bias.data / scales
            for h in dict.fromkeys(head(n) for n in g.linears):
                head_scale[h] = scales
            del originals
        return self._round(layer, stats, head_scale, linears, head, {n for n, e in experts.items() if e in few})

    def _loss_forward(self, layer, g, lins, originals, kept, attn_kw, batch):
        """``(forward(ws) -> output, reference output)`` of the module a group's candidate scales are scored on,
        over the kept loss tokens."""
        inspect = layer.get_submodule(g.inspect)
        if g.inspect in g.linears:
            loss_in = torch.cat(kept, 0)

            def forward(ws):
                """The inspected module's output with the group's linears set to the candidate weights ``ws``."""
                with torch.no_grad(), batch.autocast():
                    return torch.nn.functional.linear(loss_in, ws[0])
            return forward, forward(originals)
        is_attn = g.inspect.endswith("attn")

        def run_module():
            """The inspected module's outputs over the kept loss tokens, ``[tokens, hidden]``."""
            if g.inp:  # a sparse block routes each token alone: one forward over every loss token, weights cast once
                x = torch.cat(kept, 0)
                with torch.no_grad(), batch.autocast(cache=False):
                    o = inspect(x.view(1, -1, x.shape[-1]))
                return o.reshape(-1, o.shape[-1])
            outs = []
            with torch.no_grad(), batch.autocast():
                for i, x in enumerate(kept):
                    x = x.view(1, -1, x.shape[-1])
                    o = inspect(x, **attn_kw[i]) if is_attn else inspect(x)
                    o = o[0] if isinstance(o, tuple) else o
                    outs.append(o.reshape(-1, o.shape[-1]))
            return torch.cat(outs, 0)

        def forward(ws):
            """The inspected module's output with the group's linears set to the candidate weights ``ws`` (the
            originals are put back after, so the candidates are freed with ``ws``)."""
            for m, w in zip(lins, ws):
                m.weight.data = w
            try:
                return run_module()
            finally:
                for m, w in zip(lins, originals):
                    m.weight.data = w
        return forward, run_module()

    def _round(self, layer, stats, head_scale, linears, head_of, rule: set[str]) -> dict[str, QuantizedWeight]:
        """Clip and round every linear of ``linears`` (``rule``: those under the expert rule, rounded to nearest
        as they are)."""
        from .awq import apply_clip, search_clip
        from .rtn import quantize_rtn

        cfg = self.cfg
        no_clip = layer_no_clip(self.arch, self.layer_index)
        result = {}
        for n in linears:
            lin = layer.get_submodule(n)
            head = head_of(n)
            s = head_scale[head]
            w = lin.weight.data
            if n in rule:
                result[n] = quantize_rtn(w, cfg.w_bits, cfg.w_group_size, cfg.w_sym, min_zero=self.min_zero,
                                         mse=cfg.mse_scales)
                continue
            if cfg.clip and n not in no_clip:
                x = torch.cat(stats[head].kept, 0)
                max_val = search_clip(w, x / s.to(x.dtype), cfg.w_bits, cfg.w_group_size, cfg.w_sym, cfg.n_grid,
                                      cfg.max_shrink)
                w = apply_clip(w, max_val, cfg.w_group_size)
            if cfg.awq_rounding == "gptq":
                H = stats[head].H / (s.unsqueeze(1) * s.unsqueeze(0))  # Hessian of the scaled inputs x / s
                result[n] = self._gptq(n, w, H, consume_h=True)
            else:
                result[n] = quantize_rtn(w, cfg.w_bits, cfg.w_group_size, cfg.w_sym, min_zero=self.min_zero,
                                         mse=cfg.mse_scales)
        return result


METHODS: dict[str, type[QuantMethod]] = {m.name: m for m in (RTN, AWQ, GPTQ)}
