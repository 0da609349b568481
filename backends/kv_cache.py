"""The paged KV cache as an object: 16-bit, or int8/int4 quantized per token and per KV head.

A backend allocates it from a :class:`KVCacheSpec` (:meth:`backends.base.Backend.allocate_kv_cache`); it owns the
value tensors and their scales, knows its exact bytes per block, and is the only reader and writer of K/V:
the model writes each step's keys and values through :meth:`PagedKVCache.write`, attention reads them back
through :meth:`PagedKVCache.gather`, session save/restore goes through :meth:`PagedKVCache.export` /
:meth:`PagedKVCache.load`. Tokens are addressed by slot (``block_id * block_size + offset``).

Quantized storage (the *online* mode; KIVI, Liu et al. 2024, Sec. 3 and LMDeploy's ``quant_policy``): each token's
key (and value) vector of one KV head, ``x [D]``, is quantized asymmetrically with an integer zero point, the same
definition the W4A16 weights use::

    lo = min(min(x), 0); hi = max(max(x), 0); scale = (hi - lo) / (2**bits - 1)   (stored as float16)
    zero = round(-lo / scale)                      (uint8, in [0, 2**bits - 1])
    code = clamp(round(x / scale) + zero, 0, 2**bits - 1);  x ≈ (code - zero) * scale

int4 packs two codes per byte: byte ``j`` holds channel ``j`` in its low nibble and channel ``j + D/2`` in its
high nibble. Per token and head the scales cost 3 bytes (float16 scale + uint8 zero), so with ``D = 64`` a
token-head takes 67 bytes in int8 and 35 in int4 against 128 in bf16.

*Calibrated* mode (:class:`KVQuantParams`, written by ``liteturbo lite calibrate-kv``; the search is in
:mod:`lite.kv_calibration`): keys have outlier channels (KIVI Sec. 3; KVQuant, Hooper et al. 2024, Sec. 3.1),
so a layer may store ``k'' = H((k - shift) / scale)`` and ``v'' = H v`` instead, each quantized per token, with
``shift``/``scale`` per channel and ``H`` the normalized Hadamard rotation of the head (QuaRot, Ashkboos et al.
2024, Sec. 4: a rotation spreads outliers over all channels). Nothing is undone per key on read: attention
multiplies ``H (q * scale)`` (:meth:`PagedKVCache.attention_query`) with the stored keys, which equals
``q · (k - shift)``, and rotates its output back (:meth:`PagedKVCache.attention_output`). The shift is never
added back: ``q·(k - shift) = q·k - q·shift`` moves all scores of a query by the same amount, which the
softmax ignores, so attention is exact without it. All of it acts on post-rotary keys, as the cache stores
them; ``scale`` is shared by each rotary pair ``(j, j + D/2)`` so that it holds at any position.

*Rotated* mode (no calibration; :meth:`KVQuantParams.rotation_only`, the default of an int4 cache): the calibrated
mode's form with no shift, unit scales and the rotation in every layer, so every layer stores ``H k`` and ``H v``.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("bfloat16", "float16", "float32", "int8", "int4")
_FLOAT_KV = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_BITS = {"int8": 8, "int4": 4}
# bytes of quantization parameters per token and KV head: float16 scale + uint8 zero point
PARAM_BYTES = 3
_FP16_MIN_NORMAL, _FP16_MAX = 2.0 ** -14, 65504.0


@dataclass(frozen=True)
class KVCacheSpec:
    """What to allocate: storage ``dtype`` (one of :data:`KV_CACHE_DTYPES`), ``num_blocks`` blocks of ``block_size``
    tokens, for ``num_layers`` layers of ``num_kv_heads`` heads of ``head_dim`` channels.

    Raises ``ValueError`` for an unknown dtype, non-positive sizes, or int4 with an odd ``head_dim``.
    """

    dtype: str
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        for name in ("num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype == "int4" and self.head_dim % 2:
            raise ValueError(f"an int4 KV cache packs two channels per byte and needs an even head_dim, "
                             f"got {self.head_dim}")

    @property
    def quantized(self) -> bool:
        """True for int8 / int4."""
        return self.dtype in _BITS

    @property
    def bits(self) -> int:
        """Bits per stored value (16/32 for float caches)."""
        return _BITS.get(self.dtype) or torch.finfo(_FLOAT_KV[self.dtype]).bits

    def bytes_per_token_head(self) -> int:
        """Bytes of one token's key *or* value of one KV head, scales included."""
        if self.quantized:
            return self.head_dim * self.bits // 8 + PARAM_BYTES
        return self.head_dim * self.bits // 8

    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers, keys and values, scales included."""
        return 2 * self.num_layers * self.num_kv_heads * self.bytes_per_token_head()

    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers (the unit the pool is sized in)."""
        return self.block_size * self.bytes_per_token()

    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_blocks * self.bytes_per_block()


