"""Bundled calibration and evaluation text, and the registry of dataset names.

| name | content | license |
| --- | --- | --- |
| ``wikitext2`` | WikiText-2 raw (Merity et al. 2016): ``valid`` split for calibration, ``test`` for perplexity | CC BY-SA 3.0 |
| ``c4`` | first 1,000 documents of ``allenai/c4`` ``en`` train shard 00000 | ODC-BY 1.0 |
| ``zh`` | 848 Chinese Wikipedia paragraphs from CMRC 2018 dev (Cui et al. 2019): the first 424 (``eval``) for perplexity, the other 424 (``calib``) for calibration; ``dev`` is all | CC BY-SA 4.0 |

Sources, checksums and attribution: ``calib_data/SOURCES.md``. Nothing is downloaded.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATASETS = {
    "wikitext2": {"test": "wikitext2_test.raw.gz", "valid": "wikitext2_valid.raw.gz"},
    "c4": {"train": "c4_en_first1000.jsonl.gz"},
    "zh": {"dev": "zh_cmrc2018_contexts.jsonl.gz", "eval": "zh_cmrc2018_contexts.jsonl.gz",
           "calib": "zh_cmrc2018_contexts.jsonl.gz"},
}
# lite's default calibration mixture (lite.calibration): three parts English web text to one part Chinese
DEFAULT_MIXTURE = "c4:3,zh:1"
DEFAULT_SPLIT = {"wikitext2": "valid", "c4": "train", "zh": "calib"}
# splits that are a slice of their file's rows (the Chinese file has one text for evaluation, one for calibration)
ROW_SLICES = {("zh", "eval"): slice(0, 424), ("zh", "calib"): slice(424, None)}


def available() -> list[str]:
    """Names of the bundled datasets."""
    return sorted(DATASETS)


def load_rows(name: str, split: str | None = None) -> list[str]:
    """Text rows of a bundled dataset.

    WikiText-2 rows are the file's lines as Hugging Face's ``wikitext-2-raw-v1`` loader yields them: each keeps
    its trailing newline, blank lines become ``""``. JSONL datasets give their ``text`` fields.
    Raises ``ValueError`` naming the available datasets/splits.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; bundled: {', '.join(available())} (or pass a file path)")
    split = split or DEFAULT_SPLIT[name]
    if split not in DATASETS[name]:
        raise ValueError(f"dataset {name!r} has splits {sorted(DATASETS[name])}, not {split!r}")
    with gzip.open(HERE / DATASETS[name][split], "rt", encoding="utf-8", newline="") as f:
        if name == "wikitext2":
            return ["" if not line.strip() else line for line in f]
        rows = [json.loads(line)["text"] for line in f if line.strip()]
    return rows[ROW_SLICES.get((name, split), slice(None))]


# evaluation texts of ``liteturbo lite eval-ppl --dataset``: (dataset, split); rows joined with "\n\n"
EVAL_SETS = {"wikitext2": ("wikitext2", "test"), "wikitext2-valid": ("wikitext2", "valid"), "zh": ("zh", "eval")}


def eval_text(name: str) -> str:
    """The perplexity text called ``name`` (:data:`EVAL_SETS`): its rows joined with ``"\n\n"``. ``wikitext2`` is
    the standard WikiText-2 test text; ``wikitext2-valid`` and ``zh`` are second evaluation sets for runs that did not
    calibrate on them. Raises ``ValueError`` naming the known sets."""
    if name not in EVAL_SETS:
        raise ValueError(f"unknown evaluation set {name!r}; known: {', '.join(EVAL_SETS)}")
    return "\n\n".join(load_rows(*EVAL_SETS[name]))


def wikitext2_test_text() -> str:
    """The standard WikiText-2 perplexity text: test rows joined with ``"\\n\\n"`` (GPTQ/AWQ protocol)."""
    return "\n\n".join(load_rows("wikitext2", "test"))
