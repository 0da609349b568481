"""Calibrated KV-cache quantization: per layer, a key shift, per-channel key scales and Hadamard rotations, searched offline.

Keys have outlier channels (KIVI, Liu et al. 2024, Sec. 3; KVQuant, Hooper et al. 2024, Sec. 3.1): a few channels
carry most of a key's range, so a per-token int4 grid spends its 16 levels on them and flattens the rest. Per
layer the cache (:mod:`backends.kv_cache`) may therefore store ``k'' = H((k - shift) / scale)`` and ``v'' = H v``,
quantized per token; attention undoes it on the query and output side, never per key. All of it acts on
post-rotary keys, as the cache stores them:

- ``shift``: the mean post-rotary key of each head over the calibration text. Subtracting any constant from the
  keys leaves attention unchanged (``q·(k - c)`` moves every score of a query by ``q·c``; the softmax ignores
  it), so the shift costs nothing in accuracy and removes the channels' constant offsets (the slowly rotating
  rotary pairs carry them almost unchanged to every position).
- ``scale``: ``m ** alpha`` per rotary pair ``(j, j + D/2)``, with ``m`` the largest pair norm
  ``sqrt(k_j² + k_{j+D/2}²)`` of the shifted keys. The pair norm does not depend on the position (the rotation
  keeps it), so one scale for both channels of a pair holds at positions beyond the calibration windows.
  ``alpha`` (SmoothQuant's migration strength, Xiao et al. 2023, Sec. 4) moves range from the outlier channels
  into the query side: ``q·k = (q ⊙ scale)·(k / scale)``, and the query stays 16-bit.
- ``H``: the normalized Hadamard matrix of the head (QuaRot, Ashkboos et al. 2024, Sec. 4), for keys and/or
  values: an orthogonal rotation spreads what remains of an outlier over all channels, so the per-token range
  shrinks; ``q·k = (Hq)·(Hk)`` and ``Σ p v = H Σ p (H v)`` keep attention exact. Needs a power-of-two head size.

Per layer the search (:func:`search_key_transform`) picks the shift (on/off), ``alpha`` on a grid and the key
rotation (on/off) minimising the relative error of the attention output on calibration windows,
``Σ ||softmax(Q K̂ᵀ/√d) V − softmax(Q Kᵀ/√d) V||² / Σ ||softmax(Q Kᵀ/√d) V||²`` with ``K̂`` the keys as attention
effectively reads them, then the value rotation the same way. The online mode (nothing on) is among the
candidates, so the calibrated choice is never worse than online on the calibration text.

:func:`calibrate_kv` runs the calibration text through the model layer by layer (:mod:`lite.layerwise`, the run
kit of the weight pipeline: a meta-device skeleton, one layer materialized at a time, 16-bit or W4A16 sources,
Mixture-of-Experts models through the same per-expert block as the weight methods, resumable per layer) and writes a
complete checkpoint: the source's files hard-linked (copied across file systems), ``config.json`` with the
``liteturbo_kv_cache`` entry, the parameter file, and provenance in ``liteturbo_kv_calibration.json``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backends.kv_cache import KVQuantParams, dequantize_per_token, hadamard, quantize_per_token

from .calibration import calibration_samples, check_calib_seqlen
from .formats import (KV_CONFIG_FIELD, KV_PARAMS_FILE, LiteturboError, arch_spec, atomic_output_dir,
                      check_output_dir, kv_config_block, load_config, resolve_model, save_kv_params, write_json)
from .layerwise import LazyCheckpoint, open_partial, peak_memory_gib, resolve_device, run_fingerprint, run_layer


@dataclass
class KVCalibConfig:
    """Options of ``calibrate-kv`` (validated on construction; hashed for ``--resume``).

    calib_*: calibration data (see :mod:`lite.calibration`). kv_bits: the cache bits the search targets (4: the
    mode that needs it; the same parameters also serve int8). n_grid: alpha grid points in [0, 1].
    search_windows: calibration windows the attention-error search runs on (statistics use all of them).
    rotation: also try Hadamard rotations of keys and values (``False``: shift and scales only).
    device: cpu | cuda | auto.
    """

    calib_dataset: str = "c4"
    calib_samples: int = 128
    calib_seqlen: int = 512
    seed: int = 42
    kv_bits: int = 4
    n_grid: int = 6
    search_windows: int = 8
    rotation: bool = True
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.calib_samples <= 0 or self.calib_seqlen <= 1:
            raise LiteturboError("--calib-samples must be positive and --calib-seqlen at least 2")
        if self.kv_bits not in (4, 8):
            raise LiteturboError(f"--kv-bits must be 4 or 8, got {self.kv_bits}")
        if self.search_windows < 1:
            raise LiteturboError(f"--search-windows must be >= 1, got {self.search_windows}")
        if self.search_windows > self.calib_samples:
            raise LiteturboError(f"--search-windows {self.search_windows} exceeds --calib-samples {self.calib_samples}; "
                                 f"lower it")
        if self.n_grid < 2:
            raise LiteturboError(f"n_grid must be >= 2, got {self.n_grid}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise LiteturboError(f"--device must be cpu, cuda or auto, got {self.device!r}")

    def torch_device(self) -> torch.device:
        """The compute device (``auto`` = cuda when available)."""
        return resolve_device(self.device)


@dataclass
class KeyTransform:
    """One layer's result: ``shift``/``scale`` float32 ``[KVH, D]``, whether keys and values are rotated, the
    chosen ``alpha`` and shift, and the search losses (relative attention-output error) of the choices and of
    the online mode, for keys (``loss``, ``online_loss``) and values (``v_loss``, ``v_online_loss``)."""

    shift: torch.Tensor
    scale: torch.Tensor
    rotate: bool
    v_rotate: bool
    alpha: float
    use_shift: bool
    loss: float
    online_loss: float
    v_loss: float = 0.0
    v_online_loss: float = 0.0


# --- the algorithm (pure tensor functions) ----------------------------------------------------------------
def pair_absmax(k: torch.Tensor) -> torch.Tensor:
    """Largest rotary-pair norm per head and channel: ``k [N, KVH, D]`` → ``[KVH, D]`` (channels ``j`` and
    ``j + D/2`` share the value ``max_n sqrt(k_j² + k_{j+D/2}²)``)."""
    half = k.shape[-1] // 2
    norm = torch.sqrt(k[..., :half].square() + k[..., half:].square()).amax(0)
    return torch.cat([norm, norm], dim=-1)


def fake_quantize_keys(k: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, bits: int,
                       rotate: bool = False) -> torch.Tensor:
    """What attention effectively reads back from the cache for keys ``k [N, KVH, D]``: transform, per-token
    quantization, inverse transform (the shift stays subtracted; attention does not see it). float32."""
    x = (k.float() - shift) / scale
    h = hadamard(k.shape[-1]) if rotate else None
    if h is not None:
        x = x @ h
    codes, s, z = quantize_per_token(x, bits)
    x = dequantize_per_token(codes, s, z)
    if h is not None:
        x = x @ h
    return x * scale


def fake_quantize_values(v: torch.Tensor, bits: int, rotate: bool = False) -> torch.Tensor:
    """As :func:`fake_quantize_keys` for values (optionally rotated, no shift or scale). float32."""
    h = hadamard(v.shape[-1]) if rotate else None
    x = v.float() @ h if h is not None else v.float()
    codes, s, z = quantize_per_token(x, bits)
    x = dequantize_per_token(codes, s, z)
    return x @ h if h is not None else x


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one window: q ``[T, H, D]``, k/v ``[T, KVH, D]`` → ``[H, T, D]`` (float32)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                          v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True)[0]


def search_key_transform(keys: torch.Tensor, windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                         bits: int = 4, n_grid: int = 6, rotation: bool = True) -> KeyTransform:
    """Choose one layer's key shift, scales and rotation, and the value rotation (objective: the module docstring).

    keys: every calibration token's post-rotary key ``[N, KVH, D]`` (statistics). windows: ``(q [T, H, D],
    k [T, KVH, D], v [T, KVH, D])`` of a few calibration windows, post-rotary, positions from 0 (the search).
    Keys are scored with exact values and values with exact keys. Rotations are tried when ``rotation`` and
    ``D`` is a power of two.
    """
    keys = keys.float()
    kvh, d = keys.shape[1], keys.shape[2]
    mean = keys.mean(0)
    refs = [_attend(q, k, v) for q, k, v in windows]
    denom = sum(float(r.square().sum()) for r in refs) or 1.0

    def loss(shift: torch.Tensor, scale: torch.Tensor, rotate: bool) -> float:
        """Relative attention-output error with keys stored under this transform (values exact)."""
        err = 0.0
        for (q, k, v), ref in zip(windows, refs):
            err += float((_attend(q, fake_quantize_keys(k, shift, scale, bits, rotate), v) - ref).square().sum())
        return err / denom

    def v_loss(rotate: bool) -> float:
        """Relative attention-output error with values stored plain or rotated (keys exact)."""
        err = 0.0
        for (q, k, v), ref in zip(windows, refs):
            err += float((_attend(q, k, fake_quantize_values(v, bits, rotate)) - ref).square().sum())
        return err / denom

    rotations = (False, True) if rotation and d & (d - 1) == 0 else (False,)
    zero, ones = torch.zeros(kvh, d), torch.ones(kvh, d)
    online = loss(zero, ones, False)
    best = KeyTransform(zero, ones, False, False, 0.0, False, online, online)
    for use_shift in (False, True):
        shift = mean if use_shift else zero
        m = pair_absmax(keys - shift)
        m = torch.maximum(m, m.amax(-1, keepdim=True) * 1e-4).clamp(min=1e-8)  # dead channels: no huge 1/scale
        for rotate in rotations:
            for i in range(n_grid):
                alpha = i / (n_grid - 1)
                if alpha == 0 and not use_shift and not rotate:
                    continue  # the online mode, scored above
                scale = m.pow(alpha)
                scale = scale / scale.amax(-1, keepdim=True)  # per head, the largest scale is 1
                val = loss(shift, scale, rotate)
                if val < best.loss:
                    best = KeyTransform(shift.clone(), scale, rotate, False, alpha, use_shift, val, online)
    best.v_online_loss = best.v_loss = v_loss(False)
    if True in rotations:
        rotated = v_loss(True)
        if rotated < best.v_loss:
            best.v_rotate, best.v_loss = True, rotated
    return best


# --- driving it through a model ----------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def layer_qkv(layer, hidden: torch.Tensor, kw: dict, qk_norm: bool,
              qk_norm_per_head: bool = True) -> tuple[torch.Tensor, ...]:
    """Post-rotary q ``[T, H, D]``, k ``[T, KVH, D]`` and v of one sample at one HF decoder layer, as the engine
    computes them (input norm, projections, the q/k norm: per head as Qwen3's, or with ``qk_norm_per_head=False``
    over all heads together as OLMoE's, rotate-half RoPE with the layer's ``position_embeddings``)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    b, t, _ = x.shape
    hd = attn.head_dim
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if qk_norm and not qk_norm_per_head:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.view(b, t, -1, hd), k.view(b, t, -1, hd), v.view(b, t, -1, hd)
    if qk_norm and qk_norm_per_head:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = kw["position_embeddings"]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q[0].float(), k[0].float(), v[0].float()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def calibrate_kv(model: str | None, cfg: KVCalibConfig, work_dir: str, overwrite: bool = False, resume: bool = False,
                 stop_after_layers: int | None = None) -> Path:
    """Calibrate the key transform of every layer of ``model`` (16-bit or W4A16) and write the checkpoint
    ``work_dir`` (see the module docstring); returns its path.

    Validates everything before any work. Finished layers are kept in ``<work_dir>.partial`` so that
    ``resume=True`` continues an interrupted run (with the same options and source). ``stop_after_layers``
    (testing) raises ``KeyboardInterrupt`` after that many layers, as a Ctrl-C would. The output folder appears
    only when complete. Raises ``LiteturboError`` for bad input.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    src = resolve_model(model)
    config = load_config(src)
    spec = arch_spec(config)
    out = check_output_dir(Path(work_dir), overwrite, source=src)
    device = cfg.torch_device()
    lazy = LazyCheckpoint(src, device)
    n_layers = len(lazy.layers)

    check_calib_seqlen(config, cfg.calib_seqlen)
    # everything that can fail on bad input runs before the .partial folder exists
    tok = AutoTokenizer.from_pretrained(str(src))
    samples = calibration_samples(tok, cfg.calib_dataset, cfg.calib_samples, cfg.calib_seqlen, cfg.seed)

    partial = open_partial(out, run_fingerprint(asdict(cfg), src), {"config": asdict(cfg), "source": str(src)},
                           resume)
    inps, kws = lazy.capture_inputs(samples)
    n_tok = sum(x.shape[1] for x in inps)
    shifts, scales, k_rot, v_rot, report, reused = [], [], [], [], [], 0
    bar = tqdm(range(n_layers), desc=f"calibrate-kv int{cfg.kv_bits} ({n_tok} calib tokens)", unit="layer")
    for i in bar:
        layer = lazy.layers[i]
        lazy.materialize(layer, f"model.layers.{i}")
        f = partial / f"kv_layer_{i:04d}.safetensors"
        if f.is_file():
            t = load_file(str(f))
            info = json.loads((partial / f"kv_layer_{i:04d}.json").read_text())
            reused += 1
        else:
            keys, windows = [], []
            with torch.no_grad():
                for j, (h, kw) in enumerate(zip(inps, kws)):
                    q, k, v = layer_qkv(layer, h, kw, spec.qk_norm, spec.qk_norm_per_head)
                    keys.append(k.cpu())
                    if j < cfg.search_windows:
                        windows.append((q, k, v))
                best = search_key_transform(torch.cat(keys, 0).to(device), windows, cfg.kv_bits, cfg.n_grid,
                                            cfg.rotation)
            t = {"k_shift": best.shift.cpu().contiguous(), "k_scale": best.scale.cpu().contiguous(),
                 "k_rotate": torch.tensor([best.rotate]), "v_rotate": torch.tensor([best.v_rotate])}
            info = {"alpha": best.alpha, "shift": best.use_shift, "k_rotate": best.rotate, "v_rotate": best.v_rotate,
                    "loss": best.loss, "online_loss": best.online_loss, "v_loss": best.v_loss,
                    "v_online_loss": best.v_online_loss}
            tmp = f.with_suffix(".tmp")
            save_file(t, str(tmp))
            write_json(partial / f"kv_layer_{i:04d}.json", info)
            os.replace(tmp, f)
            del keys, windows
        shifts.append(t["k_shift"])
        scales.append(t["k_scale"])
        k_rot.append(bool(t["k_rotate"][0]))
        v_rot.append(bool(t["v_rotate"][0]))
        report.append(dict(layer=i, **info))
        if i + 1 < n_layers:
            inps = run_layer(layer, inps, kws)
        lazy.release(layer)
        bar.set_postfix(alpha=f"{info['alpha']:.1f}", k_err=f"{info['loss']:.1e}/{info['online_loss']:.1e}",
                        v_err=f"{info['v_loss']:.1e}/{info['v_online_loss']:.1e}")
        if stop_after_layers is not None and i + 1 - reused >= stop_after_layers:
            raise KeyboardInterrupt(f"stopped after {i + 1} layers (test hook)")

    params = KVQuantParams(torch.stack(shifts), torch.stack(scales), torch.tensor(k_rot), torch.tensor(v_rot))
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        for item in src.iterdir():
            if item.is_file() and item.name not in ("config.json", KV_PARAMS_FILE, "liteturbo_kv_calibration.json"):
                _link_or_copy(item, tmp / item.name)
        save_kv_params(tmp, params)
        block = kv_config_block(params, calibration_bits=cfg.kv_bits)
        write_json(tmp / "config.json", dict(config, **{KV_CONFIG_FIELD: block}))
        wall = time.perf_counter() - t0
        write_json(tmp / "liteturbo_kv_calibration.json", {
            "source": str(src), "options": asdict(cfg), "calibration_tokens": n_tok, "device": device.type,
            "wall_seconds": round(wall, 1), "peak_memory_gib": round(peak_memory_gib(device), 2),
            "reused_layers": reused, "torch_threads": torch.get_num_threads(), "layers": report})
    shutil.rmtree(partial, ignore_errors=True)
    k_gain = sum(r["online_loss"] / max(r["loss"], 1e-30) for r in report) / len(report)
    v_gain = sum(r["v_online_loss"] / max(r["v_loss"], 1e-30) for r in report) / len(report)
    print(f"[liteturbo] calibrate-kv: wrote {out} in {wall:.1f} s, peak memory {peak_memory_gib(device):.2f} GiB; "
          f"attention error from int{cfg.kv_bits} keys {k_gain:.1f}x and from values {v_gain:.1f}x lower than "
          f"online (mean over layers, calibration text)", file=sys.stderr)
    return out
