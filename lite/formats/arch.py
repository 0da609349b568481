"""Per-architecture facts as data: which decoder-layer linears exist and how each family differs.

Both ``lite`` (what to quantize) and ``turbo`` (how to build the model) read these tables; nothing else
branches on ``model_type``. Dense families (Llama, Mistral, Qwen2, Qwen3) share one set of tables; Mixture-of-Experts
families (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) add a :class:`MoESpec` (where the sparse block lives, how its router
normalises, the shared expert, which layers are sparse), resolved per config into :class:`MoEConfig`, and the per-layer
functions (:func:`layer_linears`, :func:`layer_scaling_groups`, :func:`layer_sequential`, :func:`input_heads`,
:func:`layer_residual`) give every layer's linears, AWQ groups, GPTQ order and residual readers/writers with one entry
per expert; :func:`unquantized_modules` names the 16-bit routers a quantized checkpoint keeps.
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
    qk_norm: RMSNorm on q and k before RoPE: per head (Qwen3, ``head_dim`` weights) or, with
    ``qk_norm_per_head=False``, over all heads together (OLMoE: ``num_heads * head_dim`` weights for q,
    ``num_kv_heads * head_dim`` for k).
    moe: the family's sparse MLP (:class:`MoESpec`); ``None`` for dense families.
    """

    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = "mlp_bias"
    qk_norm: bool = False
    qk_norm_per_head: bool = True
    moe: "MoESpec | None" = None

    def flag(self, value: bool | str, config: dict) -> bool:
        """Resolve a bool-or-config-flag field against a config.json dict."""
        return bool(config.get(value, False)) if isinstance(value, str) else value


@dataclass(frozen=True)
class MoESpec:
    """Where a Mixture-of-Experts family keeps its sparse MLP and how it routes (Hugging Face names, as
    ``save_pretrained`` writes them).

    block: the sparse block's path in a decoder layer (``mlp``; Mixtral ``block_sparse_moe``). Its router is
    ``{block}.gate`` (a bias-free linear ``[num_experts, hidden]``, kept 16-bit), expert ``e``'s projections are
    ``{block}.experts.{e}.{gate, up, down}`` named by ``projections`` (Mixtral ``w1``, ``w3``, ``w2``).
    num_experts / intermediate: the config fields of the expert count (``num_experts`` and ``num_local_experts`` are
    both read, as transformers' attribute map does) and of one expert's intermediate width.
    norm_topk: whether the top-k routing weights are renormalised to sum to 1 (``True`` or the config flag).
    shared_expert: a dense ``{block}.shared_expert`` MLP (width ``shared_expert_intermediate_size``) added to every
    token, scaled by ``sigmoid({block}.shared_expert_gate(x))`` (Qwen2-MoE).
    sparse_step: which layers are sparse follows ``decoder_sparse_step`` and ``mlp_only_layers`` (the others keep
    a dense ``mlp`` of ``intermediate_size``); else every layer is sparse.
    fp32_weights: the routing weights multiply the experts' outputs in float32 (transformers' Mixtral); else they are
    cast to the router logits' dtype first (Qwen-MoE, OLMoE). Only the 16-bit forward of :mod:`lite.moe` tells them
    apart.
    Routing (all families): ``softmax(router(x))`` in float32, the ``top_k`` largest, renormalised if ``norm_topk``.
    """

    block: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    num_experts: str = "num_experts"
    intermediate: str = "moe_intermediate_size"
    norm_topk: bool | str = "norm_topk_prob"
    shared_expert: bool = False
    sparse_step: bool = False
    fp32_weights: bool = False


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(),
    "qwen2": ArchSpec(qkv_bias=True, o_bias=False, mlp_bias=False),
    "qwen3": ArchSpec(qk_norm=True),
    "qwen3_moe": ArchSpec(qk_norm=True, mlp_bias=False, moe=MoESpec(sparse_step=True)),
    "qwen2_moe": ArchSpec(qkv_bias="qkv_bias", o_bias=False, mlp_bias=False,
                          moe=MoESpec(shared_expert=True, sparse_step=True)),
    "olmoe": ArchSpec(qk_norm=True, qk_norm_per_head=False, mlp_bias=False, moe=MoESpec(intermediate="intermediate_size")),
    "mixtral": ArchSpec(mlp_bias=False, moe=MoESpec(block="block_sparse_moe", projections=("w1", "w3", "w2"),
                                                    num_experts="num_local_experts", intermediate="intermediate_size",
                                                    norm_topk=True, fp32_weights=True)),
}


