"""Hugging Face checkpoint folders: resolve a model name, read config and weights, write atomically.

A checkpoint folder holds ``config.json``, ``*.safetensors`` weights (one file or an index with shards) and
tokenizer files. Writing goes to a temporary sibling folder renamed into place at the end, so a failed
run never leaves a half-written checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from .errors import LiteturboError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def liteturbo_home() -> Path:
    """Cache folder: ``$LITETURBO_HOME``, default ``~/.cache/liteturbo``."""
    return Path(os.environ.get("LITETURBO_HOME", Path.home() / ".cache" / "liteturbo"))


def resolve_model(name_or_path: str | os.PathLike | None) -> Path:
    """A model name or folder → path of a Hugging Face checkpoint folder.

    ``None`` and ``"smollm2-135m-instruct"`` give the embedded default model, converted once from its GGUF
    file into the cache folder. Raises ``LiteturboError`` for a path that is not a checkpoint.
    """
    from .embedded import EMBEDDED_MODELS, ensure_embedded

    if name_or_path is None:
        name_or_path = "smollm2-135m-instruct"
    key = str(name_or_path)
    if key.lower() in EMBEDDED_MODELS and not Path(key).exists():
        return ensure_embedded(key.lower())
    path = Path(key).expanduser()
    check_checkpoint_dir(path)
    return path


def check_checkpoint_dir(path: Path) -> None:
    """Raise ``LiteturboError`` unless ``path`` looks like a Hugging Face checkpoint folder."""
    from .embedded import EMBEDDED_MODELS

    if not path.exists():
        raise LiteturboError(
            f"{str(path)!r} does not exist: pass a Hugging Face checkpoint folder (with config.json and "
            f"*.safetensors) or one of the embedded model names: {', '.join(EMBEDDED_MODELS)}"
        )
    if not path.is_dir():
        raise LiteturboError(f"{str(path)!r} is a file, not a checkpoint folder: pass the folder that holds "
                             f"config.json and the *.safetensors weights")
    if not (path / "config.json").is_file():
        raise LiteturboError(f"{str(path)!r} is not a Hugging Face checkpoint: config.json is missing")
    if not weight_files(path):
        extra = " (only PyTorch .bin weights were found; re-save with safe_serialization=True)" if list(
            path.glob("*.bin")) else ""
        raise LiteturboError(f"{str(path)!r} has no *.safetensors weights{extra}")


def load_config(path: Path) -> dict:
    """config.json as a dict. Raises ``LiteturboError`` if it is not valid JSON."""
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise LiteturboError(f"{path / 'config.json'} is not valid JSON ({e}); re-export the checkpoint") from e
    if not isinstance(cfg, dict):
        raise LiteturboError(f"{path / 'config.json'} must hold a JSON object")
    return cfg


def weight_files(path: Path) -> list[Path]:
    """The safetensors weight files of a checkpoint, shards in index order (calibrated KV parameters, which
    live beside the weights in their own safetensors file, are not weights)."""
    from .kv import KV_PARAMS_FILE

    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [path / n for n in names]
    return sorted(p for p in path.glob("*.safetensors") if p.name != KV_PARAMS_FILE)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint on CPU. Raises ``LiteturboError`` for unreadable files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        if not f.is_file():
            raise LiteturboError(f"weight shard {f} listed in the index is missing")
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise LiteturboError(f"cannot read {f}: {e}; the file is damaged or not safetensors") from e
    return out


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer and generation-config files that exist in ``src``."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def check_output_dir(target: Path, overwrite: bool, source: Path | None = None) -> Path:
    """Validate an output checkpoint folder before any work; returns it absolute.

    Refuses (``LiteturboError``) a folder that exists without ``overwrite``, and even with ``overwrite`` one that
    is or contains the source checkpoint, the current/home/root folder, or a non-empty folder that is not a
    checkpoint (no config.json): replacing those would destroy data.
    """
    target = Path(target).expanduser().absolute()
    if str(target).strip() == "" or target == Path.cwd() or target == Path.home() or target == Path(target.anchor):
        raise LiteturboError(f"refusing to write a checkpoint over {target}; give --work-dir a new folder name")
    if source is not None:
        src = Path(source).expanduser().resolve()
        t = target.resolve()
        if t == src or t in src.parents:
            raise LiteturboError(f"--work-dir {target} is or contains the input checkpoint {src}; choose another folder")
    if target.exists():
        non_empty = not target.is_dir() or any(target.iterdir())
        if non_empty and not overwrite:
            raise LiteturboError(f"{target} already exists; choose another --work-dir or pass --overwrite")
        if non_empty and not (target / "config.json").is_file():
            raise LiteturboError(f"{target} exists and is not a checkpoint folder (no config.json); refusing to "
                                 f"replace it even with --overwrite: choose another --work-dir")
    return target


@contextlib.contextmanager
def atomic_output_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``target``; on success it becomes ``target`` in one rename.

    On any exception the temporary folder is removed and ``target`` is untouched. Raises
    ``LiteturboError`` if ``target`` exists and ``overwrite`` is false.
    """
    target = check_output_dir(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, 0o644)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
