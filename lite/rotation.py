"""A rotation of the residual stream folded into the weights (QuaRot, Ashkboos et al. 2024, Sec. 4 "R1"; SpinQuant,
Liu et al. 2024, "R1" with a random rather than learned matrix). The result is still a standard Llama/Qwen checkpoint.

With an orthogonal ``Q [H, H]`` and RMSNorm weights first folded into the linears they feed, ``RMSNorm(x Q) =
RMSNorm(x) Q``, so rotating every residual vector by ``Q`` leaves the function unchanged when

* the embedding table becomes ``E Q``;
* the linears that read the residual (after a norm: q/k/v, gate/up) become ``W diag(γ) Q`` and the norm weight ``1``;
* the linears that write it (o_proj, down_proj) become ``Qᵀ W`` (bias ``b Q``);
* the output head becomes ``W_head diag(γ_final) Q`` and the final norm weight ``1`` (a tied head is untied: the
  table and the head now differ).

Outlier channels of the residual are spread over all channels, so group-wise 4-bit rounding of the weights that read
it loses less. ``Q`` is a randomized Hadamard matrix when ``H`` is a power of two (QuaRot), else a Haar-random
orthogonal matrix (QR of a Gaussian, signs fixed), from ``seed``. Tables of which modules read and write the
residual: :func:`lite.formats.arch.layer_residual` (a dense layer's :data:`~lite.formats.arch.RESIDUAL_READERS` /
``RESIDUAL_WRITERS``; in a sparse Mixture-of-Experts layer every expert, the shared expert, the router and the
shared-expert gate read the post-attention norm, so the 16-bit routers are rotated too and routing is unchanged).
"""
from __future__ import annotations

import torch

from .formats.arch import layer_residual


def random_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal ``[n, n]`` float64: ``H_n diag(±1) / sqrt(n)`` (Sylvester Hadamard) for powers of two, else
    Haar-random (QR of a Gaussian with ``R``'s diagonal signs folded into ``Q``)."""
    g = torch.Generator().manual_seed(seed)
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
        return h * signs / n ** 0.5
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


class ResidualRotation:
    """Folds a residual rotation into a model layer by layer (see the module docstring). ``hidden``: H;
    ``model_type``: the config.json dict (or a dense family's ``model_type``) whose tables
    (:func:`lite.formats.arch.layer_residual`) say which linears read and write the residual."""

    def __init__(self, hidden: int, model_type: str | dict, seed: int = 0) -> None:
        self.Q = random_rotation(hidden, seed)
        self.arch = dict(model_type) if isinstance(model_type, dict) else {"model_type": model_type}
        self.model_type = self.arch["model_type"]

    def rotate_inputs(self, h: torch.Tensor) -> torch.Tensor:
        """Residual vectors ``[..., H]`` (e.g. the captured inputs of layer 0) → ``h Q``, same dtype."""
        return (h.double() @ self.Q.to(h.device)).to(h.dtype)

    @torch.no_grad()
    def fold_layer(self, layer: torch.nn.Module, index: int = 0) -> None:
        """Fold the norm weights into the linears they feed and rotate decoder layer ``index`` (``layer``) in place."""
        readers_of, writers = layer_residual(self.arch, index)
        for norm_name, readers in readers_of:
            norm = layer.get_submodule(norm_name)
            gamma = norm.weight.data.double()
            for n in readers:
                lin = layer.get_submodule(n)
                Q = self.Q.to(lin.weight.device)
                lin.weight.data = ((lin.weight.data.double() * gamma) @ Q).to(lin.weight.dtype)
            norm.weight.data = torch.ones_like(norm.weight.data)
        for n in writers:
            lin = layer.get_submodule(n)
            Q = self.Q.to(lin.weight.device)
            lin.weight.data = (Q.t() @ lin.weight.data.double()).to(lin.weight.dtype)
            if getattr(lin, "bias", None) is not None:
                lin.bias.data = (lin.bias.data.double() @ Q).to(lin.bias.dtype)

    @torch.no_grad()
    def fold_outside(self, embed: torch.Tensor, head: torch.Tensor, final_norm: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tensors outside the decoder layers → ``(E Q, W_head diag(γ) Q, ones)`` in their own dtypes
        (``head`` is the embedding table itself for a tied model)."""
        Q = self.Q
        e = (embed.double() @ Q).to(embed.dtype)
        w = ((head.double() * final_norm.double()) @ Q).to(head.dtype)
        return e, w, torch.ones_like(final_norm)
