"""Hugging Face checkpoint folders: resolve a model name, read config and weights, copy tokenizer files.

A checkpoint folder holds ``config.json``, ``*.safetensors`` weights (one file or an index with shards) and
tokenizer files. Weights are read whole (:func:`load_state_dict`) or one tensor at a time on demand
(:class:`LazyStateDict`, which the engine's loader streams layer by layer). Writing goes through
:mod:`lite.formats.writing`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch

from .embedded import EMBEDDED_MODELS, ensure_embedded
from .errors import LiteturboError
from .kv import KV_PARAMS_FILE

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def resolve_model(name_or_path: str | os.PathLike | None) -> Path:
    """A model name or folder → path of a Hugging Face checkpoint folder.

    ``None`` and ``"smollm2-135m-instruct"`` give the embedded default model, converted once from its GGUF
    file into the cache folder. Raises ``LiteturboError`` for a path that is not a checkpoint.
    """
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
    except UnicodeDecodeError as e:
        raise LiteturboError(f"{path / 'config.json'} is not UTF-8 text ({e.reason} at byte {e.start}); re-export "
                             f"the checkpoint") from e
    if not isinstance(cfg, dict):
        raise LiteturboError(f"{path / 'config.json'} must hold a JSON object")
    return cfg


def weight_files(path: Path) -> list[Path]:
    """The safetensors weight files of a checkpoint, shards in index order (calibrated KV parameters, which
    live beside the weights in their own safetensors file, are not weights)."""
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


def _safetensors_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype names → torch dtypes (those this torch has)."""
    names = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
             "U16": "uint16", "I16": "int16", "F16": "float16", "BF16": "bfloat16", "U32": "uint32", "I32": "int32",
             "F32": "float32", "U64": "uint64", "I64": "int64", "F64": "float64"}
    return {k: getattr(torch, v) for k, v in names.items() if hasattr(torch, v)}


class LazyStateDict:
    """The tensors of a checkpoint folder, read from disk one at a time when asked for.

    Construction validates each file of :func:`weight_files` with safetensors' ``safe_open`` and keeps only its
    header index (name → file, dtype, shape, byte range). ``pop(name)`` / ``get(name)`` / ``self[name]`` read that
    one tensor with plain file reads into a fresh torch-allocated CPU tensor in its stored dtype: no memory map
    stays behind, dropping the tensor gives its bytes back, and the buffer has torch's alignment, so the numbers
    a CPU GEMM computes from it do not depend on where the tensor sits in the file (they do for ``load_file``'s
    mapped tensors). ``pop`` also forgets the name, so ``keys()`` lists what has not been consumed yet. ``shape``
    and ``nbytes`` answer from the header without reading. Iteration, ``in`` and ``len`` work as for a dict; a
    name present in several shards is read from the last one, as :func:`load_state_dict` does.

    Raises ``LiteturboError`` for a listed shard that is missing, a file that cannot be read or a dtype this torch
    lacks; ``KeyError`` from ``self[name]`` / ``pop(name)`` for an unknown name (``get`` / ``pop(name, default)``
    return the default).
    """

    _MISSING = object()

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        # name -> (file, torch dtype, shape, absolute byte offset, byte count)
        self._where: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        dtypes = _safetensors_dtypes()
        for f in weight_files(self.path):
            if not f.is_file():
                raise LiteturboError(f"weight shard {f} listed in the index is missing")
            try:
                with safe_open(str(f), "pt") as h:  # validates the header and the byte ranges
                    names = list(h.keys())
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n))
            except Exception as e:  # SafetensorError, OSError, ValueError
                raise LiteturboError(f"cannot read {f}: {e}; the file is damaged or not safetensors") from e
            for k in names:
                info = header[k]
                if info["dtype"] not in dtypes:
                    raise LiteturboError(f"{f}: tensor {k!r} has dtype {info['dtype']}, which this torch cannot hold")
                start, end = info["data_offsets"]
                self._where[k] = (f, dtypes[info["dtype"]], tuple(info["shape"]), 8 + n + start, end - start)

    def keys(self) -> list[str]:
        """Names not yet popped, in file order."""
        return list(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` from the header (nothing is read). Raises ``KeyError``."""
        return self._where[name][2]

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` from the header (nothing is read). Raises ``KeyError``."""
        return self._where[name][1]

    def nbytes(self, name: str) -> int:
        """Bytes ``name`` takes on disk and once read (from the header). Raises ``KeyError``."""
        return self._where[name][4]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read(name)

    def get(self, name: str, default=None):
        """The tensor ``name`` read now, or ``default`` if the checkpoint lacks it."""
        return self._read(name) if name in self._where else default

    def pop(self, name: str, default=_MISSING):
        """Read ``name`` and forget it; ``default`` (or ``KeyError`` without one) if the checkpoint lacks it."""
        if name not in self._where:
            if default is LazyStateDict._MISSING:
                raise KeyError(name)
            return default
        t = self._read(name)
        del self._where[name]
        return t

    def _read(self, name: str) -> torch.Tensor:
        f, dtype, shape, offset, size = self._where[name]  # KeyError for an unknown name
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        try:
            with open(f, "rb", buffering=0) as fh:
                fh.seek(offset)
                done = 0
                while done < size:  # one read() returns at most ~2 GiB on Linux
                    got = fh.readinto(view[done:])
                    if not got:
                        raise OSError(f"the file ends {size - done} bytes early")
                    done += got
        except OSError as e:
            raise LiteturboError(f"cannot read tensor {name!r} from {f}: {e}; the file is damaged or changed "
                                 f"while loading") from e
        return buf.view(dtype).view(shape)


SHAPE_FIELDS = "hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size"


def config_mismatch(name: str, shape: tuple, expected: tuple, fields: str = SHAPE_FIELDS) -> LiteturboError:
    """The error for a tensor whose shape is not what config.json implies (one message for ``lite`` and ``turbo``)."""
    return LiteturboError(f"{name} has shape {tuple(shape)} but config.json ({fields}) implies {tuple(expected)}; "
                          f"config.json does not belong to these weights")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy the tokenizer and generation-config files that exist in ``src``."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
