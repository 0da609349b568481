"""Writing a checkpoint folder: refuse a target whose replacement would destroy data, write into a temporary
sibling folder renamed into place at the end (a failed run never leaves a half-written checkpoint), JSON files."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import LiteturboError


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
