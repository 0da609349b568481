"""Per-architecture facts as data: which decoder-layer linears exist and how each family differs.

Both ``lite`` (what to quantize) and ``turbo`` (how to build the model) read these tables; nothing else
branches on ``model_type``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LiteturboError

# Linear layers of one decoder layer, by their Hugging Face module path inside ``model.layers.{i}``.
DECODER_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


@dataclass(frozen=True)
class ArchSpec:
    """How one model family deviates from the Llama template.

    qkv_bias / o_bias / mlp_bias: ``True``/``False`` or the name of the config flag that decides it.
    qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
    """

    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = "mlp_bias"
    qk_norm: bool = False

    def flag(self, value: bool | str, config: dict) -> bool:
        """Resolve a bool-or-config-flag field against a config.json dict."""
        return bool(config.get(value, False)) if isinstance(value, str) else value


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(),
    "qwen2": ArchSpec(qkv_bias=True, o_bias=False, mlp_bias=False),
    "qwen3": ArchSpec(qk_norm=True),
}


def arch_spec(config: dict) -> ArchSpec:
    """The :class:`ArchSpec` of a config.json dict. Raises ``LiteturboError`` naming the supported ones."""
    mt = config.get("model_type")
    if mt not in ARCHITECTURES:
        archs = config.get("architectures") or [mt]
        raise LiteturboError(
            f"unsupported architecture {archs[0]!r} (model_type={mt!r}); liteturbo supports the "
            f"model types: {', '.join(sorted(ARCHITECTURES))} (LlamaForCausalLM, MistralForCausalLM, "
            f"Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    return ARCHITECTURES[mt]


@dataclass(frozen=True)
class ScalingGroup:
    """One AWQ scaling group: ``prev`` (a norm or linear inside the decoder layer) feeds ``linears``;
    ``inspect`` is the module whose output error scores a candidate scale (``""`` = the linears themselves).
    ``needs_same_width``: only when ``prev``'s output width equals the linears' input width (v → o without GQA).
    """

    prev: str
    linears: tuple[str, ...]
    inspect: str
    needs_same_width: bool = False


# Llama/Mistral/Qwen2/Qwen3 share these (AutoAWQ's per-model ``get_layers_for_scaling``, as data).
LLAMA_SCALING_GROUPS = (
    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", needs_same_width=True),
    ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
# GPTQ true-sequential order: each set is quantized after the ones before it, on their quantized outputs.
LLAMA_SEQUENTIAL = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",),
)
# linears whose clipping AWQ skips (q/k feed a softmax through their product; clipping them hurts)
LLAMA_NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")
SCALING_GROUPS = {name: LLAMA_SCALING_GROUPS for name in ARCHITECTURES}
SEQUENTIAL_ORDER = {name: LLAMA_SEQUENTIAL for name in ARCHITECTURES}
NO_CLIP = {name: LLAMA_NO_CLIP for name in ARCHITECTURES}

# The residual stream as data (for a rotation folded into the weights, lite.rotation): each norm that reads it and
# the linears it feeds, and the linears that write back into it.
RESIDUAL_READERS = {name: (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                           ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
                    for name in ARCHITECTURES}
RESIDUAL_WRITERS = {name: ("self_attn.o_proj", "mlp.down_proj") for name in ARCHITECTURES}
