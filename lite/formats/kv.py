"""On-disk form of calibrated KV-cache parameters (written by ``liteturbo lite calibrate-kv``).

A checkpoint folder carries them as a safetensors file referenced from ``config.json``::

    "liteturbo_kv_cache": {"format": "liteturbo-kv/1", "file": "kv_cache_params.safetensors",
                           "key_transform": "shift+channel-scale+hadamard", "num_layers": L, "num_kv_heads": H,
                           "head_dim": D}

The file holds ``k_shift`` and ``k_scale``, float32 ``[L, H, D]``, and ``k_rotate``, ``v_rotate``, uint8 ``[L]``
(see :class:`backends.kv_cache.KVQuantParams` for their meaning). Other tools ignore the unknown config field; liteturbo's engine applies the parameters when
an int8/int4 KV cache is asked for.
"""
from __future__ import annotations

from pathlib import Path

import torch

from backends.kv_cache import KVQuantParams

from .errors import LiteturboError

KV_CONFIG_FIELD = "liteturbo_kv_cache"
KV_FORMAT = "liteturbo-kv/1"
KV_PARAMS_FILE = "kv_cache_params.safetensors"


KEY_TRANSFORMS = ("shift+channel-scale", "shift+channel-scale+hadamard")


def kv_config_block(params: KVQuantParams, **extra) -> dict:
    """The ``config.json`` entry that points at the parameter file (``extra``: provenance fields).
    ``key_transform`` names the rotation only when some layer uses one."""
    layers, heads, dim = params.k_shift.shape
    rotated = bool(params.k_rotate.any() or params.v_rotate.any())
    return {"format": KV_FORMAT, "file": KV_PARAMS_FILE, "key_transform": KEY_TRANSFORMS[rotated],
            "num_layers": layers, "num_kv_heads": heads, "head_dim": dim, **extra}


def save_kv_params(folder: Path, params: KVQuantParams) -> Path:
    """Write the parameter file into ``folder`` (which the caller renames into place atomically)."""
    from safetensors.torch import save_file

    out = Path(folder) / KV_PARAMS_FILE
    save_file({"k_shift": params.k_shift.contiguous(), "k_scale": params.k_scale.contiguous(),
               "k_rotate": params.k_rotate.to(torch.uint8), "v_rotate": params.v_rotate.to(torch.uint8)}, str(out),
              metadata={"format": KV_FORMAT})
    return out


def load_kv_params(folder: Path, config: dict) -> KVQuantParams | None:
    """The calibrated parameters a checkpoint references, or ``None`` when ``config.json`` names none.

    Raises ``LiteturboError`` naming the problem and the fix when the entry or the file is damaged.
    """
    entry = config.get(KV_CONFIG_FIELD)
    if entry is None:
        return None
    fix = "run `liteturbo lite calibrate-kv` again on the source model, or pass kv_calibration=False " \
          "(--no-kv-calibration) to use the online int8/int4 cache"
    where = f"{Path(folder) / 'config.json'}: {KV_CONFIG_FIELD!r}"
    if not isinstance(entry, dict) or entry.get("format") != KV_FORMAT or not isinstance(entry.get("file"), str):
        raise LiteturboError(f"{where} must be an object with format {KV_FORMAT!r} and a 'file'; {fix}")
    name = entry["file"]
    if not name or Path(name).name != name or name in (".", ".."):
        raise LiteturboError(f"{where}: 'file' must name a file inside the checkpoint folder, got {name!r}; {fix}")
    if entry.get("key_transform") not in KEY_TRANSFORMS:
        raise LiteturboError(f"{where}: unknown key_transform {entry.get('key_transform')!r} (this liteturbo reads "
                             f"{', '.join(KEY_TRANSFORMS)}); {fix}")
    path = Path(folder) / name
    if not path.is_file():
        raise LiteturboError(f"the KV parameter file {path} named in config.json is missing; {fix}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise LiteturboError(f"cannot read the KV parameter file {path} ({e}); it is damaged: {fix}") from None
    rotated = entry["key_transform"].endswith("+hadamard")
    names = ("k_shift", "k_scale") + (("k_rotate", "v_rotate") if rotated else ())
    missing = [n for n in names if n not in t]
    if missing:
        raise LiteturboError(f"the KV parameter file {path} lacks {', '.join(missing)}; {fix}")
    for n in ("k_rotate", "v_rotate"):
        if n in t and not bool(((t[n] == 0) | (t[n] == 1)).all()):
            raise LiteturboError(f"the KV parameter file {path}: {n} must hold 0 or 1; {fix}")
    try:
        params = KVQuantParams(t["k_shift"].to(torch.float32), t["k_scale"].to(torch.float32), t.get("k_rotate"),
                               t.get("v_rotate"))
    except ValueError as e:
        raise LiteturboError(f"the KV parameter file {path} is invalid ({e}); {fix}") from None
    stated = tuple(entry.get(k) for k in ("num_layers", "num_kv_heads", "head_dim"))
    if stated != tuple(params.k_shift.shape):
        raise LiteturboError(f"{where} states layers/kv heads/head_dim {stated} but {path} holds "
                             f"{tuple(params.k_shift.shape)}; {fix}")
    return params
