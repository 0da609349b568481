"""The serving layout: a checkpoint's weights exactly as a backend holds them once loaded (4-bit codes repacked into
the CPU kernels' tiles, q/k/v and gate/up fused, the int8 output head), saved once beside the checkpoint and mapped
at every later load instead of being read, unpacked, fused and repacked again (as llama.cpp maps a GGUF).

Where: ``<checkpoint>/serving/<key>/``, ``key`` a hash of the backend's
:meth:`~backends.base.Backend.serving_layout_id` for the compute dtype and of the output head's kind. In it, one
safetensors file per decoder layer (``layer-NNN.safetensors``) and ``head.safetensors`` (embeddings, final norm,
output head), every tensor 64-byte aligned (:func:`lite.formats.writing.write_safetensors_streamed`), and
``layout.json``: the format version, the id, each file's objects as JSON (linears, backend handles, tensors by
name), the size and modification time of config.json and of every weight file it was made from and of every layout
file, and a digest of its own content. It is written into a temporary sibling folder (``.<key>.tmp-<pid>-*``; one
left by a killed writer is removed by the next save), renamed when complete; a folder without a matching
``layout.json`` is never read, and one whose files or ``layout.json`` changed since is ignored with a warning.

Written by ``liteturbo lite ...`` after quantizing and by ``liteturbo pack`` (:func:`save`: one decoder layer in
memory at a time). Read by the engine's start-up (:func:`load`) for a whole model (no tensor parallelism) when the
id, the version and the fingerprint all match, else the checkpoint is loaded as usual. The mapped weights are
paged in during the load (``madvise(MADV_POPULATE_READ)``), so a load reads every weight once, as the usual one
does, instead of leaving page faults to the first steps. Resident mapped pages count as the process's file-backed
RSS, the same bytes the planner counts as weights.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import torch

from backends import Backend
from lite.formats import LiteturboError, load_config, quantization_spec
from lite.formats.checkpoint import weight_files
from lite.formats.writing import PAD_PREFIX, write_json, write_safetensors_streamed

from .model import ConcatLinear, Layer, Linear, LlamaModel, ModelConfig

log = logging.getLogger(__name__)

VERSION = 2  # 2: layout.json carries each layout file's size and mtime and a digest of itself
FOLDER = "serving"
ALIGN = 64  # bytes: one cache line, the AVX-512 vector the CPU kernels load
_MADV_POPULATE_READ = 22  # Linux >= 5.14


def layout_key(backend: Backend, dtype: torch.dtype, lm_head_int8: bool) -> str | None:
    """What the saved layout must match: the backend's layout id for ``dtype`` plus the head's kind; ``None`` when
    the backend cannot save its prepared weights."""
    lid = backend.serving_layout_id(dtype)
    return None if lid is None else f"{lid}:head={'int8' if lm_head_int8 else 'dense'}"


def layout_dir(path: Path, key: str) -> Path:
    """The folder of the layout ``key`` inside checkpoint folder ``path``."""
    return Path(path) / FOLDER / hashlib.sha256(key.encode()).hexdigest()[:16]


def fingerprint(path: Path) -> dict[str, list[int]]:
    """Size and modification time (ns) of config.json and every weight file of the checkpoint at ``path``."""
    return _stats([Path(path) / "config.json", *weight_files(Path(path))])


def _stats(files) -> dict[str, list[int]]:
    out = {}
    for f in files:
        st = f.stat()
        out[f.name] = [st.st_size, st.st_mtime_ns]
    return out


def _digest(meta: dict) -> str:
    """A hash of layout.json's content (all but the digest itself): a hand-edited layout does not match it."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _clean_abandoned(parent: Path) -> None:
    """Remove temporary layout folders whose writer is gone (a pack that was killed): ``.<key>.tmp-<pid>-*``."""
    for d in parent.glob(".*.tmp-*"):
        try:
            pid = int(d.name.split(".tmp-", 1)[1].split("-", 1)[0])
            os.kill(pid, 0)  # raises when no such process runs
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue  # not ours, or a live writer


class _Unsupported(Exception):
    """A prepared weight the layout cannot describe (a handle type the backend does not list)."""


