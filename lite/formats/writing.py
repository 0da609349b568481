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


def check_writable_parent(path: Path, what: str) -> None:
    """Refuse (``LiteturboError`` naming ``what``, e.g. ``--work-dir``) a ``path`` whose folder cannot be created or
    written: the nearest existing ancestor must be a writable folder. Checked before any work is done."""
    parent = Path(path).expanduser().absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise LiteturboError(f"cannot create {what} {path}: {parent} is a file, not a folder; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LiteturboError(f"cannot create {what} {path}: {parent} is not writable; choose a folder you can write")


def make_dirs(path: Path, what: str) -> None:
    """``path.mkdir(parents=True, exist_ok=True)``, an ``OSError`` turned into ``LiteturboError`` naming ``what``."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LiteturboError(f"cannot create {what} {path} ({e.strerror or e}); choose another path") from None


def check_output_dir(target: Path, overwrite: bool, source: Path | None = None) -> Path:
    """Validate an output checkpoint folder before any work; returns it absolute.

    Refuses (``LiteturboError``) a folder that exists without ``overwrite``, and even with ``overwrite`` one that
    is or contains the source checkpoint, the current/home/root folder, or a non-empty folder that is not a
    checkpoint (no config.json): replacing those would destroy data; and one that cannot be created (under a file,
    or a folder not writable).
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
    check_writable_parent(target, "--work-dir")
    return target


@contextlib.contextmanager
def atomic_output_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``target``; on success it becomes ``target`` in one rename.

    On any exception the temporary folder is removed and ``target`` is untouched. Raises
    ``LiteturboError`` if ``target`` exists and ``overwrite`` is false.
    """
    target = check_output_dir(target, overwrite)
    make_dirs(target.parent, "the folder of --work-dir")
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
