"""Weight-quantization methods, one small class each (RTN, AWQ, GPTQ), driven layer by layer by :mod:`lite.pipeline`.

A method gets one decoder layer (float32 weights on the run's device) and the layer's calibration inputs
(:class:`LayerBatch`), and returns ``{linear name: QuantizedWeight}``; it may also change the float layer in ways
that leave its output unchanged (AWQ folds its scales into the previous norm or linear). The algorithms are the
tensor functions of :mod:`lite.rtn`, :mod:`lite.awq` and :mod:`lite.gptq`.

Statistics are streamed: one forward pass over the calibration samples feeds, per linear input, the running
mean |x| (AWQ), the Hessian ``2/n XᵀX`` (GPTQ) and the first ``loss_tokens`` tokens (AWQ's loss and clipping
search), so memory does not grow with the calibration set beyond the layer's inputs and outputs. Forwards run in
the compute dtype (:func:`compute_dtype`: bfloat16 where the CPU or GPU multiplies it natively, 5x float32's
speed on this project's AVX512-BF16 CPU), the solvers in float32.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch

from backends.types import QuantizedWeight

from .formats import DECODER_LINEARS
from .formats.arch import NO_CLIP, SCALING_GROUPS, SEQUENTIAL_ORDER

# linears that read the same input as another one (their statistics are shared)
SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                "mlp.up_proj": "mlp.gate_proj"}


def input_head(name: str) -> str:
    """The linear whose input statistics ``name`` shares (``k_proj`` → ``q_proj``)."""
    return SHARED_INPUT.get(name, name)


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

    def autocast(self):
        """Context in which forwards run in the compute dtype."""
        if self.dtype == torch.float32 or not self.inputs:
            return contextlib.nullcontext()
        return torch.autocast(self.inputs[0].device.type, dtype=self.dtype)

    def run(self, layer: torch.nn.Module) -> list[torch.Tensor]:
        """The layer's outputs for every sample (stored in the compute dtype): the next layer's inputs."""
        outs = []
        with torch.no_grad(), self.autocast():
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
    the Hessian ``H = 2/n Σ xxᵀ`` (float32 ``[in, in]``, when asked) and the rows of the first ``keep`` samples
    (``kept``, compute dtype). Non-finite rows are skipped (warned once)."""

    def __init__(self, in_features: int, device, hessian: bool, keep: int, dtype: torch.dtype) -> None:
        self.abs_sum = torch.zeros(in_features, device=device)
        self.rows = 0
        self.H = torch.zeros(in_features, in_features, device=device) if hessian else None
        self.keep, self.kept, self.dtype, self.skipped = keep, [], dtype, 0

    def add(self, x: torch.Tensor) -> None:
        """Add rows ``x [..., in]`` (any float dtype)."""
        x = x.detach().reshape(-1, x.shape[-1])
        ok = torch.isfinite(x).all(-1)
        if not bool(ok.all()):
            self.skipped += int((~ok).sum())
            x = x[ok]
        if len(self.kept) < self.keep:
            self.kept.append(x.to(self.dtype))
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


