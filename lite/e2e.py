"""End-to-end tuning of a quantized model's group scales and norm weights against the float model's logits.

After the layer-wise method (RTN, AWQ, GPTQ, with or without block-wise tuning) has fixed every code, the codes
and zero points stay, and only float values the formats already store are trained:

* each quantized linear's group scales, through a log-offset ``δ`` per group: ``s' = s · e^δ`` (``[n_groups, out]``,
  as :class:`~backends.types.QuantizedWeight` stores them), and
* every RMSNorm weight of the checkpoint (``*norm.weight``: the decoder layers' and the final one; with AWQ they
  already hold the folded scales).

The loss is the KL divergence ``KL(p_float || p_quant)`` of the next-token distributions over whole calibration
windows, averaged over tokens: unlike the layer-wise objectives, it sees how later layers and the output head use
the error of earlier ones. This is the E2E-QP stage of EfficientQAT (Chen et al. 2024, "EfficientQAT: Efficient
Quantization-Aware Training for Large Language Models", Sec. 3.3), which trains the quantization step sizes end to
end with the codes frozen; here the float model is the teacher (distillation), and the norms train too.
Optimiser: Adam, one calibration window per step, learning rate 1e-3 for ``δ`` and the norms (measured on
SmolLM2-135M: 3e-3 diverged, 5e-4 was slower). The last :data:`HELD_OUT` calibration windows are not trained on; the
tuned values are kept only if their KL on them went down (otherwise the method's values stay, and the provenance
says so).

The result is the same checkpoint format (same codes, new scales and norms), so every reader loads it as before.

Memory: the float model is loaded once in the compute dtype; its final hidden states for the windows used (tuning
and held-out) are kept (``[L, H]`` each), then its decoder linears are replaced by :class:`_QuantLinear` (int8
codes, float32 scales and ``δ`` with its gradient and Adam's two moments), whose backward pass re-dequantizes the
weight rather than keeping it. What grows with the model is the autograd activations of one window; the output
head's logits exist for :data:`CHUNK` tokens at a time (:mod:`lite.memory`).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.types import QuantizedWeight

from .formats import LiteturboError
from .layerwise import release_heap

LR = 1e-3
HELD_OUT = 2
CHUNK = 128  # tokens per slice of the output head in the loss (its logits are recomputed in the backward pass)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, gidx: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """``codes ⊙ scales[group]`` as ``dtype`` ``[out, in]``, for centered int8 codes ``[out, in]`` and scales
    ``[G, out]``; ``gidx`` ``[in]`` (int64) maps input channels to groups, ``None`` for contiguous groups (then a
    broadcast view, not a full-size scale matrix)."""
    if gidx is not None:
        return codes.to(dtype) * scales[gidx].t().to(dtype)
    out, n_groups = codes.shape[0], scales.shape[0]
    return (codes.view(out, n_groups, -1).to(dtype) * scales.t().to(dtype)[:, :, None]).view(codes.shape)


class _QuantLinearFn(torch.autograd.Function):
    """``y = x Wᵀ + b`` with ``W = codes ⊙ scales[group]`` in ``dtype``; differentiable in ``x`` and ``scales``
    (``∂scales[g, o] = Σ_{i in g} ∂W[o, i] · codes[o, i]``). The backward pass re-dequantizes ``W`` instead of keeping
    it, so only ``x``, the int8 codes and the scales are saved."""

    @staticmethod
    def forward(ctx, x, codes, scales, gidx, bias, dtype):
        """``x`` ``[..., in]`` (any float dtype) -> ``y`` ``[..., out]`` in ``dtype``."""
        xd = x.to(dtype)
        y = F.linear(xd, _dequantize(codes, scales, gidx, dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xd, codes, scales)
        ctx.gidx, ctx.dtype, ctx.x_dtype = gidx, dtype, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        """Gradients of ``x`` (its dtype) and ``scales`` (``[G, out]``, their dtype); none for the rest."""
        xd, codes, scales = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        grad_x = (grad @ _dequantize(codes, scales, ctx.gidx, ctx.dtype)).to(ctx.x_dtype)
        grad_w = grad.flatten(0, -2).t().float() @ xd.flatten(0, -2).float()  # [out, in]
        out, n_groups = codes.shape[0], scales.shape[0]
        if ctx.gidx is not None:
            per_weight = (grad_w * codes.float()).t().to(scales.dtype)  # [in, out]
            grad_s = torch.zeros_like(scales).index_add_(0, ctx.gidx, per_weight)
        else:
            grad_s = (grad_w.view(out, n_groups, -1) * codes.view(out, n_groups, -1).float()).sum(-1).t()
            grad_s = grad_s.to(scales.dtype)
        return grad_x, None, grad_s, None, None, None


class _RMSNormFn(torch.autograd.Function):
    """``y = w ⊙ x / sqrt(mean(x²) + eps)`` over the last dimension, normalised in float32 as Hugging Face's
    ``LlamaRMSNorm`` and returned in ``x``'s dtype (what the next linear casts it to anyway, so q/k/v and gate/up
    save one shared copy); saves ``x`` as given and ``1/rms`` per row, not a float32 copy of ``x``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        """``x`` ``[..., H]``, ``weight`` ``[H]`` float32 -> ``[..., H]`` in ``x``'s dtype."""
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv)
        return (weight * (xf * inv).to(x.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        """Gradients of ``x`` (its dtype) and ``weight`` (float32); none for ``eps``."""
        x, weight, inv = ctx.saved_tensors
        xf, g = x.float(), grad.float()
        n = xf * inv
        grad_w = (g * n.to(x.dtype).float()).flatten(0, -2).sum(0).to(weight.dtype)
        gn = g * weight.float()
        grad_x = inv * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class _SiluMulFn(torch.autograd.Function):
    """``silu(gate) ⊙ up`` (the gated MLP's inner product) saving only ``gate`` and ``up``; ``silu`` is recomputed in
    the backward pass."""

    @staticmethod
    def forward(ctx, gate, up):
        """``gate``, ``up`` ``[..., I]`` (same dtype) -> ``silu(gate) * up``, same shape and dtype."""
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        """Gradients of ``gate`` and ``up`` (computed in float32, returned in their dtypes)."""
        gate, up = ctx.saved_tensors
        g, sig = gate.float(), torch.sigmoid(gate.float())
        grad_up = grad.float() * g * sig
        grad_gate = grad.float() * up.float() * sig * (1 + g * (1 - sig))
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def _gated_mlp_forward(mlp: torch.nn.Module):
    """A forward for a Llama-style MLP (``down(silu(gate(x)) ⊙ up(x))``) through :class:`_SiluMulFn`."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., H]`` -> ``[..., H]``, as the MLP's own forward."""
        return mlp.down_proj(_SiluMulFn.apply(mlp.gate_proj(x), mlp.up_proj(x)))
    return forward


class _TunedRMSNorm(torch.nn.Module):
    """An RMSNorm whose float32 ``weight`` is trained (:class:`_RMSNormFn`)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., H]`` -> normalised ``[..., H]`` in ``x``'s dtype."""
        return _RMSNormFn.apply(x, self.weight, self.eps)


class _QuantLinear(torch.nn.Module):
    """A decoder linear being tuned: fixed centered int8 codes ``[out, in]``, scales ``[G, out]`` and bias, and the
    trained log-offset ``delta`` ``[G, out]`` (zeros at the start: the method's scales)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, gidx: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.codes, self.scales, self.gidx, self.bias, self.dtype = codes, scales, gidx, bias, dtype
        self.delta = torch.nn.Parameter(torch.zeros_like(scales))

    def tuned_scales(self) -> torch.Tensor:
        """The current scales ``s · e^δ``, float32 ``[G, out]``."""
        return self.scales * torch.exp(self.delta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in the compute dtype."""
        return _QuantLinearFn.apply(x, self.codes, self.tuned_scales(), self.gidx, self.bias, self.dtype)


def _kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of ``KL(teacher || student)``, from logits ``[T, V]`` (float32 scalar)."""
    s = F.log_softmax(student_logits.float(), -1)
    t = F.log_softmax(teacher_logits.float(), -1)
    return F.kl_div(s, t, log_target=True, reduction="sum")


def _unpack(tensors: dict[str, torch.Tensor], pre: str, fmt, bits: int, group_size: int,
            sym: bool) -> QuantizedWeight:
    return fmt.unpack({n: tensors[f"{pre}.{n}"] for n in fmt.tensors if f"{pre}.{n}" in tensors}, bits, group_size,
                      sym)


def tune_end_to_end(src: Path, tensors: dict[str, torch.Tensor], fmt, bits: int, group_size: int, sym: bool,
                    samples: list[torch.Tensor], steps: int, device: torch.device,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, torch.Tensor], dict]:
    """Tune the group scales and norm weights of the assembled checkpoint ``tensors`` (name -> tensor, as written:
    packed linears in ``fmt``, a :class:`~lite.formats.registry.WeightFormat`, with ``bits/group_size/sym``) so that
    the model reproduces the float model at ``src`` (a Hugging Face folder) on ``samples`` (int64 token windows
    ``[1, L]``). ``steps`` Adam steps of one window each, forwards in ``dtype`` (bfloat16 under autocast, or float32)
    on ``device``. Returns ``(tensors, info)``: when the held-out KL fell, ``tensors`` itself with the tuned scales
    and norms written in (in their stored dtypes), else untouched; ``info`` holds ``steps``, ``seconds``,
    ``train_windows`` (distinct windows trained on; steps beyond them cycle), ``held_out_windows`` (2, 1 with 2-3
    windows, 0 with one: the KL is then measured on the training window), ``held_out_kl_before/after`` and ``kept``.
    Raises ``LiteturboError`` when ``samples`` is empty, ``steps < 1`` or
    the checkpoint has no quantized linear.
    """
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM

    if steps < 1 or not samples:
        raise LiteturboError("end-to-end tuning needs --e2e-steps >= 1 and calibration windows")
    marker = "." + fmt.tensors[0]
    prefixes = [k[: -len(marker)] for k in tensors if k.endswith(marker)]
    if not prefixes:
        raise LiteturboError("end-to-end tuning found no quantized linear in the checkpoint")
    t0 = time.perf_counter()
    release_heap(collect=True)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)

    def ctx():
        """Autocast to ``dtype``, or a disabled autocast in float32."""
        return (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else torch.autocast(device.type, enabled=False))

    def hidden(ids: torch.Tensor) -> torch.Tensor:
        """The model's final hidden states ``[L, H]`` for one window ``[1, L]``."""
        with ctx():
            return model.model(ids.to(device)).last_hidden_state[0]

    n_val = min(HELD_OUT, len(samples) // 2)
    train = samples[: len(samples) - n_val]
    val = samples[len(samples) - n_val:] if n_val else samples
    with torch.no_grad():  # the teacher's outputs, before its linears are replaced
        targets = [hidden(x) for x in train[:steps]]
        val_targets = [hidden(x) for x in val]

    # the student: quantized linears in place of the float ones, the checkpoint's norms (trained) and other tensors
    for pre in prefixes:
        qw = _unpack(tensors, pre, fmt, bits, group_size, sym)
        gidx = qw.group_index().long()
        centered = (qw.qweight.to(device, torch.int16) - qw.qzeros.to(device, torch.int16)[gidx.to(device)].t())
        contiguous = qw.group_size > 0 and torch.equal(gidx, torch.arange(gidx.numel()) // qw.group_size)
        bias = tensors.get(f"{pre}.bias")
        parent, _, name = pre.rpartition(".")
        setattr(model.get_submodule(parent), name, _QuantLinear(
            centered.to(torch.int8), qw.scales.to(device, torch.float32), None if contiguous else gidx.to(device),
            None if bias is None else bias.to(device, torch.float32), dtype))
    norms = {}
    for pre, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RMSNorm") and f"{pre}.weight" in tensors:
            parent, _, name = pre.rpartition(".")
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))
            new = _TunedRMSNorm(tensors[f"{pre}.weight"].to(device, torch.float32), eps)
            setattr(model.get_submodule(parent) if parent else model, name, new)
            norms[f"{pre}.weight"] = new.weight
    if getattr(model.config, "hidden_act", None) == "silu":
        for mod in model.modules():
            if all(hasattr(mod, n) for n in ("gate_proj", "up_proj", "down_proj")):
                mod.forward = _gated_mlp_forward(mod)
    for k, p in model.named_parameters():  # anything else the method changed (e.g. biases folded into)
        if k in tensors and k not in norms and not k.endswith(".delta"):
            p.data = tensors[k].to(device, p.dtype)
    release_heap(collect=True)
    linears = {pre: model.get_submodule(pre) for pre in prefixes}
    head = model.get_output_embeddings()

    def slice_kl(hs: torch.Tensor, ht: torch.Tensor) -> torch.Tensor:
        """Summed KL over one slice of tokens, from student/teacher hidden states ``[T, H]``."""
        with ctx():
            return _kl_sum(head(hs), head(ht))

    def kl(hs: torch.Tensor, ht: torch.Tensor) -> torch.Tensor:
        """Mean over tokens of KL(teacher || student) from final hidden states; the head's logits exist for
        :data:`CHUNK` tokens at a time (recomputed in the backward pass), not for the whole window."""
        total = sum(checkpoint(slice_kl, hs[i:i + CHUNK], ht[i:i + CHUNK], use_reentrant=False)
                    if hs.requires_grad else slice_kl(hs[i:i + CHUNK], ht[i:i + CHUNK])
                    for i in range(0, hs.shape[0], CHUNK))
        return total / hs.shape[0]

    @torch.no_grad()
    def held_out_kl() -> float:
        """Mean per-token KL on the held-out windows (a float)."""
        return sum(float(kl(hidden(x), t)) for x, t in zip(val, val_targets)) / len(val)

    before = held_out_kl()
    opt = torch.optim.Adam([{"params": [m.delta for m in linears.values()], "lr": LR},
                            {"params": list(norms.values()), "lr": LR}])
    for step in range(steps):
        i = step % len(train)  # < len(targets): targets holds the first min(steps, len(train)) windows
        loss = kl(hidden(train[i]), targets[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = held_out_kl()
    finite = all(torch.isfinite(p).all() for p in [*norms.values(), *(m.delta for m in linears.values())])
    kept = finite and after < before
    info = {"steps": steps, "train_windows": min(steps, len(train)), "held_out_windows": n_val,
            "held_out_kl_before": float(f"{before:.6g}"), "held_out_kl_after": float(f"{after:.6g}"), "kept": kept}
    if kept:  # the tuned values replace the method's in ``tensors``, one linear at a time
        with torch.no_grad():
            new_scales = {pre: m.tuned_scales().cpu() for pre, m in linears.items()}
            new_norms = {k: v.detach().cpu() for k, v in norms.items()}
        del model, linears, norms, opt, head
        for pre, scales in new_scales.items():
            qw = _unpack(tensors, pre, fmt, bits, group_size, sym)
            big = torch.finfo(qw.scales.dtype).max
            tuned = QuantizedWeight(bits=qw.bits, group_size=qw.group_size, sym=qw.sym, qweight=qw.qweight,
                                    qzeros=qw.qzeros, scales=scales.clamp(-big, big).to(qw.scales.dtype),
                                    g_idx=qw.g_idx, bias=qw.bias)
            tensors.update({f"{pre}.{k}": v.cpu() for k, v in fmt.pack(tuned).items()})
        for k, v in new_norms.items():
            tensors[k] = v.to(tensors[k].dtype).contiguous()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return tensors, info
