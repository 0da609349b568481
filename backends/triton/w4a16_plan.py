"""The Triton W4A16 path's host side: the load-time tiled weight layout (byte-level repack, :func:`pack_tiled`) and the
per-call launch plan (kernel kind, tiles, warps, stages, split-K) from the shipped configuration table
``w4a16_configs.json`` (keyed by ``N,K`` and an ``M`` bucket; defaults for shapes it does not list). The kernels
that use them are in :mod:`backends.triton.w4a16`.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton

TILE_N = 128  # columns per layout tile
TILE_K = 128  # K is padded to a multiple of this (16 words)


# --- load-time repack (byte level) ------------------------------------------------------------------------
def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` in ``[0, 16)`` → int32 ``[N, ceil(K/8)]``: channel ``k`` in bits ``4*(k % 8)`` of word
    ``[n, k // 8]`` (K padded with code 0). Byte-level: nibble pairs OR-ed into bytes, then viewed as int32."""
    n, k = codes.shape
    k8 = (k + 7) // 8
    c = codes.to(torch.uint8)
    if k8 * 8 != k:
        c = torch.nn.functional.pad(c, (0, k8 * 8 - k))
    c = c.reshape(n, k8 * 4, 2)
    b = c[..., 0] | (c[..., 1] << 4)  # [N, K/2] uint8: byte i = channels 2i (low nibble), 2i + 1 (high)
    return b.view(torch.int32)  # little-endian: byte 0 → bits 0-7


def pack_tiled(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` → the tiled layout of this module (see the module docstring)."""
    n, k = codes.shape
    words = pack_words(codes)  # [N, K8]
    n_p = -(-n // TILE_N) * TILE_N
    k8p = -(-k // TILE_K) * (TILE_K // 8)
    if n_p != n or k8p != words.shape[1]:
        words = torch.nn.functional.pad(words, (0, k8p - words.shape[1], 0, n_p - n))
    return words.view(n_p // TILE_N, TILE_N, k8p).transpose(1, 2).contiguous()


def unpack_tiled(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_tiled` → uint8 ``[N, K]``."""
    t, k8p, tn = qweight.shape
    words = qweight.transpose(1, 2).reshape(t * tn, k8p)[:n]
    b = words.contiguous().view(torch.uint8).reshape(n, k8p * 4)
    codes = torch.stack((b & 15, b >> 4), -1).reshape(n, k8p * 8)
    return codes[:, :k].contiguous()


# --- configurations ---------------------------------------------------------------------------------------
_CONFIG_PATH = Path(__file__).with_name("w4a16_configs.json")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def m_bucket(m: int) -> int:
    """The configuration bucket of ``m`` rows: the smallest of :data:`M_BUCKETS` at least ``m`` (128 for more)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


@functools.lru_cache(maxsize=1)
def load_configs(path: str | None = None) -> dict:
    """The shipped configuration table (``{"default": {...}, "gemv_max_m": .., "shapes": {"N,K": {"M": {...}}}}``)."""
    p = Path(path) if path else _CONFIG_PATH
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


_DEFAULT_GEMV = {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 1, "split_k": 0}  # = the shipped table
_DEFAULT_DOT = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "split_k": 0}  # = the shipped table


_DEFAULT_DOT_FP32 = {"block_k": 32, "num_stages": 1}  # float32 activations: tl.dot in FMAs, smaller K tiles


def get_config(n: int, k: int, m: int, table: dict | None = None, kind: str | None = None,
               fp32: bool = False) -> dict:
    """The table's launch configuration for ``M = m`` rows of an ``N x K`` weight: ``kind`` (``"gemv"`` up to
    ``gemv_max_m`` rows, else ``"dot"``, unless given) and block sizes, warps, stages, ``split_k`` (0: from the
    multiprocessor count); ``block_m`` only where the table sets it. ``fp32``: float32 activations (the table's
    ``default.dot_fp32`` on top of ``default.dot`` and of the shape's entry: FMA dots want smaller K tiles)."""
    table = load_configs() if table is None else table
    if kind is None:
        kind = "gemv" if m <= int(table.get("gemv_max_m", 1)) else "dot"
    cfg = dict(_DEFAULT_GEMV if kind == "gemv" else _DEFAULT_DOT)
    cfg.update(table.get("default", {}).get(kind, {}))
    shape = table.get("shapes", {}).get(f"{n},{k}", {}).get(str(m_bucket(m)), {})
    if shape.get("kind", kind) == kind:
        cfg.update(shape)
    if fp32 and kind == "dot":  # after the shape entries, which were tuned for 16-bit activations
        cfg.update(_DEFAULT_DOT_FP32)
        cfg.update(table.get("default", {}).get("dot_fp32", {}))
    cfg["kind"] = kind
    return cfg