def collect_stats(layer: torch.nn.Module, batch: LayerBatch, heads: list[str], hessian: bool, keep: int,
                  stop_after: str | None = None) -> dict[str, InputStats]:
    """One forward of ``layer`` over every sample with hooks on the ``heads`` linears' inputs; stops each sample
    after ``stop_after`` (its input captured) when given."""
    stats, handles = {}, []
    dev = batch.inputs[0].device
    for n in heads:
        mod = layer.get_submodule(n)
        stats[n] = InputStats(mod.in_features, dev, hessian, keep, batch.dtype)

        def hook(_m, args, n=n):
            """Add the linear's input rows to its statistics; stop the sample after ``stop_after``."""
            stats[n].add(args[0])
            if n == stop_after:
                raise StopForward
        handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad(), batch.autocast():
            for h, kw in zip(batch.inputs, batch.kwargs):
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
    ``model_type``: the family (tables of :mod:`lite.formats.arch`); ``min_zero``: smallest storable zero point
    of the output format. ``notes`` collects events worth recording in the provenance file (raised dampening,
    limited scales), each a dict with ``layer``, ``linear`` and what happened."""

    name = ""
    calibrated = True

    def __init__(self, cfg, model_type: str, min_zero: int = 0) -> None:
        self.cfg, self.model_type, self.min_zero = cfg, model_type, min_zero
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
                                min_zero=self.min_zero, mse=cfg.mse_scales) for n in DECODER_LINEARS}


class GPTQ(QuantMethod):
    """GPTQ (:mod:`lite.gptq`), true-sequential inside a layer: each set of linears
    (:data:`lite.formats.arch.SEQUENTIAL_ORDER`) gets Hessians from inputs that went through the already
    quantized sets."""

    name = "gptq"

    def quantize_layer(self, layer, batch):
        """See :meth:`QuantMethod.quantize_layer`."""
        order = SEQUENTIAL_ORDER[self.model_type]
        seq = self.cfg.true_sequential
        groups = order if seq else (tuple(n for g in order for n in g),)
        result = {}
        for group in groups:
            heads = list(dict.fromkeys(input_head(n) for n in group))
            stats = collect_stats(layer, batch, heads, hessian=True, keep=0, stop_after=heads[-1] if seq else None)
            last = {input_head(n): n for n in group}  # the linear after which a head's Hessian is not needed
            for n in group:
                lin = layer.get_submodule(n)
                head = stats[input_head(n)]
                qw = self._gptq(n, lin.weight.data, head.H, consume_h=last[input_head(n)] == n)
                if last[input_head(n)] == n:
                    head.H = None
                # only forwards read it now, and under autocast they cast it to the compute dtype: store it there
                lin.weight.data = qw.dequantize(torch.float32).to(lin.weight.device, batch.dtype)
                result[n] = qw
        return result


class AWQ(QuantMethod):
    """AWQ (:mod:`lite.awq`): per scaling group (:data:`lite.formats.arch.SCALING_GROUPS`) the scale search on
    the first ``loss_tokens`` calibration tokens, the scales folded into the previous op (limited so the folded
    weight stays finite in the checkpoint's dtype), then the clipping search and the rounding: ``rtn`` (the
    paper) or ``gptq`` (GPTQ's error compensation on the scaled inputs' Hessian, with ``act_order`` if asked).

    ``fold_dtypes``: the checkpoint dtype of each previous op's weight, by module name in the layer.
    """

    name = "awq"

    def __init__(self, cfg, model_type: str, min_zero: int = 0) -> None:
        super().__init__(cfg, model_type, min_zero)
        self.fold_dtypes: dict[str, torch.dtype] = {}

    def quantize_layer(self, layer, batch):
        """See :meth:`QuantMethod.quantize_layer`."""
        from .awq import activation_scale_limit, search_scales, weight_scale

        cfg = self.cfg
        heads = list(dict.fromkeys(input_head(n) for n in DECODER_LINEARS))
        n_loss = batch.loss_samples(cfg.loss_tokens)
        stats = collect_stats(layer, batch, heads, hessian=cfg.awq_rounding == "gptq", keep=n_loss)
        # every head's inputs are divided by the scales of its group once they are folded
        head_scale = {h: torch.ones(layer.get_submodule(h).in_features, device=batch.inputs[0].device) for h in heads}
        attn_kw = [{k: kw[k] for k in ("position_embeddings", "attention_mask") if k in kw}
                   for kw in batch.kwargs[:n_loss]]
        for g in SCALING_GROUPS[self.model_type]:
            prev = layer.get_submodule(g.prev)
            lins = [layer.get_submodule(n) for n in g.linears]
            if g.needs_same_width and prev.weight.shape[0] != lins[0].weight.shape[1]:
                continue
            st = stats[input_head(g.linears[0])]
            originals = [m.weight.data.clone() for m in lins]
            forward, reference = self._loss_forward(layer, g, lins, originals, st.kept, attn_kw, batch)
            scales, _alpha, _loss = search_scales(originals, st.mean_abs, weight_scale(originals, cfg.w_group_size),
                                                  forward, reference, cfg.w_bits, cfg.w_group_size, cfg.w_sym,
                                                  cfg.n_grid, cfg.duo_scaling)
            scales = scales.to(prev.weight.device)
            dtype = self.fold_dtypes.get(g.prev, torch.float32)
            limited = activation_scale_limit(prev.weight.data, scales, dtype)
            if limited is not None:
                self.note(g.prev, f"AWQ scales limited on {int((limited != scales).sum())} channels so that "
                                  f"{g.prev}.weight / s stays finite in {str(dtype).replace('torch.', '')}")
                scales = limited
            for m, w in zip(lins, originals):
                m.weight.data = w * scales
            # fold 1/s into the previous op: a norm's weight or a linear's output rows (and bias)
            prev.weight.data = prev.weight.data / scales.view(-1, *([1] * (prev.weight.dim() - 1)))
            if getattr(prev, "bias", None) is not None:
                prev.bias.data = prev.bias.data / scales
            head_scale[input_head(g.linears[0])] = scales
        return self._round(layer, stats, head_scale)

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
            outs = []
            with torch.no_grad(), batch.autocast():
                for i, x in enumerate(kept):
                    x = x.view(1, -1, x.shape[-1])
                    o = inspect(x, **attn_kw[i]) if is_attn else inspect(x)
                    o = o[0] if isinstance(o, tuple) else o
                    outs.append(o.reshape(-1, o.shape[-1]))
            return torch.cat(outs, 0)

        def forward(ws):
            """The inspected module's output with the group's linears set to the candidate weights ``ws``."""
            for m, w in zip(lins, ws):
                m.weight.data = w
            return run_module()
        return forward, run_module()

    def _round(self, layer, stats, head_scale) -> dict[str, QuantizedWeight]:
        from .awq import apply_clip, search_clip
        from .rtn import quantize_rtn

        cfg = self.cfg
        result = {}
        for n in DECODER_LINEARS:
            lin = layer.get_submodule(n)
            head = input_head(n)
            s = head_scale[head]
            w = lin.weight.data
            if cfg.clip and n not in NO_CLIP[self.model_type]:
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
