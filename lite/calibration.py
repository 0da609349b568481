"""Calibration samples: token windows drawn from a bundled dataset, a local file, or a weighted mixture of them.

A dataset's documents are shuffled with ``seed``, tokenized, joined with the tokenizer's EOS between them and cut
into windows of ``seqlen`` tokens until its windows exist; the last window may be shorter (it is used, not
dropped). Short documents therefore all count, and a long document spans several windows.

A mixture, ``NAME[:WEIGHT],NAME[:WEIGHT],...`` (weights default to 1), gives each dataset its share of the
``n_samples`` windows (largest remainder, at least one each: fewer windows than datasets is refused) and shuffles
the windows together with ``seed``, so the first windows (the loss tokens of AWQ's searches and of tuning) mix the
languages too. The default,
``c4:3,zh:1``, is three parts English web text to one part Chinese Wikipedia (its calibration half: the other half
is the ``zh`` evaluation text, see :mod:`calib_data`): calibrating on English alone made GPTQ's rounding worse than
RTN on Chinese.
"""
from __future__ import annotations

import math
import random
import warnings
from pathlib import Path

import torch

import calib_data

from .formats import LiteturboError

DEFAULT_CALIB_DATASET = calib_data.DEFAULT_MIXTURE
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


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """``--calib-dataset``'s value as ``[(name or path, weight)]``: comma-separated ``NAME[:WEIGHT]`` items (a
    ``:suffix`` that is not a number belongs to the name; spaces around ``,`` and ``:`` are dropped). Raises
    ``LiteturboError`` for an empty item, an item with no name before ``:``, a weight that is not a positive finite
    number, or a dataset named twice."""
    if not isinstance(spec, str) or not spec.strip():
        raise LiteturboError("--calib-dataset is empty: give a bundled name (c4, wikitext2, zh), a file, or a mixture "
                             "such as c4:3,zh:1")
    parts: list[tuple[str, float]] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            raise LiteturboError(f"--calib-dataset {spec!r} has an empty item; write NAME[:WEIGHT],NAME[:WEIGHT]")
        name, weight = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep and not head.strip():
            raise LiteturboError(f"--calib-dataset {item!r} has no dataset name before ':'; write NAME:WEIGHT, e.g. "
                                 f"c4:3")
        try:
            w = float(tail) if sep and head else None
        except ValueError:
            w = None
        if w is not None:
            if not (math.isfinite(w) and w > 0):
                raise LiteturboError(f"--calib-dataset {item!r}: a weight must be a positive number, got {tail!r}")
            name, weight = head.strip(), w
        if name in (n for n, _ in parts):
            raise LiteturboError(f"--calib-dataset {spec!r} names {name!r} twice; give each dataset once with its "
                                 f"weight")
        parts.append((name, weight))
    return parts


def check_calib_dataset(spec: str, n_samples: int | None = None) -> None:
    """Refuse (``LiteturboError``) a ``--calib-dataset`` that does not parse, names neither a bundled dataset nor an
    existing path, or (given ``n_samples``) has more datasets than windows, before any work."""
    parts = parse_mixture(spec)
    for name, _ in parts:
        if name not in calib_data.DATASETS and not Path(name).expanduser().exists():
            hint = (" (a ':WEIGHT' suffix must be a positive number, e.g. c4:3; names are lower case)"
                    if ":" in name or name.lower() in calib_data.DATASETS else "")
            raise LiteturboError(f"--calib-dataset {name!r} is neither a bundled dataset "
                                 f"({', '.join(calib_data.available())}) nor an existing file or folder{hint}")
    if n_samples is not None:
        mixture_counts([w for _, w in parts], n_samples)


def mixture_counts(weights: list[float], n: int) -> list[int]:
    """``n`` windows shared in proportion to ``weights`` (largest remainder), at least one each. Raises
    ``LiteturboError`` when ``n`` is smaller than the number of datasets (one would get no window)."""
    if n < len(weights):
        raise LiteturboError(f"--calib-samples {n} is fewer than the {len(weights)} datasets of the --calib-dataset "
                             f"mixture, and each needs at least one window: raise --calib-samples to at least "
                             f"{len(weights)} or drop datasets")
    total = sum(weights)
    exact = [1 + (n - len(weights)) * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])[:n - sum(counts)]:
        counts[i] += 1
    return counts


def calibration_samples(tokenizer, dataset: str = DEFAULT_CALIB_DATASET, n_samples: int = DEFAULT_CALIB_SAMPLES,
                        seqlen: int = DEFAULT_CALIB_SEQLEN, seed: int = 42) -> list[torch.Tensor]:
    """``n_samples`` int64 token tensors ``[1, L]`` with ``L <= seqlen`` from ``dataset`` (a name, a path or a
    mixture, see the module docstring).

    Raises ``LiteturboError`` for non-positive sizes or a bad dataset.
    """
    if n_samples <= 0 or seqlen <= 0:
        raise LiteturboError(f"--calib-samples and --calib-seqlen must be positive, got {n_samples}, {seqlen}")
    parts = parse_mixture(dataset)
    if len(parts) == 1:
        return _windows(tokenizer, parts[0][0], n_samples, seqlen, seed)
    out = []
    for (name, _), k in zip(parts, mixture_counts([w for _, w in parts], n_samples)):
        out += _windows(tokenizer, name, k, seqlen, seed) if k else []
    random.Random(seed).shuffle(out)
    return out


def _windows(tokenizer, dataset: str, n_samples: int, seqlen: int, seed: int) -> list[torch.Tensor]:
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
                      f"window(s) instead of {n_samples} x {seqlen}; all of it is used")
    return [torch.tensor([stream[i:i + seqlen]], dtype=torch.long) for i in range(0, len(stream), seqlen)]
