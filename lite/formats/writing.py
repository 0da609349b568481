"""Writing a checkpoint folder: refuse a target whose replacement would destroy data, write into a temporary
sibling folder renamed into place at the end (a failed run never leaves a half-written checkpoint), JSON files, and a
safetensors file written tensor by tensor (:func:`write_safetensors_streamed`: memory bounded by the largest tensor)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch

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


SAFETENSORS_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
SAFETENSORS_DTYPES = {v: k for k, v in SAFETENSORS_DTYPE_NAMES.items()}  # "BF16" -> torch.bfloat16


PAD_PREFIX = "__pad__."  # the names of the filler tensors that align the others (``align`` > 8)


def write_safetensors_streamed(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                               read: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
                               align: int = 8) -> int:
    """Write one safetensors file tensor by tensor, so that at most one tensor is in memory at a time.

    ``specs``: (name, dtype, shape) of every tensor, in file order; ``read(name)`` returns that tensor (CPU, the
    given dtype and shape), called once per name, after the header is written. The layout is the published
    safetensors format (8-byte little-endian header length, a JSON header padded with spaces, then the tensors'
    bytes, C order, little-endian), the same bytes as ``safetensors.torch.save_file`` up to tensor order when
    ``align`` is 8. ``align`` (a multiple of 8): every tensor starts at a multiple of ``align`` bytes from the
    file's start (the header is padded with spaces and uint8 tensors named ``__pad__.<i>`` fill the gaps, so the
    file stays a valid safetensors file with no holes); a mapped tensor's address is then aligned too, as vector
    loads want. Returns the file size in bytes. Raises ``LiteturboError`` when a tensor read does not match its
    spec, ``ValueError`` for an ``align`` that is not a positive multiple of 8."""
    if align < 8 or align % 8:
        raise ValueError(f"align must be a positive multiple of 8 bytes, got {align}")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    order: list[tuple[str, torch.dtype, tuple[int, ...]] | int] = []  # an int: that many zero bytes of padding
    offset = 0
    for name, dtype, shape in specs:
        if name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name {name!r} is reserved for padding ({PAD_PREFIX}*)")
        if offset % align:
            gap = align - offset % align
            header[f"{PAD_PREFIX}{len(order)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append(gap)
            offset += gap
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        order.append((name, dtype, shape))
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % align)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for item in order:
            if isinstance(item, int):
                f.write(bytes(item))
                continue
            name, dtype, shape = item
            t = read(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise LiteturboError(f"tensor {name} came out {t.dtype} {tuple(t.shape)}, expected {dtype} "
                                     f"{tuple(shape)}; the partial-run folder is damaged: delete it and start again")
            if t.numel():  # the tensor's own bytes through the buffer protocol, no second copy
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
        size = f.tell()
    return size
