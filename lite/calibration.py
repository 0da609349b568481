"""Calibration samples: token windows drawn from a bundled dataset or a local file.

The documents are shuffled with ``seed``, tokenized, joined with the tokenizer's EOS between them and cut
into windows of ``seqlen`` tokens until ``n_samples`` windows exist; the last window may be shorter (it is
used, not dropped). Short documents therefore all count, and a long document spans several windows.
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path

import torch

import calib_data

from .formats import LiteturboError

DEFAULT_CALIB_DATASET = "c4"
DEFAULT_CALIB_SAMPLES = 128
DEFAULT_CALIB_SEQLEN = 512


def load_texts(dataset: str) -> list[str]:
    """Documents of a bundled dataset name or a local .txt/.jsonl/.json/.parquet file or ``datasets`` folder.

    Local files are read through ``datasets`` (a ``text`` column is required for jsonl/parquet; a .txt file
    gives one document per blank-line-separated paragraph). Raises ``LiteturboError`` when unreadable.
    """
    if dataset in calib_data.DATASETS:
        return [t for t in calib_data.load_rows(dataset) if t.strip()]
    path = Path(dataset).expanduser()
    if not path.exists():
        raise LiteturboError(f"--calib-dataset {dataset!r} is neither a bundled dataset "
                             f"({', '.join(calib_data.available())}) nor an existing file or folder")
    import datasets

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[next(iter(ds))]
        elif path.suffix == ".txt":
            raw = path.read_text(encoding="utf-8")
            return [p for p in raw.split("\n\n") if p.strip()]
        elif path.suffix in (".jsonl", ".json"):
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        elif path.suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        else:
            raise LiteturboError(f"--calib-dataset {path}: unsupported file type {path.suffix!r} "
                                 f"(use .txt, .jsonl, .json, .parquet or a folder saved with datasets)")
    except LiteturboError:
        raise
    except Exception as e:  # datasets raises many types for malformed files
        raise LiteturboError(f"cannot read --calib-dataset {path}: {e}") from e
    if "text" not in ds.column_names:
        raise LiteturboError(f"--calib-dataset {path} has columns {ds.column_names}; a 'text' column is needed")
    texts = [t for t in ds["text"] if isinstance(t, str) and t.strip()]
    if not texts:
        raise LiteturboError(f"--calib-dataset {path} contains no non-empty text")
    return texts


def check_calib_seqlen(config: dict, seqlen: int) -> None:
    """Refuse (``LiteturboError``) calibration windows longer than the model's context, before any work."""
    max_pos = config.get("max_position_embeddings")
    if isinstance(max_pos, int) and seqlen > max_pos:
        raise LiteturboError(f"--calib-seqlen {seqlen} exceeds the model's context (max_position_embeddings="
                             f"{max_pos}); use at most {max_pos} (512, the default, is the usual choice)")


def calibration_samples(tokenizer, dataset: str = DEFAULT_CALIB_DATASET, n_samples: int = DEFAULT_CALIB_SAMPLES,
                        seqlen: int = DEFAULT_CALIB_SEQLEN, seed: int = 42) -> list[torch.Tensor]:
    """``n_samples`` int64 token tensors ``[1, L]`` with ``L <= seqlen`` (see module docstring).

    Raises ``LiteturboError`` for non-positive sizes.
    """
    if n_samples <= 0 or seqlen <= 0:
        raise LiteturboError(f"--calib-samples and --calib-seqlen must be positive, got {n_samples}, {seqlen}")
    texts = load_texts(dataset)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    need = n_samples * seqlen
    stream: list[int] = []
    for i in order:
        stream += tokenizer(texts[i], add_special_tokens=False)["input_ids"] + sep
        if len(stream) >= need:
            break
    stream = stream[:need]
    if not stream:
        raise LiteturboError(f"--calib-dataset {dataset} produced no tokens")
    if len(stream) < need:
        warnings.warn(f"--calib-dataset {dataset} has only {len(stream)} tokens: {-(-len(stream) // seqlen)} "
                      f"windows instead of {n_samples} x {seqlen}; all of it is used")
    return [torch.tensor([stream[i:i + seqlen]], dtype=torch.long) for i in range(0, len(stream), seqlen)]