class _Encoder:
    """Turns a layer's objects into JSON plus named tensors (each tensor once, however often it is referenced)."""

    def __init__(self, types: tuple[type, ...]) -> None:
        self.types = {t.__name__: t for t in types}
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[tuple, str] = {}

    def __call__(self, obj, name: str):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"v": obj}
        if isinstance(obj, torch.Tensor):
            key = (obj.data_ptr(), obj.dtype, tuple(obj.shape), tuple(obj.stride()))
            if key not in self._seen:
                self._seen[key] = name
                self.tensors[name] = obj.detach().to("cpu").contiguous()
            return {"t": self._seen[key]}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, (list, tuple)):
            return {"tuple" if isinstance(obj, tuple) else "list": [self(o, f"{name}.{i}") for i, o in enumerate(obj)]}
        if isinstance(obj, Linear):
            return {"linear": obj.quantized, "out": obj.out_features, "handle": self(obj.handle, name)}
        if isinstance(obj, ConcatLinear):
            return {"concat": [self(p, f"{name}.{i}") for i, p in enumerate(obj.parts)]}
        cls = type(obj)
        if dataclasses.is_dataclass(obj) and self.types.get(cls.__name__) is cls:
            return {"dataclass": cls.__name__,
                    "fields": {f.name: self(getattr(obj, f.name), f"{name}.{f.name}") for f in dataclasses.fields(obj)}}
        raise _Unsupported(f"{cls.__name__} at {name}")


def _decode(obj: dict, tensors: dict[str, torch.Tensor], backend: Backend, types: dict[str, type]):
    """The inverse of :class:`_Encoder` over the mapped ``tensors``."""
    if "v" in obj:
        return obj["v"]
    if "t" in obj:
        return tensors[obj["t"]]
    if "dtype" in obj:
        return getattr(torch, obj["dtype"])
    if "tuple" in obj:
        return tuple(_decode(o, tensors, backend, types) for o in obj["tuple"])
    if "list" in obj:
        return [_decode(o, tensors, backend, types) for o in obj["list"]]
    if "linear" in obj:
        return Linear(backend, _decode(obj["handle"], tensors, backend, types), obj["linear"], obj["out"])
    if "concat" in obj:
        return ConcatLinear([_decode(o, tensors, backend, types) for o in obj["concat"]])
    cls = types[obj["dataclass"]]  # KeyError: a handle type this backend does not know
    return cls(**{k: _decode(v, tensors, backend, types) for k, v in obj["fields"].items()})


def _write_file(folder: Path, stem: str, objects: dict, types: tuple[type, ...]) -> dict:
    """Write ``objects``' tensors to ``folder/stem.safetensors``; returns the file's entry of layout.json."""
    enc = _Encoder(types)
    described = {k: enc(v, k) for k, v in objects.items()}
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in enc.tensors.items()]
    write_safetensors_streamed(folder / f"{stem}.safetensors", specs, enc.tensors.__getitem__, align=ALIGN)
    return {"file": f"{stem}.safetensors", "objects": described}


