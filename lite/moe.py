"""The sparse Mixture-of-Experts block as per-expert linears: the form in which ``lite`` calibrates and quantizes MoE
models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral; the tables are :class:`lite.formats.arch.MoESpec`).

transformers 5 keeps a sparse layer's experts as fused 3-D parameters (``experts.gate_up_proj [E, 2I, H]``), while
checkpoints (``save_pretrained`` and every published one) name each expert's projections separately
(``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``). :class:`SparseMoeBlock`
holds one ``nn.Linear`` per expert projection under exactly those names, so the layer-wise pipeline reads, hooks,
quantizes and writes experts as it does any other linear, and :func:`install_sparse_blocks` puts it into a
meta-device Hugging Face skeleton in place of transformers' fused block.

Its forward is transformers' ``*SparseMoeBlock`` (the same operations in the same order, so a float32 layer gives
the same numbers): router logits ``x Wᵀ`` in ``x``'s dtype, softmax in float32, the ``top_k`` largest, renormalised
to sum to 1 when the family does, cast to the logits' dtype (kept float32 for Mixtral); each expert's SwiGLU
``down(silu(gate(x)) * up(x))`` runs on **only the tokens routed to it**, times their routing weights, summed per
token in expert order; Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``. A hook on an expert's
linear therefore sees that expert's routed tokens, chosen by the model's own router: each expert's GPTQ Hessian
and AWQ statistics come from them.

**The expert rule.** An expert whose routed calibration tokens in its layer are fewer than
:func:`expert_token_threshold` (a tenth of its fair share ``tokens * top_k / num_experts``, at least 1) is rounded
to nearest on its own weights: no AWQ scale search of its up→down pair, no clipping search, no GPTQ error
compensation. Statistics from a handful of tokens fit those tokens, not the expert, and an expert with none has
no statistics at all (an empty Hessian, a mean |x| of zero). The gate/up of such an expert still carry the
post-attention norm's shared AWQ scale, which every reader of that norm must (it is folded into the norm), and a
shared expert sees every token so the rule never applies to it. Each run counts the experts that took the rule.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .formats.arch import MoEConfig

# The expert rule: fewer routed calibration tokens than this fraction of an expert's fair share -> round to nearest.
MIN_TOKEN_SHARE = 0.1


def expert_token_threshold(n_tokens: int, moe: MoEConfig) -> int:
    """Fewest routed calibration tokens an expert needs for calibrated quantization (:data:`MIN_TOKEN_SHARE` of its
    fair share ``n_tokens * top_k / num_experts``, at least 1): ``n_tokens`` is the calibration tokens that enter the
    layer. Experts below it take the expert rule (the module docstring)."""
    return max(1, math.ceil(MIN_TOKEN_SHARE * n_tokens * moe.top_k / moe.num_experts))


class ExpertMLP(nn.Module):
    """One SwiGLU expert ``down(act(gate(x)) * up(x))`` whose three bias-free linears are named ``names`` (gate, up,
    down: ``gate_proj``/``up_proj``/``down_proj``, Mixtral ``w1``/``w3``/``w2``).
    ``x [N, hidden]`` → ``[N, hidden]``."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str], act: str = "silu") -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.names = names
        g, u, d = names
        setattr(self, g, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, u, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, d, nn.Linear(intermediate, hidden, bias=False))
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, hidden]`` → ``[N, hidden]``."""
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


class SparseMoeBlock(nn.Module):
    """A sparse MLP block as per-expert linears (module docstring): ``gate`` (the router, ``nn.Linear(hidden, E)``),
    ``experts.{e}`` (:class:`ExpertMLP`), and with a shared expert ``shared_expert`` (gate/up/down ``_proj``) and
    ``shared_expert_gate`` (``nn.Linear(hidden, 1)``). ``in_features`` is ``hidden`` (the width of its input, as a
    linear's). ``forward(x [B, T, hidden]) -> [B, T, hidden]``, what every family's decoder layer expects of its
    ``mlp``."""

    def __init__(self, moe: MoEConfig, hidden: int, act: str = "silu") -> None:
        super().__init__()
        self.moe, self.in_features = moe, hidden
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, moe.intermediate_size, moe.spec.projections, act)
                                     for _ in range(moe.num_experts))
        if moe.shared_intermediate_size:
            self.shared_expert = ExpertMLP(hidden, moe.shared_intermediate_size,
                                           ("gate_proj", "up_proj", "down_proj"), act)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` → routing weights ``[T, top_k]`` (the logits' dtype, or float32 for Mixtral) and expert
        ids ``[T, top_k]`` (int64), as transformers' ``*TopKRouter``."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.moe.spec.fp32_weights:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, T, hidden]`` → ``[B, T, hidden]``: routed experts (each on its tokens only, in expert order), then the
        shared expert (last, so a hook that stops the forward at a shared linear has seen every routed expert)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(ids, num_classes=self.moe.num_experts).permute(2, 1, 0)  # [E, top_k, T]
            hit = (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            slot, tok = torch.where(mask[e])
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def install_sparse_blocks(model: nn.Module, config: dict, moe: MoEConfig) -> None:
    """Replace transformers' fused sparse block in every sparse decoder layer of ``model`` (a Hugging Face causal LM,
    normally on the meta device) by a :class:`SparseMoeBlock` built on the meta device, registered under the
    checkpoint's name (``mlp``; Mixtral ``block_sparse_moe``, then also reachable as ``layer.mlp``, which the decoder
    layer's forward calls, without appearing twice among the parameters)."""
    from accelerate import init_empty_weights

    hidden, act = int(config["hidden_size"]), config.get("hidden_act", "silu")
    name = moe.spec.block
    for i, layer in enumerate(model.model.layers):
        if not moe.sparse[i]:
            continue
        with init_empty_weights():
            block = SparseMoeBlock(moe, hidden, act)
        if name != "mlp":
            del layer.mlp
        setattr(layer, name, block)
        if name != "mlp":
            layer.__dict__["mlp"] = block  # an attribute, not a submodule: the forward finds it, state dicts do not