def launch_params(m: int, n: int, k: int, group_size: int, *, sms: int = 1, batch_invariant: bool = False,
                  config: dict | None = None, kind: str | None = None, split_k: int | None = None,
                  fp32: bool = False) -> dict:
    """Everything a launch of :func:`w4a16_matmul` fixes: ``kind, block_m, block_n, block_k, num_warps,
    num_stages, split`` (the static report uses it too). ``batch_invariant``: the tensor-core kernel with 16-row
    tiles and the split from N and K alone, whatever ``m``. Group sizes that are not a multiple of 16 run on the
    GEMV kernel (tl.dot needs K tiles of 16)."""
    group = kernel_group(group_size, k)
    if batch_invariant:
        cfg = get_config(n, k, 16, kind="dot", fp32=fp32)
        cfg.update(config or {})
        cfg.update(kind="dot", block_m=16)
    else:
        cfg = dict(config) if config is not None else get_config(n, k, m, kind=kind, fp32=fp32)
        if kind is not None:
            cfg["kind"] = kind
    if cfg["kind"] == "dot" and group and group % 16:
        cfg = dict(_DEFAULT_GEMV, kind="gemv", block_m=4)
    if cfg["kind"] == "gemv":
        block_m = int(cfg.get("block_m") or (1 if m == 1 else (2 if m == 2 else 4)))
        block_k = _block_k(group, cfg["block_k"], 8)
    else:
        block_m = int(cfg.get("block_m") or (16 if m <= 16 else (32 if m <= 32 else 64)))
        block_k = _block_k(group, cfg["block_k"], 16)
        if fp32 and block_m >= 64:
            cfg["num_warps"] = max(int(cfg["num_warps"]), 8)
    block_n = int(cfg["block_n"])
    m_blocks, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    split = choose_split(n_tiles * (1 if batch_invariant else m_blocks), k, block_k, sms,
                         split_k or cfg.get("split_k") or None)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # every split gets at least one K tile
    return {"kind": cfg["kind"], "block_m": block_m, "block_n": block_n, "block_k": block_k,
            "num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"]), "split": split,
            "k_per_split": k_per_split, "group": group}


def kernel_group(group_size: int, k: int) -> int:
    """The kernels' ``GROUP`` constexpr: 0 for one group over K, else the group size."""
    return 0 if group_size <= 0 or group_size >= k else int(group_size)


def supports(group_size: int, k: int, g_idx: torch.Tensor | None = None) -> bool:
    """Whether the tiled kernels take this weight: contiguous groups (no per-channel ``g_idx``) whose size is a
    multiple of 8, or one group over K."""
    return g_idx is None and (kernel_group(group_size, k) % 8 == 0)


def _block_k(group: int, want: int, lo: int = 8) -> int:
    bk = max(lo, min(int(want), TILE_K))
    if group:
        while group % bk:
            bk //= 2
    return bk


def choose_split(tiles: int, k: int, block_k: int, sms: int, split: int | None = None) -> int:
    """Split-K factor: ``split`` if given (>0), else enough programs for ~4 per multiprocessor, each keeping at least
    two K tiles (1 without a GPU's multiprocessor count)."""
    k_tiles = -(-k // block_k)
    if split:
        return max(1, min(int(split), k_tiles))
    if sms <= 1:
        return 1
    return max(1, min(-(-4 * sms // max(tiles, 1)), k_tiles // 2, 32))