def save(path: Path, backend: Backend, dtype: torch.dtype, lm_head_int8: bool) -> Path | None:
    """Load the checkpoint at ``path`` as the engine would (``backend``, ``dtype``, int8 head or not), writing each
    prepared decoder layer as soon as it is ready (one layer in memory at a time, plus the embeddings and head), and
    place the layout in ``<path>/serving/<key>`` (replacing an older one of the same key). Returns that folder, or
    ``None`` when the backend cannot save its prepared weights (e.g. a GPU backend; the engine then loads the
    checkpoint as usual). Raises ``LiteturboError`` for a checkpoint that does not load, a folder that cannot be
    written, or a checkpoint that changed while it was packed; nothing partial is left behind."""
    key = layout_key(backend, dtype, lm_head_int8)
    if key is None:
        return None
    path = Path(path)
    target = layout_dir(path, key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _clean_abandoned(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    except OSError as e:
        blocker = next((p for p in (target.parent, target.parent.parent) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise LiteturboError(f"cannot write the serving layout: {blocker} is a file where a folder belongs; move "
                                 f"or delete it, then run `liteturbo pack {path}` (the `lite` commands: or pass "
                                 f"--no-serving-layout)") from None
        raise LiteturboError(f"cannot write the serving layout into {target.parent} ({e.strerror or e}); make the "
                             f"checkpoint folder writable and run `liteturbo pack {path}`, or skip packing (the "
                             f"`lite` commands: --no-serving-layout; loads then prepare the weights each time)") from None
    types = backend.serving_handle_types()
    try:
        before = fingerprint(path)
        layers: list[dict] = []
        model = LlamaModel.from_pretrained(
            path, backend, dtype, lm_head_int8=lm_head_int8,
            on_layer=lambda i, layer: layers.append(_write_file(tmp, f"layer-{i:03d}", vars(layer), types)))
        head = _write_file(tmp, "head", {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head,
                                         "lm_head_dense": model.lm_head_dense}, types)
        if fingerprint(path) != before:
            raise LiteturboError(f"{path} changed while its serving layout was being written; run `liteturbo pack "
                                 f"{path}` again once nothing else writes it")
        meta = {"version": VERSION, "id": key, "fingerprint": before, "layers": layers, "head": head,
                "files": _stats(tmp / e["file"] for e in [*layers, head])}
        write_json(tmp / "layout.json", dict(meta, digest=_digest(meta)))
        os.chmod(tmp, 0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except _Unsupported as e:
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("no serving layout for %s: the backend's weight %s cannot be saved", path, e)
        return None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LiteturboError(f"cannot write the serving layout into {target.parent} ({e.strerror or e}); free disk "
                             f"space or skip packing (--no-serving-layout)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _populate(t: torch.Tensor) -> None:
    """Page a mapped tensor in now (``madvise(MADV_POPULATE_READ)``; where the kernel lacks it, one read per page)."""
    n = t.untyped_storage().nbytes()
    if n == 0:
        return
    start = t.untyped_storage().data_ptr()
    base = start - start % mmap.PAGESIZE
    if _libc is None or _libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(start + n - base),
                                      _MADV_POPULATE_READ) != 0:
        t.reshape(-1).view(torch.uint8)[::mmap.PAGESIZE].sum()


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # not glibc/musl: pages are touched one by one
    _libc = None


def _map(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one layout file, mapped (safetensors' zero-copy CPU tensors) and paged in."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if not k.startswith(PAD_PREFIX)}
    for t in tensors.values():
        _populate(t)
    return tensors


def load(path: Path, backend: Backend, dtype: torch.dtype, lm_head_int8: bool) -> LlamaModel | None:
    """The model from the saved serving layout of the checkpoint at ``path`` for this backend, dtype and head kind,
    its weights mapped from the files; ``None`` when there is none, or it is stale (the checkpoint's files or the
    backend's layout changed since it was written) or damaged (then a warning says so): the caller loads the
    checkpoint as usual."""
    key = layout_key(backend, dtype, lm_head_int8)
    if key is None:
        return None
    folder = layout_dir(Path(path), key)
    meta_file = folder / "layout.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("version") != VERSION or meta.get("id") != key or meta.get("fingerprint") != fingerprint(path):
            log.info("the serving layout in %s is stale (the checkpoint or the layout changed); loading %s as usual",
                     folder, path)
            return None
        if meta.get("digest") != _digest(meta):
            raise ValueError("layout.json does not match its digest: it was edited after it was written")
        files = [folder / e["file"] for e in [*meta["layers"], meta["head"]]]
        if _stats(files) != meta["files"]:
            raise ValueError("its files' sizes or modification times are not those it was written with (files "
                             "replaced, moved or copied)")
        raw = load_config(Path(path))
        cfg = ModelConfig.from_dict(raw)
        if len(meta["layers"]) != cfg.num_layers:
            raise ValueError(f"{len(meta['layers'])} layers, config.json has {cfg.num_layers}")
        qspec = quantization_spec(raw)
        model = LlamaModel(cfg, backend, dtype, qspec.method if qspec else None)
        types = {t.__name__: t for t in backend.serving_handle_types()}

        def objects(entry: dict) -> dict:
            """One file's objects (its ``layout.json`` entry), decoded over its mapped, paged-in tensors."""
            tensors = _map(folder / entry["file"])
            return {k: _decode(v, tensors, backend, types) for k, v in entry["objects"].items()}
        for entry in meta["layers"]:
            model.layers.append(Layer(**objects(entry)))
        head = objects(meta["head"])
        model.embed, model.norm = head["embed"], head["norm"]
        model.lm_head, model.lm_head_dense = head["lm_head"], head["lm_head_dense"]
        return model
    except LiteturboError:
        raise
    except Exception as e:  # damaged files, a hand-edited layout.json: the checkpoint itself still loads
        log.warning("ignoring the damaged serving layout in %s (%s: %s); loading %s as usual; `liteturbo pack %s` "
                    "writes it again", folder, type(e).__name__, e, path, path)
        return None