def arch_spec(config: dict) -> ArchSpec:
    """The :class:`ArchSpec` of a config.json dict. Raises ``LiteturboError`` naming the supported ones."""
    mt = config.get("model_type")
    if mt not in ARCHITECTURES:
        archs = config.get("architectures") or [mt]
        raise LiteturboError(
            f"unsupported architecture {archs[0]!r} (model_type={mt!r}); liteturbo supports the "
            f"model types: {', '.join(sorted(ARCHITECTURES))} (LlamaForCausalLM, MistralForCausalLM, "
            f"Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, "
            f"MixtralForCausalLM)"
        )
    return ARCHITECTURES[mt]


@dataclass(frozen=True)
class ScalingGroup:
    """One AWQ scaling group: ``prev`` (a norm or linear inside the decoder layer) feeds ``linears``;
    ``inspect`` is the module whose output error scores a candidate scale (``""`` = the linears themselves).
    ``needs_same_width``: only when ``prev``'s output width equals the linears' input width (v → o without GQA).
    ``inp``: the module whose input statistics (mean |x|, loss tokens) the search reads (``""``: the first linear's);
    a sparse block's, whose experts each see only their routed tokens. ``passengers``: linears that read ``prev``'s
    output too but are never quantized (a router, the shared-expert gate): they are scaled with the group (their
    16-bit weights times ``s``) so that folding ``1/s`` into ``prev`` leaves the model unchanged.
    """

    prev: str
    linears: tuple[str, ...]
    inspect: str
    needs_same_width: bool = False
    inp: str = ""
    passengers: tuple[str, ...] = ()


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


# ----------------------------------------------------------------------------------------------------
# Mixture-of-Experts: a config resolved, and every per-layer table with one entry per expert.
@dataclass(frozen=True)
class MoEConfig:
    """A MoE config.json resolved (see :class:`MoESpec`): ``num_experts``, ``top_k`` (``num_experts_per_tok``),
    ``intermediate_size`` (one expert's), ``norm_topk_prob``, ``shared_intermediate_size`` (0: no shared expert),
    ``sparse`` (per decoder layer: whether its MLP is the sparse block), ``spec``."""

    spec: MoESpec
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    sparse: tuple[bool, ...]

    def expert(self, e: int) -> tuple[str, str, str]:
        """Module paths (inside a decoder layer) of expert ``e``'s gate, up and down projections."""
        b, (g, u, d) = self.spec.block, self.spec.projections
        return f"{b}.experts.{e}.{g}", f"{b}.experts.{e}.{u}", f"{b}.experts.{e}.{d}"

    @property
    def router(self) -> str:
        """Module path of the router (``[num_experts, hidden]``, never quantized)."""
        return f"{self.spec.block}.gate"

    @property
    def shared(self) -> tuple[str, str, str] | None:
        """Module paths of the shared expert's gate, up and down projections (``None`` without one)."""
        if not self.shared_intermediate_size:
            return None
        b = self.spec.block
        return f"{b}.shared_expert.gate_proj", f"{b}.shared_expert.up_proj", f"{b}.shared_expert.down_proj"

    @property
    def shared_gate(self) -> str | None:
        """Module path of the shared expert's sigmoid gate (``[1, hidden]``, never quantized), or ``None``."""
        return f"{self.spec.block}.shared_expert_gate" if self.shared_intermediate_size else None

    def unquantized(self, layer: int) -> tuple[str, ...]:
        """The linears of sparse layer ``layer`` that stay 16-bit in every checkpoint (router, shared-expert gate)."""
        if not self.sparse[layer]:
            return ()
        return (self.router,) + ((self.shared_gate,) if self.shared_gate else ())


def _int_field(config: dict, key: str, default=None) -> int:
    v = config.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LiteturboError(f"config.json field {key!r} must be a positive integer for a {config.get('model_type')} "
                             f"model, got {v!r}")
    return v


