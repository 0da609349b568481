"""The fused rotary + KV write Triton kernel (backends/triton/rotary.py, in Triton's interpreter without a GPU) against
the torch reference (:meth:`Backend.rotary` then :meth:`PagedKVCache.write`), on strided views of a fused QKV output
with scattered slots: float32 bit for bit; 16-bit within one unit in the last place (the interpreter's float32 →
bfloat16 conversion truncates); other slots untouched; int8/int4 caches get the same codes as the reference path."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from backends import KVCacheSpec, get_backend  # noqa: E402
from backends.torch_backend import TorchBackend  # noqa: E402

from conftest import usable_backends  # noqa: E402

pytestmark = pytest.mark.skipif("triton" not in usable_backends(), reason="triton cannot run here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(t, h, kvh, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    ang = torch.rand(t, 1, d, generator=g) * 6.28
    return q, k, v, ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("t, h, kvh, d", [(1, 4, 2, 16), (5, 6, 2, 64), (3, 3, 3, 48)])
def test_rotary_write_equals_the_reference(kv, t, h, kvh, d):
    dtype = torch.float32 if kv in ("float32", "int8", "int4") else torch.bfloat16
    tri, ref = get_backend("triton", DEVICE), TorchBackend(DEVICE, cpu_kernels=False)
    spec = KVCacheSpec(kv, 8, 4, 1, kvh, d)
    caches = [be.allocate_kv_cache(spec, dtype) for be in (tri, ref)]
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(t))[:t].to(DEVICE)
    q, k, v, cos, sin = _inputs(t, h, kvh, d, dtype, seed=t + d)
    got = tri.rotary_write(q, k, v, cos, sin, caches[0], 0, slots)
    want = ref.rotary_write(q, k, v, cos, sin, caches[1], 0, slots)
    ulp = 0 if dtype == torch.float32 else 2.0 ** -7
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp * 4 if ulp else 0)
    for a, b in zip((*caches[0].k, *caches[0].v), (*caches[1].k, *caches[1].v)):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=ulp, atol=ulp * 4 if ulp else 0)
        else:  # codes: equal but for a rare rounding step at a bf16 ulp (float32 here: exactly)
            assert torch.equal(a, b)
    written = torch.zeros(32, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    assert (caches[0].k[0][:, ~written] == 0).all() and (caches[0].v[0][:, ~written] == 0).all()


def test_rotary_alone_equals_the_reference():
    q, k, _, cos, sin = _inputs(7, 4, 2, 32, torch.float32, seed=3)
    tri, ref = get_backend("triton", DEVICE), TorchBackend(DEVICE, cpu_kernels=False)
    for a, b in zip(tri.rotary(q, k, cos, sin), ref.rotary(q, k, cos, sin)):
        assert torch.equal(a, b)
