"""Block-wise tuning of a quantized decoder layer: learned rounding and group scales against the float model's output.

In the spirit of AutoRound (Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient Descent", Sec. 3): for
every quantized linear of one decoder layer, starting from the codes ``q0`` and scales ``s`` another method chose
(RTN, AWQ, GPTQ), learn a rounding offset ``V ∈ [-1, 1]`` per weight and a log-scale ``δ`` per group so that

    minimise_{V, δ}  || f(X; W(V, δ)) − Y ||²,    W(V, δ) = (clamp(q0 + round(V), 0, 2^b − 1) − z) · s·e^δ

where ``f`` is the whole decoder layer (attention and MLP together, so errors of one linear can be compensated by
the others), ``X`` the layer's calibration inputs (through the already quantized layers before it), ``Y`` the
float model's outputs of this layer (float layers all the way from the embeddings, as AutoRound's targets, so the
layer also makes up for error that earlier layers left) and ``round`` passes its gradient straight through. Optimiser:
Adam on mini-batches of samples (AutoRound uses signed SGD; Adam converged faster here), each mini-batch one
batched forward; short runs take larger steps. The zero points and the
grouping stay; the result is written in the same format. A tuned layer is kept only if its loss on the tuning
samples is lower than before.
"""
from __future__ import annotations

import torch

from backends.types import QuantizedWeight


def _ste_round(v: torch.Tensor) -> torch.Tensor:
    return v + (torch.round(v) - v).detach()


def _same_length(idx: list[int], inputs: list[torch.Tensor]) -> list[list[int]]:
    """``idx`` grouped by the samples' sequence length (order kept within a group)."""
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(inputs[i].shape[1], []).append(i)
    return list(groups.values())


def tune_layer(layer: torch.nn.Module, qws: dict[str, QuantizedWeight], inputs: list[torch.Tensor],
               kwargs: list[dict], targets: list[torch.Tensor], steps: int = 100, lr: float | None = None,
               scale_lr: float | None = None, batch: int = 4, dtype: torch.dtype = torch.float32
               ) -> tuple[dict[str, QuantizedWeight], float, float]:
    """Tune ``qws`` (the layer's quantized linears, by module name) so that ``layer`` with them reproduces
    ``targets`` (the float layer's outputs ``[1, L, H]`` for ``inputs``, one per sample, with the layer's ``kwargs``).
    Forwards run under autocast to ``dtype`` when it is not float32. Returns ``(qws, loss before, loss after)``; the
    original ``qws`` come back when tuning did not lower the loss. ``lr`` / ``scale_lr`` (Adam's, for the rounding
    offsets and the log-scales): by default 5e-3 / 1e-3 from 100 steps up, and ``0.5 / steps`` / ``0.1 / steps`` below
    (as AutoRound's ``1 / iters``: a short run can still move an offset far enough to flip a rounding). Samples of one
    length run as one batched forward."""
    lr = max(5e-3, 0.5 / steps) if lr is None else lr
    scale_lr = max(1e-3, 0.1 / steps) if scale_lr is None else scale_lr
    from torch.func import functional_call

    dev = inputs[0].device
    params, fixed = {}, {}
    for n, qw in qws.items():
        gidx = qw.group_index().long().to(dev)
        fixed[n] = (qw.qweight.float().to(dev), qw.qzeros.float().to(dev)[gidx].t(),
                    qw.scales.float().to(dev), gidx, float((1 << qw.bits) - 1))
        params[n] = (torch.zeros(qw.qweight.shape, device=dev, requires_grad=True),
                     torch.zeros(qw.scales.shape, device=dev, requires_grad=True))

    def weights(rounded: bool = True) -> dict[str, torch.Tensor]:
        """The dequantized float32 weights ``[out, in]`` of every tuned linear, by parameter name, from the current
        offsets and log-scales (rounded with a straight-through gradient)."""
        out = {}
        for n, (q0, zf, s, gidx, qmax) in fixed.items():
            v, d = params[n]
            q = torch.clamp(q0 + (_ste_round(v) if rounded else v), 0, qmax)
            out[f"{n}.weight"] = (q - zf) * (s * torch.exp(d))[gidx].t()
        return out

    def ctx():
        """Autocast to ``dtype`` for a forward, or a disabled autocast in float32."""
        return torch.autocast(dev.type, dtype=dtype) if dtype != torch.float32 else torch.autocast(dev.type,
                                                                                                     enabled=False)

    def loss_of(idx: list[int]) -> torch.Tensor:
        """Mean over the samples ``idx`` of each one's mean squared error against its target (a float32 scalar)."""
        # samples of one length run as one batched forward (their rotary tables and causal masks are the same, and
        # the layer's keyword tensors have a batch dimension of 1 that broadcasts); the loss is the mean of the
        # per-sample mean squared errors either way
        ws = weights()
        total = 0.0
        for group in _same_length(idx, inputs):
            x = inputs[group[0]] if len(group) == 1 else torch.cat([inputs[i] for i in group])
            y = targets[group[0]] if len(group) == 1 else torch.cat([targets[i] for i in group])
            with ctx():
                o = functional_call(layer, ws, (x,), kwargs[group[0]])
            o = o[0] if isinstance(o, tuple) else o
            total = total + (o.float() - y.float()).pow(2).mean() * len(group)
        return total / len(idx)

    everything = list(range(len(inputs)))
    with torch.no_grad():
        before = float(loss_of(everything))
    opt = torch.optim.Adam([{"params": [p[0] for p in params.values()], "lr": lr},
                            {"params": [p[1] for p in params.values()], "lr": scale_lr}])
    for step in range(steps):
        start = (step * batch) % len(inputs)
        idx = [(start + j) % len(inputs) for j in range(min(batch, len(inputs)))]
        opt.zero_grad(set_to_none=True)
        loss = loss_of(idx)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for v, _ in params.values():
                v.clamp_(-1.0, 1.0)
    with torch.no_grad():
        after = float(loss_of(everything))
        if not after < before:
            return qws, before, before
        tuned = {}
        for n, qw in qws.items():
            q0, _zf, s, _gidx, qmax = fixed[n]
            v, d = params[n]
            tuned[n] = QuantizedWeight(bits=qw.bits, group_size=qw.group_size, sym=qw.sym,
                                       qweight=torch.clamp(q0 + torch.round(v), 0, qmax).to(torch.uint8).cpu(),
                                       qzeros=qw.qzeros, scales=(s * torch.exp(d)).to(torch.float16).cpu(),
                                       g_idx=qw.g_idx, bias=qw.bias)
    return tuned, before, after