def moe_config(config: dict) -> MoEConfig | None:
    """The :class:`MoEConfig` of a config.json dict, ``None`` for a dense family. Raises ``LiteturboError`` on
    missing or invalid MoE fields (``top_k`` above the expert count, unsupported router options)."""
    spec = arch_spec(config).moe
    if spec is None:
        return None
    # transformers 5 writes num_local_experts where the published configs say num_experts (an attribute map)
    field = next((f for f in (spec.num_experts, "num_experts", "num_local_experts") if config.get(f) is not None),
                 spec.num_experts)
    n = _int_field(config, field)
    k = _int_field(config, "num_experts_per_tok")
    if k > n:
        raise LiteturboError(f"config.json: num_experts_per_tok={k} exceeds {spec.num_experts}={n}")
    if config.get("clip_qkv") is not None:
        raise LiteturboError(f"config.json: clip_qkv={config['clip_qkv']!r} is not supported (only null)")
    layers = _int_field(config, "num_hidden_layers")
    if spec.sparse_step:
        step = _int_field(config, "decoder_sparse_step", 1)
        dense = set(config.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    else:
        sparse = (True,) * layers
    shared = _int_field(config, "shared_expert_intermediate_size") if spec.shared_expert else 0
    norm = spec.norm_topk if isinstance(spec.norm_topk, bool) else bool(config.get(spec.norm_topk, False))
    return MoEConfig(spec, n, k, _int_field(config, spec.intermediate), norm, shared, sparse)


DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ATTENTION_LINEARS = DECODER_LINEARS[:4]


def _mlp_triples(config: dict, layer: int) -> list[tuple[str, str, str]]:
    """(gate, up, down) module paths of every MLP of decoder layer ``layer``: the dense MLP, or each expert in order
    then the shared expert."""
    moe = moe_config(config)
    if moe is None or not moe.sparse[layer]:
        return [DENSE_MLP]
    triples = [moe.expert(e) for e in range(moe.num_experts)]
    return triples + ([moe.shared] if moe.shared else [])


def layer_linears(config: dict, layer: int) -> tuple[str, ...]:
    """Every linear of decoder layer ``layer`` that is quantized (module paths inside the layer): attention, then the
    dense MLP or each expert's (gate, up, down) and the shared expert's. Routers are not among them."""
    return ATTENTION_LINEARS + tuple(n for t in _mlp_triples(config, layer) for n in t)


def input_heads(config: dict, layer: int) -> dict[str, str]:
    """Linear → the linear whose input statistics it shares (same input: k/v → q, up → gate of the same MLP)."""
    heads = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj"}
    heads.update({up: gate for gate, up, _ in _mlp_triples(config, layer)})
    return heads


def layer_scaling_groups(config: dict, layer: int) -> tuple[ScalingGroup, ...]:
    """AWQ scaling groups of decoder layer ``layer``: the Llama ones; in a sparse layer the post-attention norm feeds
    every expert's (and the shared expert's) gate and up, scored on the whole sparse block, and each MLP's up feeds
    its own down."""
    triples = _mlp_triples(config, layer)
    if triples == [DENSE_MLP]:
        return LLAMA_SCALING_GROUPS
    moe = moe_config(config)
    block = moe.spec.block
    return LLAMA_SCALING_GROUPS[:2] + (
        ScalingGroup("post_attention_layernorm", tuple(n for g, u, _ in triples for n in (g, u)), block, inp=block,
                     passengers=moe.unquantized(layer)),
    ) + tuple(ScalingGroup(u, (d,), d) for _, u, d in triples)


def layer_sequential(config: dict, layer: int) -> tuple[tuple[str, ...], ...]:
    """GPTQ true-sequential order of decoder layer ``layer``: attention as Llama, then every MLP's gate/up together,
    then every down together (one forward of the block per set)."""
    triples = _mlp_triples(config, layer)
    return LLAMA_SEQUENTIAL[:2] + (tuple(n for g, u, _ in triples for n in (g, u)), tuple(d for _, _, d in triples))


def layer_no_clip(config: dict, layer: int) -> tuple[str, ...]:
    """Linears whose clipping AWQ skips (q and k)."""
    return LLAMA_NO_CLIP


def unquantized_modules(config: dict) -> tuple[str, ...]:
    """Full module paths (``model.layers.{i}.mlp.gate``, ...) of every linear that stays 16-bit in a quantized
    checkpoint of this model: the routers and shared-expert gates of the sparse layers; empty for dense families."""
    moe = moe_config(config)
    if moe is None:
        return ()
    return tuple(f"model.layers.{i}.{n}" for i in range(len(moe.sparse)) for n in moe.unquantized(i))


def layer_residual(config: dict, layer: int) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], tuple[str, ...]]:
    """The residual stream of decoder layer ``layer`` as data (:data:`RESIDUAL_READERS` / :data:`RESIDUAL_WRITERS` of
    a dense layer): ``((norm, linears it feeds), ...)`` and the linears that write back. A sparse layer's
    post-attention norm feeds every expert's gate/up, the shared expert's, the router and the shared-expert gate;
    every expert's down (and the shared one) writes."""
    mt = config["model_type"]
    triples = _mlp_triples(config, layer)
    if triples == [DENSE_MLP]:
        return RESIDUAL_READERS[mt], RESIDUAL_WRITERS[mt]
    readers = tuple(n for g, u, _ in triples for n in (g, u)) + moe_config(config).unquantized(layer)
    return ((RESIDUAL_READERS[mt][0], ("post_attention_layernorm", readers)),
            ("self_attn.o_proj",) + tuple(d for _, _, d in triples))