def hadamard(d: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix ``[d, d]`` (float32, symmetric, ``H @ H = I``); ``d`` a power of two.
    Raises ``ValueError`` otherwise."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


@dataclass
class KVQuantParams:
    """Offline (calibrated) parameters of a quantized cache, per layer.

    ``k_shift``, ``k_scale`` (> 0): float32 ``[num_layers, num_kv_heads, head_dim]``; ``k_rotate``, ``v_rotate``:
    bool ``[num_layers]``. A layer stores ``k'' = H((k - k_shift) / k_scale)`` and ``v'' = H v`` (``H`` the
    normalized Hadamard matrix of ``head_dim``, only where ``*_rotate``), each quantized per token. Raises
    ``ValueError`` for mismatched shapes, non-finite values, non-positive scales, or a rotation where
    ``head_dim`` is not a power of two. ``mode``: ``"calibrated"`` (searched by ``lite calibrate-kv``) or
    ``"rotated"`` (:meth:`rotation_only`, no calibration).
    """

    k_shift: torch.Tensor
    k_scale: torch.Tensor
    k_rotate: torch.Tensor | None = None
    v_rotate: torch.Tensor | None = None
    mode: str = "calibrated"

    def __post_init__(self) -> None:
        if self.mode not in ("calibrated", "rotated"):
            raise ValueError(f"KVQuantParams.mode must be 'calibrated' or 'rotated', got {self.mode!r}")
        self.k_shift = self.k_shift.detach().float().cpu().contiguous()
        self.k_scale = self.k_scale.detach().float().cpu().contiguous()
        if self.k_shift.dim() != 3 or self.k_shift.shape != self.k_scale.shape:
            raise ValueError(f"k_shift and k_scale must both be [layers, kv_heads, head_dim], got "
                             f"{tuple(self.k_shift.shape)} and {tuple(self.k_scale.shape)}")
        layers, _, d = self.k_shift.shape
        for name in ("k_rotate", "v_rotate"):
            t = getattr(self, name)
            t = torch.zeros(layers, dtype=torch.bool) if t is None else t.detach().cpu().bool().contiguous()
            if tuple(t.shape) != (layers,):
                raise ValueError(f"{name} must have shape ({layers},), got {tuple(t.shape)}")
            setattr(self, name, t)
        if (self.k_rotate.any() or self.v_rotate.any()) and d & (d - 1):
            raise ValueError(f"rotations need a power-of-two head_dim, got {d}")
        if not (torch.isfinite(self.k_shift).all() and torch.isfinite(self.k_scale).all()):
            raise ValueError("k_shift / k_scale hold NaN or inf")
        if not (self.k_scale > 0).all():
            raise ValueError("k_scale must be > 0 everywhere")

    @classmethod
    def rotation_only(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> "KVQuantParams":
        """The uncalibrated rotated mode: no shift, unit scales, keys and values Hadamard-rotated in every layer
        (what ``--kv-cache-dtype int4`` uses by default; ``EngineConfig.kv_rotation``). Raises ``ValueError`` when
        ``head_dim`` is not a power of two."""
        shape = (num_layers, num_kv_heads, head_dim)
        on = torch.ones(num_layers, dtype=torch.bool)
        return cls(torch.zeros(shape), torch.ones(shape), on, on.clone(), mode="rotated")

    def mismatch(self, num_layers: int, num_kv_heads: int, head_dim: int) -> str | None:
        """``None`` when the parameters fit a model of this shape, else what differs (for an error message)."""
        got = tuple(self.k_shift.shape)
        diffs = [f"{name} {g} != {w}" for name, g, w in zip(("layers", "kv heads", "head_dim"), got,
                                                              (num_layers, num_kv_heads, head_dim)) if g != w]
        return ", ".join(diffs) or None

    def digest(self) -> str:
        """Short hash identifying these parameters (saved KV is reused only under the same ones)."""
        h = hashlib.sha256(self.k_shift.numpy().tobytes())
        for t in (self.k_scale, self.k_rotate, self.v_rotate):
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:12]


# --- the quantization definition (also the reference the tests check) ------------------------------------
def quantize_per_token(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-vector quantization over the last dim (see the module docstring).

    ``x [..., D]`` (any float dtype; computed in float32) → ``codes`` uint8 ``[..., D]`` in ``[0, 2**bits)``,
    ``scale`` float16 ``[...]``, ``zero`` uint8 ``[...]``. The range always includes 0, so constant and all-zero
    vectors are exact (no NaN); ``scale`` is clamped to float16's normal range.
    """
    qmax = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(-1).clamp(max=0.0)
    hi = xf.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / qmax).clamp(_FP16_MIN_NORMAL, _FP16_MAX).to(torch.float16)
    s = scale.float()  # quantize with the scale as stored, so dequantizing reproduces the rounding grid
    zero = torch.round(-lo / s).clamp(0, qmax)
    codes = torch.round(xf / s.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, qmax).to(torch.uint8)
    return codes, scale, zero.to(torch.uint8)


def dequantize_per_token(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 ``(codes - zero) * scale`` (``codes [..., D]``, ``scale``/``zero [...]``)."""
    return (codes.float() - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D]`` codes in ``[0, 16)`` → ``[..., D/2]``: low nibble channel ``j``, high nibble ``j + D/2``."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


class PagedKVCache:
    """The KV pool of one engine: per layer, keys and values (and their scales) for every slot.

    Layout (private to this class and its backend): head-major ``[KVH, num_blocks * block_size, W]`` with
    ``W = head_dim`` (16-bit, int8) or ``head_dim / 2`` (int4, packed); scales and zero points
    ``[KVH, num_blocks * block_size]``. Gathering a sequence's slots yields the ``[KVH, tokens, D]`` operand
    attention multiplies with, without a transpose copy.

    ``compute_dtype``: the dtype :meth:`gather` returns (the model's activations). ``params``: calibrated key
    parameters (quantized dtypes only). Raises ``ValueError`` when ``params`` do not fit the spec, and
    ``RuntimeError``/``MemoryError`` when the pool cannot be allocated.
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str, compute_dtype: torch.dtype,
                 params: KVQuantParams | None = None) -> None:
        self.spec, self.device, self.compute_dtype = spec, torch.device(device), compute_dtype
        if params is not None:
            if not spec.quantized:
                raise ValueError("calibrated KV parameters apply to int8/int4 caches only")
            bad = params.mismatch(spec.num_layers, spec.num_kv_heads, spec.head_dim)
            if bad:
                raise ValueError(f"the KV parameters do not fit this model ({bad})")
        self.params = params
        n = spec.num_blocks * spec.block_size
        kvh, d = spec.num_kv_heads, spec.head_dim
        if spec.quantized:
            width = d // 2 if spec.dtype == "int4" else d
            store, dt = (kvh, n, width), torch.uint8
        else:
            store, dt = (kvh, n, d), _FLOAT_KV[spec.dtype]
        self.k = [torch.zeros(store, dtype=dt, device=self.device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(store, dtype=dt, device=self.device) for _ in range(spec.num_layers)]
        if spec.quantized:
            # a never-written slot dequantizes to 0 (scale 0 x (code 0 - zero 0)), never NaN
            self.k_scale, self.k_zero, self.v_scale, self.v_zero = (
                [torch.zeros((kvh, n), dtype=dt_, device=self.device) for _ in range(spec.num_layers)]
                for dt_ in (torch.float16, torch.uint8, torch.float16, torch.uint8))
            if params is not None:
                # [L, KVH, 1, D] so that they broadcast over [KVH, tokens, D]
                self._shift = params.k_shift.to(self.device).unsqueeze(2)
                self._cscale = params.k_scale.to(self.device).unsqueeze(2)
                self._k_rot, self._v_rot = params.k_rotate.tolist(), params.v_rotate.tolist()
                self._h = hadamard(spec.head_dim).to(self.device) if any(self._k_rot + self._v_rot) else None

    # --- facts ---------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes actually allocated (equals ``spec.total_bytes()``)."""
        tensors = self.k + self.v
        if self.spec.quantized:
            tensors = tensors + self.k_scale + self.k_zero + self.v_scale + self.v_zero
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def calibrated(self) -> bool:
        """Whether calibrated key parameters are in use."""
        return self.params is not None and self.params.mode == "calibrated"

    @property
    def transform(self) -> str:
        """What the cache stores: ``"none"`` (16-bit, or plain per-token int8/int4), ``"rotated"`` or
        ``"calibrated"`` (:class:`KVQuantParams`)."""
        return "none" if self.params is None else self.params.mode

    def storage_key(self) -> str:
        """Identifies the stored form: dtype, and the calibration digest when calibrated. Saved KV loads into
        a cache only when the keys are equal."""
        return self.spec.dtype + (f"+kcal:{self.params.digest()}" if self.params is not None else "")

    # --- write / read ----------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``k, v [T, KVH, D]`` (any float dtype) of ``layer`` at ``slots [T]`` (int64), quantizing if the
        cache is int8/int4 (per token and head; with calibrated parameters after their transform)."""
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, T, D]
        if not self.spec.quantized:
            self.k[layer].index_copy_(1, slots, kt.to(self.k[layer].dtype))
            self.v[layer].index_copy_(1, slots, vt.to(self.v[layer].dtype))
            return
        kt, vt = self.stored_space(layer, kt, vt)
        for x, store, sc, zp in ((kt, self.k, self.k_scale, self.k_zero), (vt, self.v, self.v_scale, self.v_zero)):
            codes, scale, zero = quantize_per_token(x, self.spec.bits)
            if self.spec.dtype == "int4":
                codes = pack_int4(codes)
            store[layer].index_copy_(1, slots, codes)
            sc[layer].index_copy_(1, slots, scale)
            zp[layer].index_copy_(1, slots, zero)

    def stored_space(self, layer: int, kt: torch.Tensor, vt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[KVH, T, D]`` mapped into the space they are quantized in: ``H((k - shift) / scale)``
        and ``H v`` for calibrated layers (float32), unchanged otherwise."""
        if self.params is None:
            return kt, vt
        kt = (kt.float() - self._shift[layer]) / self._cscale[layer]
        if self._k_rot[layer]:
            kt = kt @ self._h
        if self._v_rot[layer]:
            vt = vt.float() @ self._h
        return kt, vt

    def attention_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q [T, H, D]`` in the space of :meth:`gather`'s keys (same dtype): for calibrated keys
        ``H (q * k_scale)`` (per query head with its KV head's scale), so that ``q̃ · k''`` equals
        ``q · (k - k_shift)``; ``q`` itself otherwise."""
        if self.params is None:
            return q
        t, h, d = q.shape
        kvh = self.spec.num_kv_heads
        qt = q.float().view(t, kvh, h // kvh, d) * self._cscale[layer].view(1, kvh, 1, d)
        if self._k_rot[layer]:
            qt = qt @ self._h
        return qt.view(t, h, d).to(q.dtype)

    def attention_output(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """Attention output ``o [T, H, D]`` computed with :meth:`gather`'s values, back in the model's space
        (``o @ H`` where the values are stored rotated; ``o`` itself otherwise)."""
        if self.params is None or not self._v_rot[layer]:
            return o
        return (o.float() @ self._h).to(o.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots [n]`` (int64) as ``[KVH, n, D]`` in ``compute_dtype``, for attention:
        ``softmax(attention_query(q) · K) V`` followed by :meth:`attention_output` is the attention over the
        cached keys and values. 16-bit and online int8/int4 caches return the (dequantized) values themselves;
        calibrated ones return them in their stored space (dequantized in float32, then cast)."""
        if not self.spec.quantized:
            k, v = self.k[layer].index_select(1, slots), self.v[layer].index_select(1, slots)
            if k.dtype != self.compute_dtype:
                k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
            return k, v
        k = self._dequant(self.k[layer], self.k_scale[layer], self.k_zero[layer], slots)
        v = self._dequant(self.v[layer], self.v_scale[layer], self.v_zero[layer], slots)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def _dequant(self, store, scale, zero, slots) -> torch.Tensor:
        codes = store.index_select(1, slots)
        if self.spec.dtype == "int4":
            codes = unpack_int4(codes)
        return dequantize_per_token(codes, scale.index_select(1, slots), zero.index_select(1, slots))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the cache holds for ``slots [n]``, ``[n, KVH, D]`` float32, in the model's space
        (calibrated transforms inverted, shift added back); for inspection and tests, attention uses :meth:`gather`."""
        if not self.spec.quantized:
            k, v = self.k[layer].index_select(1, slots).float(), self.v[layer].index_select(1, slots).float()
        else:
            k = self._dequant(self.k[layer], self.k_scale[layer], self.k_zero[layer], slots)
            v = self._dequant(self.v[layer], self.v_scale[layer], self.v_zero[layer], slots)
            if self.params is not None:
                if self._k_rot[layer]:
                    k = k @ self._h
                k = k * self._cscale[layer] + self._shift[layer]
                if self._v_rot[layer]:
                    v = v @ self._h
        return k.transpose(0, 1), v.transpose(0, 1)

    # --- save / restore in the stored form ----------------------------------------------------------------
    def _tensors(self, layer: int) -> dict[str, torch.Tensor]:
        out = {"k": self.k[layer], "v": self.v[layer]}
        if self.spec.quantized:
            out.update(k_scale=self.k_scale[layer], k_zero=self.k_zero[layer], v_scale=self.v_scale[layer],
                       v_zero=self.v_zero[layer])
        return out

    def export(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored form of ``slots [n]`` for every layer, on CPU: ``"{name}.{layer}"`` → ``[n, KVH, ...]``
        (``name`` in k, v and, when quantized, k_scale, k_zero, v_scale, v_zero)."""
        slots = slots.to(self.device)
        out = {}
        for layer in range(self.spec.num_layers):
            for name, t in self._tensors(layer).items():
                out[f"{name}.{layer}"] = t.index_select(1, slots).transpose(0, 1).cpu().contiguous()
        return out

    def load(self, tensors: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        """Write what :meth:`export` returned (from a cache with the same :meth:`storage_key` and model shape)
        into ``slots [n]``. Raises ``ValueError`` naming the first tensor that is missing or has the wrong
        shape or dtype; nothing is written then."""
        slots = slots.to(self.device)
        n = slots.shape[0]
        for layer in range(self.spec.num_layers):  # check everything before writing anything
            for name, t in self._tensors(layer).items():
                got = tensors.get(f"{name}.{layer}")
                want = (n,) + (t.shape[0],) + tuple(t.shape[2:])
                if got is None or tuple(got.shape) != want or got.dtype != t.dtype:
                    raise ValueError(f"saved KV tensor {name}.{layer} is missing or not {t.dtype} of shape {want}")
                if got.is_floating_point() and not torch.isfinite(got).all():
                    raise ValueError(f"saved KV tensor {name}.{layer} holds NaN or inf")
                if name.endswith("_scale") and not bool((got.float() >= _FP16_MIN_NORMAL).all()):
                    raise ValueError(f"saved KV tensor {name}.{layer} holds scales below 2^-14, which no write makes")
                if name.endswith("_zero") and got.numel() and int(got.max()) >= (1 << self.spec.bits):
                    raise ValueError(f"saved KV tensor {name}.{layer} holds zero points beyond {self.spec.bits} bits")
        for layer in range(self.spec.num_layers):
            for name, t in self._tensors(layer).items():
                t.index_copy_(1, slots, tensors[f"{name}.{layer}"].to(self.device).transpose(0, 1))
