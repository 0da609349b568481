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
