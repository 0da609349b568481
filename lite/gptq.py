"""GPTQ: Hessian-aware one-shot weight quantization (Frantar et al., "GPTQ", ICLR 2023, Algorithm 1).

Objective, per linear layer with calibration inputs ``X [n, in]``::

    minimise_Q  || W X^T - Q X^T ||_F^2      (H = 2/n X^T X)

solved column by column: quantize column ``i``, then spread its error over the not-yet-quantized columns
with the inverse-Hessian row (Cholesky form, Sec. 3 "Step 3"), in blocks of ``block_size`` columns (lazy
batch updates, Sec. 3 "Step 2"). ``act_order`` quantizes columns by descending Hessian diagonal
(the "desc_act" heuristic of the reference implementation); groups then follow that order unless
``static_groups``.
"""
from __future__ import annotations

import warnings

import torch

from backends.types import QuantizedWeight

from .rtn import group_params


class HessianAccumulator:
    """Running ``H = 2/n · Σ x xᵀ`` over calibration rows ``x [*, in]`` (float32)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        """Add rows ``x [..., in]``; non-finite rows are skipped (with a warning)."""
        x = x.reshape(-1, x.shape[-1]).float()
        ok = torch.isfinite(x).all(-1)
        if not bool(ok.all()):
            warnings.warn(f"GPTQ: skipped {int((~ok).sum())} calibration rows with NaN/inf activations")
            x = x[ok]
        m = x.shape[0]
        if m == 0:
            return
        self.H.mul_(self.n / (self.n + m))
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H.addmm_(x.t(), x)


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                  act_order: bool = False, static_groups: bool = False, block_size: int = 128,
                  damp_percent: float = 0.01, min_zero: int = 0, bias: torch.Tensor | None = None,
                  mse: bool = False, info: dict | None = None, consume_h: bool = False) -> QuantizedWeight:
    """Quantize ``weight [out, in]`` given Hessian ``H [in, in]``; returns a :class:`QuantizedWeight`.

    Dampening: ``damp_percent`` of the mean Hessian diagonal is added; if the Cholesky factorization still
    fails it is raised tenfold (up to 5 times). Dead input channels (zero Hessian diagonal) get weight 0 in
    the error propagation (their codes quantize the original weight). ``min_zero=1`` keeps asymmetric zero
    points representable in the GPTQ v1 format (which stores ``zero - 1``). ``g_idx`` is set when
    ``act_order`` without ``static_groups`` (static groups keep the contiguous grouping, storable in any format). Group scales and zero points come from
    :func:`lite.rtn.group_params` on the not-yet-quantized (updated) columns; ``mse`` searches shrunk ranges.
    ``info`` (optional dict) receives ``damp_percent`` (the dampening used, as a fraction of the mean diagonal)
    and ``fallback`` (a reason, when the solver gave up and rounded to nearest). ``consume_h``: ``H`` (float32) is
    the caller's last use and is overwritten (permuted, dampened, then replaced by its inverse) instead of copied.
    Memory: besides ``W`` (a float32 copy and the codes), three ``[in, in]`` float32 matrices are alive at once at
    most, the caller's ``H`` among them with ``consume_h`` (without it, the caller's ``H`` is a fourth), e.g.
    2.3 GiB for Llama-3.1-8B's down_proj (in = 14,336). Raises ``ValueError``
    for a bad group size.
    """
    info = {} if info is None else info
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    W = weight.detach().float()  # copied below (permuted or cloned): the caller's weight is never changed
    out_f, in_f = W.shape
    gs = in_f if group_size == -1 else group_size
    if in_f % gs:
        raise ValueError(f"in_features={in_f} is not divisible by group_size={gs}")
    H = H.detach()
    if not (consume_h and H.dtype == torch.float32):
        H = H.float().clone() if H.dtype == torch.float32 else H.float()
    if not torch.isfinite(H).all():
        warnings.warn("GPTQ: non-finite Hessian; falling back to round-to-nearest for this layer")
        info["fallback"] = "non-finite Hessian"
        H = torch.eye(in_f, device=H.device)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    n_groups = in_f // gs

    # static groups: parameters from the original (unpermuted) weight before any update
    static = None
    if static_groups:
        static = [group_params(W[:, g * gs:(g + 1) * gs], bits, sym, min_zero, mse) for g in range(n_groups)]

    perm = None
    if not act_order:
        W = W.clone() if W.data_ptr() == weight.data_ptr() else W
    else:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        rows = H.index_select(0, perm)
        torch.index_select(rows, 1, perm, out=H)  # H[perm][:, perm] in H's own storage
        del rows
    invperm = torch.argsort(perm) if perm is not None else None

    diag_mean = torch.mean(torch.diag(H))
    damp, applied = damp_percent * diag_mean, 0.0
    Hinv = None
    for attempt in range(6):
        H.diagonal().add_(damp - applied)  # H + damp * I, in place
        applied = damp
        L, bad = torch.linalg.cholesky_ex(H)
        if not bad:
            inv = torch.cholesky_inverse(L)
            del L
            Hinv, bad = torch.linalg.cholesky_ex(inv, upper=True)
            del inv
            if not bad and torch.isfinite(Hinv).all():
                break
        Hinv = None
        if attempt == 5:
            warnings.warn("GPTQ: Hessian not positive definite even with heavy dampening; using RTN")
            info["fallback"] = "Hessian not positive definite even with heavy dampening"
            break
        damp = damp * 10 if damp > 0 else 1e-6 * max(float(diag_mean), 1.0)
    del H
    if Hinv is None:
        Hinv = torch.eye(in_f, device=W.device)
    if attempt > 0 and "fallback" not in info:  # dampening was raised
        used = float(damp / diag_mean) if float(diag_mean) > 0 else float(damp)
        info["damp_percent"] = float(f"{used:.3g}")  # a power of ten of the asked one; drop float32 noise

    Q = torch.zeros(W.shape, dtype=torch.uint8, device=W.device)  # the codes (0..2^bits - 1)
    scales = torch.zeros(n_groups, out_f)
    zeros = torch.zeros(n_groups, out_f)
    cur_scale = cur_zero = None
    qmax = (1 << bits) - 1
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                g = (int(perm[col]) if perm is not None else col) // gs
                cur_scale, cur_zero = static[g]
            elif col % gs == 0:
                # parameters from the *updated* weights of the next group, in quantization order
                block = torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :gs]
                cur_scale, cur_zero = group_params(block, bits, sym, min_zero, mse)
                g = col // gs
                scales[g], zeros[g] = cur_scale, cur_zero
            w = W1[:, i]
            q = torch.clamp(torch.round(w / cur_scale) + cur_zero, 0, qmax)
            Q1[:, i] = q
            err = (w - (q - cur_zero) * cur_scale) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        Q[:, i1:i2] = Q1.to(torch.uint8)
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if static is not None:
        for g, (s, z) in enumerate(static):
            scales[g], zeros[g] = s, z
    if invperm is not None:
        Q = Q[:, invperm]
    g_idx = None
    if act_order and not static_groups:  # column c was quantized at position invperm[c]
        g_idx = (invperm // gs).to(torch.int32).cpu()
    return QuantizedWeight(bits=bits, group_size=group_size, sym=sym, qweight=Q.to(torch.uint8).cpu(),
                           qzeros=zeros.to(torch.uint8).cpu(), scales=scales.to(torch.float16).cpu(), g_idx=g_idx,
                           bias=bias)
