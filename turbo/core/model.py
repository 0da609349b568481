"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 and the Mixture-of-Experts Qwen3-MoE, Qwen2-MoE, OLMoE,
Mixtral) over a flat token batch and a paged KV cache.

One short file in the spirit of gpt-fast: weights are plain tensors (or backend handles for W4A16), the
forward is a loop over layers. Family differences come from :mod:`lite.formats.arch` tables. A sparse layer's MLP is
router → top-k → the backend's grouped experts operation (:meth:`backends.base.Backend.experts`) → (+ a gated
shared expert); the router and the shared-expert gate stay 16-bit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from backends import Backend, PagedKVCache, QuantizedWeight
from backends.types import AttentionMetadata
from lite.formats import LiteturboError, arch_spec, load_config, load_quantized_linears, quantization_spec
from lite.formats.arch import MoEConfig, moe_config


@dataclass
class ModelConfig:
    """The config.json fields the model needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    qk_norm_per_head: bool = True  # False: one RMSNorm over all heads of q (and of k), as OLMoE
    moe: MoEConfig | None = None  # Mixture-of-Experts layout (lite.formats.arch.moe_config); None for dense models

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a config.json dict. Raises ``LiteturboError`` for unsupported or missing fields."""
        spec = arch_spec(cfg)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise LiteturboError(f"hidden_act={act!r} is not supported (only silu)")
        try:
            heads = _positive(cfg, "num_attention_heads")
            hidden = _positive(cfg, "hidden_size")
            kv_heads = _positive(cfg, "num_key_value_heads", heads)
            if heads % kv_heads:
                raise LiteturboError(f"config.json: num_attention_heads={heads} is not a multiple of "
                                     f"num_key_value_heads={kv_heads}")
            if cfg.get("head_dim") is None and hidden % heads:
                raise LiteturboError(f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads="
                                     f"{heads} and no head_dim is given")
            head_dim = _positive(cfg, "head_dim", hidden // heads)
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if not isinstance(rope, dict):
                raise LiteturboError(f"config.json: rope_scaling must be an object or null, got {rope!r}")
            theta = _positive_number(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0, "rope_theta")
            rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
            if rope_type not in ("default", "llama3", "linear"):
                raise LiteturboError(f"rope_type={rope_type!r} is not supported (default, linear, llama3)")
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            return cls(
                model_type=cfg["model_type"], vocab_size=_positive(cfg, "vocab_size"), hidden_size=hidden,
                intermediate_size=_positive(cfg, "intermediate_size"), num_layers=_positive(cfg, "num_hidden_layers"),
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                rms_norm_eps=_positive_number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
                rope_theta=theta, rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
                max_position_embeddings=_positive(cfg, "max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=spec.flag(spec.qkv_bias, cfg), o_bias=spec.flag(spec.o_bias, cfg),
                mlp_bias=spec.flag(spec.mlp_bias, cfg), qk_norm=spec.qk_norm,
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
                qk_norm_per_head=spec.qk_norm_per_head, moe=moe_config(cfg),
            )
        except KeyError as e:
            raise LiteturboError(f"config.json lacks the field {e.args[0]!r}") from None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32), with linear or llama3-style scaling (Llama 3.1 report)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    factor = float(sc.get("factor", 1.0))
    if sc["rope_type"] == "linear":
        return inv / factor
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(is_medium, smoothed, inv_l)


class Linear:
    """A dense, W4A16 or W8A16 linear bound to a backend handle (``quantized``: None, "w4a16", "w8a16")."""

    __slots__ = ("backend", "handle", "quantized", "out_features")

    def __init__(self, backend: Backend, handle, quantized: bool, out_features: int) -> None:
        self.backend, self.handle, self.quantized, self.out_features = backend, handle, quantized, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized == "w4a16":
            return self.backend.w4a16_linear(x, self.handle)
        if self.quantized == "w8a16":
            return self.backend.w8a16_linear(x, self.handle)
        return self.backend.linear(x, self.handle)


class ConcatLinear:
    """Several linears over the same input whose outputs are concatenated (when they cannot be fused)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _tensors(obj):
    """Every tensor inside ``obj``: tensors, lists/tuples, dataclasses (backend handles), linears."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, Linear):
        yield from _tensors(obj.handle)
    elif isinstance(obj, ConcatLinear):
        yield from _tensors(obj.parts)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def storage_nbytes(obj, seen: set[int] | None = None) -> int:
    """Bytes allocated for every tensor inside ``obj`` (see :func:`_tensors`), each storage counted once; storages
    already in ``seen`` (data pointers, updated) are skipped, so parts that share a table are not counted twice."""
    seen = set() if seen is None else seen
    total = 0
    for t in _tensors(obj):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class Layer:
    """Weights of one decoder layer (q/k/v and gate/up fused)."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def _positive(cfg: dict, key: str, default=None) -> int:
    """A config.json field that must be a positive integer (``default`` when absent or null)."""
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise KeyError(key)
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LiteturboError(f"config.json field {key!r} must be a positive integer, got {v!r}; the file is damaged "
                             f"or not a Llama-family config")
    return v


def _positive_number(v, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
        raise LiteturboError(f"config.json field {key!r} must be a positive number, got {v!r}")
    return float(v)


class LlamaModel:
    """Llama-family causal LM over a flat batch of tokens.

    ``forward(input_ids [T], positions [T], kv_cache, meta, logits_rows)`` → float32 logits
    ``[len(logits_rows), vocab]``. ``kv_cache`` is the backend's :class:`~backends.kv_cache.PagedKVCache`: each
    layer writes its post-rotary keys and its values there and attention reads them back from it.

    ``shard`` (a :class:`turbo.core.tp.shard.Shard`): this model holds one tensor-parallel rank's part of the
    weights (:attr:`num_heads` / :attr:`num_kv_heads` of its own; ``cfg`` stays the whole model's) and its forward
    runs the collectives of the split (the other ranks run the same step at the same time).
    """

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype, quant_method: str | None,
                 shard=None) -> None:
        self.cfg, self.backend, self.dtype, self.quant_method = cfg, backend, dtype, quant_method
        self.shard = shard
        self.num_heads = cfg.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = cfg.num_kv_heads if shard is None else shard.num_kv_heads
        self.layers: list[Layer] = []
        inv = rope_inv_freq(cfg)
        max_pos = max(cfg.max_position_embeddings, 1)
        freqs = torch.arange(max_pos, dtype=torch.int64).float().unsqueeze(1) * inv.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_sin = (emb.cos().to(backend.device), emb.sin().to(backend.device))
        self.scale = cfg.head_dim ** -0.5
        self.lm_head_dense: Linear | None = None  # see from_pretrained (lm_head_int8 with tied embeddings)

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: Path, backend: Backend, dtype: torch.dtype,
                        lm_head_int8: bool = False, shard=None, on_layer=None) -> "LlamaModel":
        """Load a 16/32-bit or W4A16 (AWQ, GPTQ, compressed-tensors) checkpoint folder, streaming it layer by layer.

        Tensors are read one at a time (:class:`~lite.formats.checkpoint.LazyStateDict`); each decoder layer's
        quantized linears are unpacked, handed to the backend (which repacks them once into its own layout on its
        device) and the host copies dropped before the next layer is read, so peak host memory stays near the
        final footprint plus one layer (``bench/load_memory.py``). Shapes, the set of layers and quantized tensors
        outside the decoder are checked against config.json from the headers before any weight is read.

        ``lm_head_int8`` runs the output projection as weight-only int8 (per output channel), as llama.cpp
        does with Q8_0 output weights; the input embedding table stays in ``dtype``. When the head is tied to that
        table, steps of ``backend.dense_lm_head_min_rows`` rows or more multiply by the table itself (faster there).
        ``shard``: keep only this tensor-parallel rank's part of every weight (:class:`turbo.core.tp.shard.Shard`;
        each projection is split before q/k/v and gate/up are fused).
        ``on_layer(i, layer)``: each decoder layer, once prepared, is handed to this callable and not kept (the
        model then has no layers: a writer of the prepared weights, :mod:`turbo.core.serving_layout`, holds one
        layer at a time).
        Raises ``LiteturboError`` on bad input (missing or misshaped tensors, layers beyond
        ``num_hidden_layers``, partly quantized fused linears, unreadable files).
        """
        # looked up at call time so that tests and bench/load_memory.py can swap the reader
        from lite.formats import LazyStateDict
        from lite.formats.checkpoint import config_mismatch

        raw = load_config(path)
        cfg = ModelConfig.from_dict(raw)
        qspec = quantization_spec(raw)
        sd = LazyStateDict(path)
        model = cls(cfg, backend, dtype, qspec.method if qspec else None, shard)
        dev = backend.device

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            """Tensor ``name`` read from the checkpoint and forgotten by the reader; ``None`` when absent and not
            ``required``, else ``LiteturboError``."""
            t = sd.pop(name, None)
            if t is None and required:
                raise LiteturboError(f"checkpoint {path} lacks tensor {name!r} (an incomplete copy or download, or a "
                                     f"config.json that does not belong to these weights)")
            return t

        def check(name: str, shape: tuple, expected: tuple, fields: str) -> None:
            """Raise ``LiteturboError`` when a tensor's shape is not what config.json implies."""
            if tuple(shape) != tuple(expected):
                raise config_mismatch(name, shape, expected, fields)

        h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        expected_out = {"q_proj": cfg.num_heads * hd, "k_proj": cfg.num_kv_heads * hd, "v_proj": cfg.num_kv_heads * hd,
                        "o_proj": h, "gate_proj": inter, "up_proj": inter, "down_proj": h}
        expected_in = {"o_proj": cfg.num_heads * hd, "down_proj": inter}
        fields = "hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size"

        _check_layout(sd, cfg, qspec, path, check)  # from the headers, before any weight is read

        def linear(prefixes: list[str], bias: bool, qlinears: dict, shapes: list[tuple] | None = None) -> Linear:
            """One (fused) linear from the named projections, shape-checked (against ``shapes``, else the dense
            Llama shapes of their short names); W4A16 if they are quantized."""
            for j, p in enumerate(prefixes):
                short = p.rsplit(".", 1)[-1]
                want = shapes[j] if shapes else (expected_out[short], expected_in.get(short, h))
                if p in qlinears:
                    check(p, (qlinears[p].out_features, qlinears[p].in_features), want, fields)
                elif f"{p}.weight" in sd:
                    check(f"{p}.weight", sd.shape(f"{p}.weight"), want, fields)
            if all(p in qlinears for p in prefixes):
                parts = [qlinears.pop(p) if shard is None else shard.quantized(p, qlinears.pop(p)) for p in prefixes]
                try:
                    qw = QuantizedWeight.concat_out(parts)
                except ValueError:  # e.g. act-order q/k/v with different g_idx: keep them apart
                    return ConcatLinear([Linear(backend, backend.prepare_w4a16(q, dtype), "w4a16", q.out_features)
                                         for q in parts])
                return Linear(backend, backend.prepare_w4a16(qw, dtype), "w4a16", qw.out_features)
            if any(p in qlinears for p in prefixes):
                raise LiteturboError(f"layers {prefixes} are partly quantized; liteturbo fuses them and needs all or none")
            wb = [(take(f"{p}.weight"), take(f"{p}.bias") if bias else None) for p in prefixes]
            if shard is not None:
                wb = [shard.dense(p, w, b) for p, (w, b) in zip(prefixes, wb)]
            w = torch.cat([w for w, _ in wb], 0)
            b = torch.cat([b for _, b in wb], 0) if all(b is not None for _, b in wb) else None
            return Linear(backend, backend.prepare_linear(w, b, dtype), None, w.shape[0])

        qk_widths = ((hd, hd) if cfg.qk_norm_per_head else (cfg.num_heads * hd, cfg.num_kv_heads * hd))

        def qk_norm(name: str, width: int) -> torch.Tensor | None:
            """A q/k RMSNorm weight, shape-checked (per head or over all heads, as the family has it)."""
            if not cfg.qk_norm:
                return None
            w = take(name)
            check(name, tuple(w.shape), (width,), "head_dim, num_attention_heads, num_key_value_heads")
            if shard is not None and not cfg.qk_norm_per_head:
                raise LiteturboError(f"tensor parallelism does not split {cfg.model_type}'s q/k norm over all heads; "
                                     f"use tp 1")
            return w.to(dev, dtype)

        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            # only this layer's tensors are read; its host copies die with these locals before the next layer
            qlinears = load_quantized_linears(sd, qspec, prefix=f"{p}.") if qspec else {}
            sparse = cfg.moe is not None and cfg.moe.sparse[i]
            if sparse:
                mlp = _read_sparse_mlp(p, qlinears, cfg, sd, take, check, linear, shard, backend, dtype)
            else:
                mlp = dict(gate_up=linear([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], cfg.mlp_bias, qlinears),
                           down=linear([f"{p}.mlp.down_proj"], cfg.mlp_bias, qlinears))
            layer = Layer(
                input_norm=take(f"{p}.input_layernorm.weight").to(dev, dtype),
                post_norm=take(f"{p}.post_attention_layernorm.weight").to(dev, dtype),
                qkv=linear([f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj"], cfg.qkv_bias,
                           qlinears),
                o=linear([f"{p}.self_attn.o_proj"], cfg.o_bias, qlinears),
                q_norm=qk_norm(f"{p}.self_attn.q_norm.weight", qk_widths[0]),
                k_norm=qk_norm(f"{p}.self_attn.k_norm.weight", qk_widths[1]),
                sparse=sparse, **mlp,
            )
            if qlinears:
                raise LiteturboError(f"quantized tensors outside the decoder linears are not supported: "
                                     f"{sorted(qlinears)[:3]}")
            unused = [k for k in sd if k.startswith(f"{p}.")]
            if unused:
                raise LiteturboError(f"decoder layer {i} holds tensors a {cfg.model_type} model with this config.json "
                                     f"does not use (e.g. {unused[0]!r}); config.json does not belong to these weights")
            if on_layer is None:
                model.layers.append(layer)
            else:
                on_layer(i, layer)
            del layer
        rows = (lambda t: t) if shard is None else shard.rows  # a rank keeps its vocabulary rows
        model.embed = rows(take("model.embed_tokens.weight")).to(dev, dtype)
        model.norm = take("model.norm.weight").to(dev, dtype)
        lm = sd.pop("lm_head.weight", None)
        tied = lm is None
        head = model.embed if tied else rows(lm).to(dev, dtype)
        del lm
        if lm_head_int8:
            model.lm_head = Linear(backend, backend.prepare_w8a16(head, dtype), "w8a16", head.shape[0])
            if tied:  # tied: many rows multiply by the embedding table itself (its storage, no copy)
                model.lm_head_dense = Linear(backend, (head, None), None, head.shape[0])
        else:
            model.lm_head = Linear(backend, (head, None), None, head.shape[0])
        return model

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; see the class docstring for shapes. No host synchronization: the caller checks positions
        against :meth:`check_positions` on the host before."""
        cfg, be = self.cfg, self.backend
        t = input_ids.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, cfg.head_dim
        q_size, kv_size = nh * hd, nkv * hd
        sh = self.shard  # tensor parallelism: the row-parallel outputs are summed over the ranks
        h = self.embed[input_ids] if sh is None else sh.embed(self.embed, input_ids, be)
        cos = self.cos_sin[0][positions].unsqueeze(1).to(self.dtype)  # [T, 1, D]
        sin = self.cos_sin[1][positions].unsqueeze(1).to(self.dtype)
        x = be.rms_norm(h, self.layers[0].input_norm, cfg.rms_norm_eps) if self.layers else h
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            q = qkv[:, :q_size].view(t, nh, hd)
            k = qkv[:, q_size:q_size + kv_size].view(t, nkv, hd)
            v = qkv[:, q_size + kv_size:].view(t, nkv, hd)
            if layer.q_norm is not None and cfg.qk_norm_per_head:
                q = be.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = be.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            elif layer.q_norm is not None:  # one norm over all heads (OLMoE)
                q = be.rms_norm(q.reshape(t, q_size), layer.q_norm, cfg.rms_norm_eps).view(t, nh, hd)
                k = be.rms_norm(k.reshape(t, kv_size), layer.k_norm, cfg.rms_norm_eps).view(t, nkv, hd)
            q = be.rotary_write(q, k, v, cos, sin, kv_cache, i, meta.slot_mapping)
            a = be.attention(q, kv_cache, i, meta, self.scale)
            o = layer.o(a.reshape(t, q_size))
            x, h = be.add_rms_norm(o if sh is None else be.all_reduce(o), h, layer.post_norm, cfg.rms_norm_eps)
            y = self.sparse_mlp(layer, x) if layer.sparse else layer.down(be.silu_and_mul(layer.gate_up(x)))
            if sh is not None:
                y = be.all_reduce(y)
            if i + 1 < len(self.layers):  # the residual add fused with the next layer's input norm
                x, h = be.add_rms_norm(y, h, self.layers[i + 1].input_norm, cfg.rms_norm_eps)
            else:
                h = h + y
        if logits_rows is not None:
            h = h[logits_rows]
        h = be.rms_norm(h, self.norm, cfg.rms_norm_eps)
        head = self.lm_head
        if self.lm_head_dense is not None and h.shape[0] >= be.dense_lm_head_min_rows:
            head = self.lm_head_dense
        logits = head(h).float()
        return logits if sh is None else sh.gather_logits(logits, be)

    def sparse_mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """A sparse layer's MLP for ``x [T, hidden]``: the backend's routing (router logits, a float32 GEMM rounded to
        ``x.dtype``; softmax in float32; the top-k experts, renormalised when the family does), their weighted sum
        through the backend's grouped experts operation, plus the shared expert scaled by ``sigmoid(shared_gate(x))``
        when there is one (transformers' ``*SparseMoeBlock``). With tensor parallelism each rank returns its part of the experts' intermediate
        features' contribution (summed by the caller's all-reduce)."""
        be, moe = self.backend, self.cfg.moe
        weights, ids = be.moe_route(x, layer.router, moe.top_k, moe.norm_topk_prob)
        y = be.experts(x, ids, weights, layer.experts)
        if layer.shared_gate_up is not None:
            shared = layer.shared_down(be.silu_and_mul(layer.shared_gate_up(x)))
            y = y + torch.sigmoid(torch.nn.functional.linear(x, layer.shared_gate)) * shared
        return y

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of every tensor the model holds, by part (the keys of :func:`turbo.core.planner.weight_breakdown`):
        ``decoder linears``, ``embeddings``, ``lm_head`` (0 when it shares the embedding table), ``norms``,
        ``rotary tables``. Counted from the tensors themselves (each storage once), so it checks the planner."""
        seen: set[int] = set()

        def size(*objs) -> int:
            """Bytes of the storages in ``objs`` not counted yet (see :func:`storage_nbytes`)."""
            return storage_nbytes(objs, seen)

        norms = [t for layer in self.layers for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)]
        return {"decoder linears": size(*[(l.qkv, l.o, l.gate_up, l.down) for l in self.layers]),
                "experts": size(*[(l.experts, l.shared_gate_up, l.shared_down) for l in self.layers if l.sparse]),
                "routers": size(*[(l.router, l.shared_gate) for l in self.layers if l.sparse]),
                "embeddings": size(self.embed), "lm_head": size(self.lm_head), "norms": size(norms, self.norm),
                "rotary tables": size(self.cos_sin)}

    def check_positions(self, max_position: int) -> None:
        """Raise ``LiteturboError`` when ``max_position`` (host int) is past the rotary table
        (``max_position_embeddings``)."""
        if max_position >= self.cos_sin[0].shape[0]:
            raise LiteturboError(f"position {max_position} exceeds max_position_embeddings="
                                 f"{self.cfg.max_position_embeddings}")


def _read_sparse_mlp(p: str, qlinears: dict, cfg: "ModelConfig", sd, take, check, linear, shard, backend,
                     dtype: torch.dtype) -> dict:
    """A sparse layer's MLP as :meth:`LlamaModel.from_pretrained` reads it (its ``take``, ``check``, ``linear``
    helpers and state dict ``sd``): the router in float32, the experts prepared together by the backend, and the
    shared expert with its gate when the family has one. Raises ``LiteturboError`` for a quantized router or gate
    and for misshaped experts."""
    dev, h = backend.device, cfg.hidden_size

    def expert_weight(prefixes: list[str], shapes: list[tuple], qlinears: dict):
        """An expert's fused projections (gate and up, or down) as one :class:`QuantizedWeight` or one dense
        tensor, shape-checked and cut to this rank's part (bias-free, as every MoE family's experts are)."""
        for p, want in zip(prefixes, shapes):
            got = ((qlinears[p].out_features, qlinears[p].in_features) if p in qlinears
                   else sd.shape(f"{p}.weight") if f"{p}.weight" in sd else None)
            if got is not None:
                check(p, got, want, "hidden_size, moe_intermediate_size / intermediate_size, "
                                    "shared_expert_intermediate_size")
        if all(p in qlinears for p in prefixes):
            parts = [qlinears.pop(p) if shard is None else shard.quantized(p, qlinears.pop(p)) for p in prefixes]
            return QuantizedWeight.concat_out(parts) if len(parts) > 1 else parts[0]
        if any(p in qlinears for p in prefixes):
            raise LiteturboError(f"layers {prefixes} are partly quantized; liteturbo fuses them and needs all or none")
        ws = [take(f"{p}.weight") for p in prefixes]
        if shard is not None:
            ws = [shard.dense(p, w, None)[0] for p, w in zip(prefixes, ws)]
        return torch.cat(ws, 0) if len(ws) > 1 else ws[0]

    moe = cfg.moe
    inter = moe.intermediate_size
    router_name = f"{p}.{moe.router}.weight"
    if f"{p}.{moe.router}" in qlinears:
        raise LiteturboError(f"{p}.{moe.router} (the MoE router) is quantized in this checkpoint; liteturbo "
                             f"keeps routers 16-bit: re-quantize with the router left out")
    if router_name in sd:
        check(router_name, sd.shape(router_name), (moe.num_experts, h), "num_experts, hidden_size")
    gate_up, down = [], []
    for e in range(moe.num_experts):
        g, u, d = (f"{p}.{n}" for n in moe.expert(e))
        gate_up.append(expert_weight([g, u], [(inter, h), (inter, h)], qlinears))
        down.append(expert_weight([d], [(h, inter)], qlinears))
    # the router in float32 (its logits are rounded to the compute dtype, as a 16-bit GEMM would give them):
    # a [num_experts, hidden] GEMV in bf16 costs ~60 us a call on CPUs, in float32 a few
    out = dict(router=take(router_name).to(dev, torch.float32),
               experts=backend.prepare_experts(gate_up, down, dtype),
               shared_gate_up=None, shared_down=None, shared_gate=None, gate_up=None, down=None)
    del gate_up, down
    if moe.shared:
        g, u, d = (f"{p}.{n}" for n in moe.shared)
        width = moe.shared_intermediate_size
        out.update(shared_gate_up=linear([g, u], False, qlinears, [(width, h), (width, h)]),
                   shared_down=linear([d], False, qlinears, [(h, width)]))
        gate_name = f"{p}.{moe.shared_gate}.weight"
        if f"{p}.{moe.shared_gate}" in qlinears:
            raise LiteturboError(f"{p}.{moe.shared_gate} (the shared expert's gate) is quantized in this "
                                 f"checkpoint; liteturbo keeps it 16-bit")
        if gate_name in sd:
            check(gate_name, sd.shape(gate_name), (1, h), "hidden_size")
        out["shared_gate"] = take(gate_name).to(dev, dtype)
    return out


def _check_layout(sd, cfg: ModelConfig, qspec, path: Path, check) -> None:
    """Checks of a checkpoint that need only its headers (before any weight is read): the decoder layers present
    match config.json, no quantized tensor outside the decoder linears, embedding and lm_head shapes. Raises
    ``LiteturboError``."""
    from lite.formats import quantized_prefixes

    extra_layers = sorted({k.split(".")[2] for k in sd if k.startswith("model.layers.")}
                          - {str(i) for i in range(cfg.num_layers)}, key=lambda s: (len(s), s))
    if extra_layers:
        raise LiteturboError(f"the weights hold decoder layers beyond num_hidden_layers={cfg.num_layers} in "
                             f"config.json (e.g. layer {extra_layers[0]}); config.json does not belong to these "
                             f"weights")
    held = {int(k.split(".")[2]) for k in sd if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    missing = [i for i in range(cfg.num_layers) if i not in held]
    if missing:
        raise LiteturboError(f"config.json says num_hidden_layers={cfg.num_layers} but the weights hold no tensor "
                             f"of decoder layer {missing[0]} ({len(held)} layers found); a shard is missing or "
                             f"config.json does not belong to these weights")
    if qspec:
        outside = sorted(p for p in quantized_prefixes(sd, qspec) if not p.startswith("model.layers."))
        if outside:
            raise LiteturboError(f"quantized tensors outside the decoder linears are not supported: {outside[:3]}")
    embed_name = "model.embed_tokens.weight"
    if embed_name not in sd:
        raise LiteturboError(f"checkpoint {path} lacks tensor {embed_name!r}")
    h = cfg.hidden_size
    check(embed_name, sd.shape(embed_name), (cfg.vocab_size, h), "vocab_size, hidden_size")
    if "lm_head.weight" in sd:
        check("lm_head.weight", sd.shape("lm_head.weight"), (cfg.vocab_size, h), "vocab_size, hidden_size")
    elif not cfg.tie_word_embeddings:
        raise LiteturboError(f"checkpoint {path} lacks lm_head.weight and does not tie word embeddings")
