"""AWQ: activation-aware weight quantization (Lin et al., "AWQ", MLSys 2024).

Per scaling group (a previous op feeding a set of linears; :func:`lite.formats.arch.layer_scaling_groups`):

    s* = argmin_s || f(Q(W · diag(s)) · diag(s)⁻¹ X) − f(W X) ||²,   s = s_x^α / s_w^(1−α)   (Sec. 3.2)

where ``f`` is the module the group feeds (attention block, MLP, or the linear itself), ``s_x`` the mean
|activation| per input channel, ``s_w`` the mean group-normalised |weight| per input channel ("duo scaling",
as in AutoAWQ), α on a grid of ``n_grid`` values in [0, 1). ``s`` is folded into the previous op
(norm weight or previous linear's output rows) so the fp model is unchanged. Then a clipping search per
linear shrinks each group's max |w| to minimise the output error on sampled tokens (AutoAWQ ``auto_clip``).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .rtn import fake_quantize


def activation_scale(xs: list[torch.Tensor]) -> torch.Tensor:
    """Mean |x| per input channel over all calibration tokens; float32 ``[in]``. Non-finite rows skipped."""
    total, n = None, 0
    for x in xs:
        x = x.reshape(-1, x.shape[-1]).float()
        ok = torch.isfinite(x).all(-1)
        x = x[ok]
        s = x.abs().sum(0)
        total = s if total is None else total + s
        n += x.shape[0]
    if total is None or n == 0:
        raise ValueError("no finite calibration activations")
    return total / n


def weight_scale(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| normalised by its group max, per input channel; float32 ``[in]``. The rows of
    all ``weights`` (same ``in``) are normalised one weight at a time into one float32 buffer, so a group of many
    linears (every expert of a sparse layer) costs one float32 copy of them, not three."""
    in_f = weights[0].shape[1]
    gs = in_f if group_size == -1 else group_size
    out = torch.empty(sum(w.shape[0] for w in weights), in_f, device=weights[0].device)
    r = 0
    for x in weights:
        g = x.float().abs().view(x.shape[0], in_f // gs, gs)
        out[r:r + x.shape[0]] = (g / (g.amax(-1, keepdim=True) + 1e-6)).view(x.shape[0], in_f)
        r += x.shape[0]
    return out.mean(0)


def search_scales(weights: list[torch.Tensor], x_mean: torch.Tensor, w_mean: torch.Tensor,
                  forward: Callable[[list[torch.Tensor]], torch.Tensor], reference: torch.Tensor,
                  bits: int, group_size: int, sym: bool, n_grid: int = 20, duo_scaling: bool = True):
    """Grid search of the AWQ scale exponent α.

    ``forward(ws)`` runs the inspected module with the linears' weights replaced by ``ws`` and returns its
    output, compared with ``reference`` (the fp output) by mean squared error. Returns ``(scales [in],
    best_alpha, best_loss)``; ``scales`` is all ones (no-op) when every candidate loss is non-finite.
    """
    x_mean = torch.nan_to_num(x_mean.float(), nan=0.0, posinf=0.0).clamp(min=0)
    w_mean = torch.nan_to_num(w_mean.float(), nan=0.0, posinf=0.0).clamp(min=0)
    best = (torch.ones_like(x_mean), -1.0, float("inf"))
    for i in range(n_grid):
        alpha = i / n_grid
        if duo_scaling:
            s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
        else:
            s = x_mean.pow(alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if not torch.isfinite(s).all():
            continue
        ws = [fake_quantize(w.float() * s, bits, group_size, sym) / s for w in weights]
        out = forward(ws)
        loss = float((out.float() - reference.float()).pow(2).mean())
        del ws, out  # before the next candidates exist: one set of candidate weights alive at a time
        if loss < best[2]:
            best = (s, alpha, loss)
    if best[1] < 0:
        warnings.warn("AWQ: every scale candidate gave a non-finite loss; keeping this group unscaled")
    return best


def search_clip(weight: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, sym: bool,
                n_grid: int = 20, max_shrink: float = 0.5, n_tokens: int = 512,
                batch: int | None = None) -> torch.Tensor:
    """Per-group clipping threshold ``[out, n_groups]`` minimising the group-wise output error (AWQ clip).

    ``x [n, in]`` are the linear's (scaled) inputs; ``n_tokens`` of them, evenly spaced, are used, in ``x``'s
    dtype for the products (bfloat16 inputs multiply natively; errors are summed in float32). Output rows are
    processed in batches of ``batch`` rows (default: about 4M products per batch; any ``out``, no
    divisibility needed).
    """
    w = weight.float()
    out_f, in_f = w.shape
    gs = in_f if group_size == -1 else group_size
    ng = in_f // gs
    x = x.reshape(-1, in_f)
    x = x[torch.isfinite(x).all(-1)]
    if x.shape[0] == 0:
        return w.abs().view(out_f, ng, gs).amax(-1)
    step = max(1, x.shape[0] // n_tokens)
    xs = x[::step][:n_tokens].reshape(-1, ng, gs).transpose(0, 1)  # [ng, t, gs]
    dt = xs.dtype
    batch = batch or max(1, min(out_f, (1 << 22) // (xs.shape[1] * ng)))
    best_all = []
    for o in range(0, out_f, batch):
        wb = w[o:o + batch].view(-1, ng, gs)  # [b, ng, gs]
        org_max = wb.abs().amax(-1, keepdim=True)  # [b, ng, 1]
        ref = torch.bmm(xs, wb.permute(1, 2, 0).to(dt)).float()  # [ng, t, b]
        best_max = org_max.clone()
        best_err = torch.full(org_max.shape, float("inf"), device=w.device)
        for i in range(int(max_shrink * n_grid)):
            mx = org_max * (1 - i / n_grid)
            cw = torch.clamp(wb, -mx, mx)
            qw = fake_quantize(cw.view(-1, in_f), bits, group_size, sym).view_as(cw)
            out = torch.bmm(xs, qw.permute(1, 2, 0).to(dt)).float()
            err = (out - ref).pow(2).mean(1).t().unsqueeze(-1)  # [b, ng, 1]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, mx, best_max)
        best_all.append(best_max.squeeze(-1))
    return torch.cat(best_all, 0)


def apply_clip(weight: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    """Clamp each group of ``weight [out, in]`` to ``[-max_val, max_val]`` (``max_val [out, n_groups]``)."""
    out_f, in_f = weight.shape
    gs = in_f if group_size == -1 else group_size
    w = weight.float().view(out_f, in_f // gs, gs)
    m = max_val.unsqueeze(-1)
    return torch.clamp(w, -m, m).view(out_f, in_f).to(weight.dtype)


def activation_scale_limit(prev_weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """AWQ scales raised where folding ``1/s`` into the previous op would not fit ``dtype``; ``None`` if all fit.

    ``prev_weight``: the previous op's weight (``[C]`` norm or ``[C, in]`` linear rows); the folded weight is
    ``prev_weight / s`` per channel ``C``. A channel whose largest folded value would exceed half of ``dtype``'s
    largest finite value (float16: 65504; headroom for the activations it multiplies at inference) gets the smallest
    scale that keeps it there, and a channel already beyond that is not allowed to grow (``s >= 1``), so the
    checkpoint never holds inf (the linears are scaled with the same ``s``: the float model is unchanged).
    """
    if not dtype.is_floating_point or dtype == torch.float32 or dtype == torch.float64:
        return None
    limit = torch.finfo(dtype).max / 2
    peak = prev_weight.float().abs().reshape(prev_weight.shape[0], -1).amax(1)
    need = peak / torch.maximum(peak, torch.full_like(peak, limit))
    if not bool((scales < need).any()):
        return None
    return torch.maximum(scales, need)
