"""Platforms and backend choice without the hardware: ROCm through a stand-in HIP build of torch, Ascend through a
stand-in ``torch_npu`` whose ops compute the documented formula on the CPU; ``liteturbo env``."""
from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import backends
from backends import AscendBackend, Platform, TorchBackend, TritonBackend, get_backend
from backends.ascend import NpuW4A16Handle
from backends.platform import current_platform
from backends.types import QuantizedWeight
from turbo.cli import main

GiB = 2**30
REPO = Path(__file__).resolve().parents[1]
OPS = {"linear", "w4a16_linear", "w8a16_linear", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "attention",
       "kv_write_int8", "kv_write_int4", "moe_route", "experts"}


# --- a stand-in torch_npu: the two vendor ops as documented, computed in float64 on the CPU --------------------
def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    nib = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(nib >= 8, nib - 16, nib)


def make_torch_npu(with_ops: bool = True) -> types.ModuleType:
    """``npu_convert_weight_to_int4pack(int32 (K, N), values in [-8, 7], N % 8 == 0) -> int32 (K, N/8)`` and
    ``npu_weight_quant_batchmatmul`` = ``x @ ((weight + offset) * scale) + bias``, checking the documented argument
    rules; every call is recorded in ``mod.calls`` with its float64 result."""
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.__version__ = "2.5.1.standin"
    mod.calls = []
    if not with_ops:
        return mod

    def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
        assert weight.dtype == torch.int32 and weight.dim() == 2 and weight.is_contiguous()
        assert weight.shape[-1] % 8 == 0, "last dim must be a multiple of 8"
        assert int(weight.min()) >= -8 and int(weight.max()) <= 7, "int4 values are in [-8, 7]"
        nib = (weight & 0xF).view(weight.shape[0], -1, 8)
        packed = torch.zeros(nib.shape[:2], dtype=torch.int32)
        for i in range(8):
            packed |= nib[..., i] << (4 * i)
        return packed

    def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
        assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
        w = _unpack_int4(weight) if weight.dtype == torch.int32 else weight.to(torch.int64)
        assert weight.dtype in (torch.int32, torch.int8)
        k, n = w.shape
        assert x.shape[1] == k
        assert antiquant_scale.dtype == x.dtype
        if antiquant_group_size == 0:
            assert tuple(antiquant_scale.shape) in ((1, n), (n,))
            s = antiquant_scale.double().reshape(1, n).expand(k, n)
            o = None if antiquant_offset is None else antiquant_offset.double().reshape(1, n).expand(k, n)
        else:
            g = antiquant_group_size
            assert g % 32 == 0 and 32 <= g <= k - 1, "group size: a multiple of 32 in [32, K-1]"
            assert tuple(antiquant_scale.shape) == (-(-k // g), n)
            s = antiquant_scale.double().repeat_interleave(g, 0)[:k]
            o = None if antiquant_offset is None else antiquant_offset.double().repeat_interleave(g, 0)[:k]
        if antiquant_offset is not None:
            assert antiquant_offset.dtype == antiquant_scale.dtype and antiquant_offset.shape == antiquant_scale.shape
        wd = w.double() if o is None else w.double() + o
        y = x.double() @ (wd * s)
        if bias is not None:
            assert bias.dtype == (torch.float32 if x.dtype == torch.bfloat16 else torch.float16)
            y = y + bias.double()
        mod.calls.append({"group_size": antiquant_group_size, "weight_dtype": weight.dtype, "y64": y})
        return y.to(x.dtype)

    mod.npu_convert_weight_to_int4pack = npu_convert_weight_to_int4pack
    mod.npu_weight_quant_batchmatmul = npu_weight_quant_batchmatmul
    return mod


@pytest.fixture
def torch_npu(monkeypatch):
    mod = make_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod


def random_qw(out_f=64, in_f=256, gs=64, bits=4, g_idx=None, bias=False, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    groups = 1 if gs == -1 else (in_f + gs - 1) // gs
    return QuantizedWeight(
        bits=bits, group_size=gs, sym=False,
        qweight=torch.randint(0, 2**bits, (out_f, in_f), generator=g).to(torch.uint8),
        qzeros=torch.randint(0, 2**bits, (groups, out_f), generator=g).to(torch.uint8),
        scales=(torch.rand(groups, out_f, generator=g) * 0.02 + 0.001).to(torch.float16),
        g_idx=g_idx, bias=(torch.randn(out_f, generator=g) * 0.1).to(torch.float16) if bias else None)


def reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float64 ``x @ W.T + b`` with W dequantized in float64, its scales rounded to ``x``'s dtype first (the kernel
    takes scales in the activation dtype: exact for float16 scales and float16 activations)."""
    qw = dataclasses.replace(qw, scales=qw.scales.to(x.dtype))
    y = x.double() @ qw.dequantize(torch.float64).T
    return y if qw.bias is None else y + qw.bias.double()


# --- Ascend: the vendor W4A16 path ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,gs,bias", [(torch.float16, 64, False), (torch.bfloat16, 128, True),
                                           (torch.float16, -1, True), (torch.float16, 32, False)])
def test_ascend_w4a16_vendor_matches_float64_dequantized_reference(torch_npu, dtype, gs, bias):
    qw = random_qw(gs=gs, bias=bias)
    be = AscendBackend(device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the vendor path must not warn
        h = be.prepare_w4a16(qw, dtype)
    assert isinstance(h, NpuW4A16Handle)
    assert h.weight.dtype == torch.int32 and tuple(h.weight.shape) == (256, 64 // 8)
    assert h.group_size == (0 if gs == -1 else gs)
    assert h.scale.dtype == h.offset.dtype == dtype
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = be.w4a16_linear(x, h)
    assert y.dtype == dtype and tuple(y.shape) == (5, 64)
    call = torch_npu.calls[-1]
    # the kernel's float64 result with our prepared arguments is the canonical dequantized product
    assert (call["y64"] - reference(x, qw)).abs().max().item() < 1e-12
    assert torch.equal(y, call["y64"].to(dtype))


def test_ascend_w4a16_act_order_permutes_inputs(torch_npu):
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    g_idx = (perm // 64).to(torch.int32)  # every group still has 64 channels, scattered over the inputs
    qw = random_qw(gs=64, g_idx=g_idx)
    be = AscendBackend(device="cpu")
    h = be.prepare_w4a16(qw, torch.float16)
    assert isinstance(h, NpuW4A16Handle) and h.in_perm is not None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    be.w4a16_linear(x, h)
    assert (torch_npu.calls[-1]["y64"] - reference(x, qw)).abs().max().item() < 1e-12


@pytest.mark.parametrize("kwargs,dtype,why", [
    (dict(gs=16, in_f=256), torch.float16, "group size 16"),
    (dict(gs=256, in_f=512), torch.float16, None),  # 256 in [32, 511]: vendor path
    (dict(out_f=12), torch.float16, "out_features=12 is not a multiple of 8"),
    (dict(bits=8), torch.float16, "bits=8"),
    (dict(), torch.float32, "compute dtype float32"),
    (dict(gs=64, g_idx=torch.tensor([0] * 96 + [1] * 32 + [2] * 64 + [3] * 64, dtype=torch.int32)), torch.float16,
     "act-order g_idx"),
])
def test_ascend_w4a16_falls_back_with_one_warning(torch_npu, kwargs, dtype, why):
    qw = random_qw(**kwargs)
    be = AscendBackend(device="cpu")
    if why is None:
        assert isinstance(be.prepare_w4a16(qw, dtype), NpuW4A16Handle)
        return
    with pytest.warns(RuntimeWarning, match=rf"w4a16_linear uses dequantize \+ matmul instead of "
                                            rf"torch_npu.npu_weight_quant_batchmatmul: .*{why}"):
        h = be.prepare_w4a16(qw, dtype)
    assert not isinstance(h, NpuW4A16Handle)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per backend
        h2 = be.prepare_w4a16(qw, dtype)
    x = torch.randn(4, qw.in_features, generator=torch.Generator().manual_seed(2)).to(dtype)
    n = len(torch_npu.calls)
    y = be.w4a16_linear(x, h2)
    assert len(torch_npu.calls) == n  # the vendor op is not called
    ref = x @ qw.dequantize(dtype).T  # the torch backend's dequantize + matmul
    assert torch.equal(y, ref)


def test_ascend_without_vendor_op_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", make_torch_npu(with_ops=False))
    be = AscendBackend(device="cpu")
    with pytest.warns(RuntimeWarning, match="torch_npu has no npu_weight_quant_batchmatmul"):
        be.prepare_w4a16(random_qw(), torch.float16)
    cov = AscendBackend.op_coverage(None)
    assert cov["w4a16_linear"] == "dequantize + matmul fallback (this torch_npu has no npu_weight_quant_batchmatmul)"


def test_ascend_w8a16_vendor_per_channel(torch_npu):
    be = AscendBackend(device="cpu")
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(5))
    h = be.prepare_w8a16(w, torch.bfloat16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y = be.w8a16_linear(x, h)
    call = torch_npu.calls[-1]
    assert call["weight_dtype"] == torch.int8 and call["group_size"] == 0
    q, scales = h
    ref = x.double() @ (q.double() * scales.double()[:, None]).T
    assert (call["y64"] - ref).abs().max().item() < 1e-12
    assert y.dtype == torch.bfloat16


def test_ascend_cannot_run_batch_invariant(torch_npu):
    with pytest.raises(NotImplementedError, match=r"batch_invariant=True.*fallback: backend='torch' on device='cpu'"):
        AscendBackend(device="cpu", batch_invariant=True)


def test_ascend_needs_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        AscendBackend(device="cpu")
    be = AscendBackend(device="cpu", vendor_ops=False)  # the torch reference path only
    with pytest.warns(RuntimeWarning, match="torch_npu has no"):
        be.prepare_w4a16(random_qw(), torch.float16)


def test_ascend_runs_the_torch_reference_ops(torch_npu):
    be, ref = AscendBackend(device="cpu"), TorchBackend(device="cpu", cpu_kernels=False)
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, generator=g)
    assert torch.equal(be.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    gu = torch.randn(4, 16, generator=g)
    assert torch.equal(be.silu_and_mul(gu), ref.silu_and_mul(gu))


# --- registration and the automatic choice ----------------------------------------------------------------------
def test_ascend_is_registered_and_refuses_other_devices(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # else triton is usable (interpreted) on the CPU
    assert backends.backend_classes()["ascend"] is AscendBackend
    assert "ascend" in backends.available_backends()
    with pytest.raises(ValueError, match=r"backend 'ascend' cannot run on cpu \(cpu\): needs an Ascend NPU "
                                         r"\(torch_npu\); this device is cpu .*use backend='torch'"):
        get_backend("ascend", "cpu")
    assert current_platform("cpu").default_backend() == "torch"


def test_auto_picks_ascend_on_an_npu_platform(torch_npu, monkeypatch):
    plat = Platform("npu", torch.device("cpu"), "Ascend910B3", 64 * GiB)  # torch has no "npu" device here
    assert plat.usable_backends() == ["ascend", "torch"]
    assert plat.default_backend() == "ascend"
    monkeypatch.setattr(backends, "current_platform", lambda device: plat)
    be = get_backend("auto", "npu")
    assert isinstance(be, AscendBackend) and be.npu is torch_npu
    cov = AscendBackend.op_coverage(plat)
    assert set(cov) == OPS
    assert cov["w4a16_linear"].startswith("vendor torch_npu.npu_weight_quant_batchmatmul")
    assert cov["attention"].startswith("torch reference on npu")


def test_npu_detection_end_to_end_in_a_subprocess():
    """As torch_npu does: rename the privateuse1 backend to "npu" and register ``torch.npu`` (irreversible, hence
    a fresh interpreter); then ``auto`` resolves to the NPU, picks ascend, and ``liteturbo env`` lists it."""
    script = textwrap.dedent("""
        import importlib.machinery, json, sys, types
        import torch
        mod = types.ModuleType("torch_npu"); mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        mod.__version__ = "2.5.1.standin"
        sys.modules["torch_npu"] = mod
        torch.cuda.is_available = lambda: False  # an Ascend host has no CUDA device (this test also runs on GPUs)
        torch.cuda.device_count = lambda: 0
        torch.utils.rename_privateuse1_backend("npu")
        torch._register_device_module("npu", types.SimpleNamespace(
            is_available=lambda: True, device_count=lambda: 1, get_device_name=lambda i=0: "Ascend910B3",
            get_device_properties=lambda i=0: types.SimpleNamespace(total_memory=64 * 2**30),
            mem_get_info=lambda d=None: (60 * 2**30, 64 * 2**30)))
        from backends import get_backend
        from backends.platform import current_platform
        from turbo.cli import env_report
        p = current_platform("auto")
        b = get_backend("auto", "auto")
        r = env_report("auto")
        print(json.dumps({"kind": p.kind, "device": str(p.device), "name": p.name, "mem": p.total_memory,
                          "free": p.free_memory(), "dtype": str(p.default_dtype()), "backend": type(b).__name__,
                          "bdev": str(b.device), "npus": r["hardware"]["npus"], "torch_npu": r["software"]["torch_npu"],
                          "ascend": r["backends"]["ascend"]}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["kind"], r["device"], r["name"], r["mem"], r["free"]) == ("npu", "npu:0", "Ascend910B3", 64 * GiB,
                                                                         60 * GiB)
    assert r["dtype"] == "torch.float16" and (r["backend"], r["bdev"]) == ("AscendBackend", "npu:0")
    assert r["npus"] == [{"index": 0, "name": "Ascend910B3", "total_memory_bytes": 64 * GiB}]
    assert r["torch_npu"] == "2.5.1.standin"
    assert r["ascend"]["usable"] and r["ascend"]["default"] and r["ascend"]["reason"] is None


@pytest.fixture
def rocm(monkeypatch):
    """A HIP build of torch with one MI300X (stand-ins for what torch.cuda reports)."""
    props = types.SimpleNamespace(name="AMD Instinct MI300X", total_memory=192 * GiB, major=9, minor=4)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (180 * GiB, 192 * GiB))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return props


def test_rocm_is_detected_through_hip_builds(rocm):
    for dev in ("cuda", "auto", "cuda:0"):
        p = current_platform(dev)
        assert (p.kind, str(p.device), p.name, p.total_memory) == ("rocm", "cuda:0", "AMD Instinct MI300X", 192 * GiB)
        assert p.is_gpu and p.free_memory() == 180 * GiB and p.supports_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="this machine has 1 GPU"):
        current_platform("cuda:1")


def test_cuda_without_hip_is_cuda(rocm, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert current_platform("cuda").kind == "cuda"


def test_rocm_prefers_triton_when_it_can_run(rocm, monkeypatch):
    monkeypatch.setattr(TritonBackend, "unsupported_reason", classmethod(lambda cls, p: None))
    p = current_platform("cuda")
    assert p.usable_backends() == ["triton", "torch"] and p.default_backend() == "triton"
    monkeypatch.setattr(TritonBackend, "unsupported_reason", classmethod(lambda cls, p: "no triton here"))
    assert current_platform("cuda").default_backend() == "torch"
    be = get_backend("auto", "cuda")  # the torch reference on the GPU
    assert type(be) is TorchBackend and str(be.device) == "cuda:0"
    with pytest.raises(ValueError, match=r"'ascend' cannot run on rocm \(cuda:0\): needs an Ascend NPU"):
        get_backend("ascend", "cuda")


def test_torch_op_coverage_names_every_op():
    cpu = TorchBackend.op_coverage(current_platform("cpu"))
    assert set(cpu) == OPS
    from backends import cpu_ext

    assert "torch int4pack kernel (aten._weight_int4pack_mm_for_cpu)" in cpu["w4a16_linear"]
    assert ("liteturbo's C++ W4A16 kernels" in cpu["w4a16_linear"]) == cpu_ext.w4_tiles_expected()
    gpu = TorchBackend.op_coverage(Platform("rocm", torch.device("cpu"), "stand-in", GiB))
    assert gpu["w4a16_linear"] == "dequantize + matmul" and gpu["w8a16_linear"] == "dequantize + matmul"


# --- liteturbo env ----------------------------------------------------------------------------------------------
def test_env_json(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = CliRunner().invoke(main, ["env", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["platform"]["kind"] == "cpu" and r["platform"]["default_backend"] == "torch"
    assert r["hardware"]["logical_cores"] >= 1 and r["hardware"]["ram_total_bytes"] > 0
    assert r["hardware"]["npus"] == [] and isinstance(r["hardware"]["cpu_flags"], list)
    assert r["software"]["torch"] == torch.__version__ and r["software"]["triton_interpret"] is False
    assert r["software"]["TRITON_INTERPRET"] is None
    b = r["backends"]
    assert set(b) >= {"torch", "triton", "ascend"}
    assert b["torch"]["usable"] and b["torch"]["default"] and b["torch"]["reason"] is None
    assert b["torch"]["ops"] == TorchBackend.op_coverage(current_platform("cpu"))
    triton_why = TritonBackend.unsupported_reason(current_platform("cpu"))
    assert b["triton"]["reason"] == triton_why and b["triton"]["usable"] == (triton_why is None)
    assert not b["ascend"]["usable"] and b["ascend"]["reason"].startswith("needs an Ascend NPU (torch_npu)")
    for entry in b.values():
        assert set(entry["ops"]) >= OPS


def test_env_with_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = json.loads(CliRunner().invoke(main, ["env", "--json", "--device", "cpu"]).output)
    assert r["software"]["triton_interpret"] is True and r["software"]["TRITON_INTERPRET"] == "1"
    triton_why = TritonBackend.unsupported_reason(current_platform("cpu"))
    assert r["backends"]["triton"]["usable"] == (triton_why is None)
    assert r["platform"]["default_backend"] == current_platform("cpu").default_backend()


def test_env_table_and_bad_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = CliRunner().invoke(main, ["env", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "platform" and "hardware" in lines and "software" in lines and "op coverage" in lines
    assert any(line.split() == ["torch", "usable,", "default"] for line in lines)
    assert any(line.startswith("  ascend  not usable: needs an Ascend NPU") for line in lines)
    assert any(line.strip().startswith("w4a16_linear") for line in lines)
    bad = CliRunner().invoke(main, ["env", "--device", "tpu"])
    assert bad.exit_code == 2 and "device must be one of auto, cpu, cuda, npu" in bad.output


@pytest.mark.parametrize("bad", ["cpu:1", "cpu:-3", "cuda:x", "cuda:-1", "npu:abc", "mps", "", None, 5])
def test_malformed_devices_are_refused_with_the_choices(bad):
    from backends import current_platform

    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, npu"):
        current_platform(bad)


def test_device_and_backend_spellings():
    from backends import current_platform, get_backend
    from turbo.config import EngineConfig

    assert current_platform(" CPU ").kind == "cpu" and current_platform(torch.device("cpu")).kind == "cpu"
    assert get_backend(" Torch ", "cpu").name == "torch"
    cfg = EngineConfig(device=torch.device("cpu"), backend="TORCH")
    assert cfg.device == "cpu" and cfg.backend == "torch"
    with pytest.raises(ValueError, match="backend must be a name"):
        get_backend(None, "cpu")


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True),
                                      ("0", False), ("", False), ("false", False), ("2", False), (" 1", False)])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value, on):
    from backends.platform import triton_interpret

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpret() is on
    triton_c = pytest.importorskip("triton._C.libtriton")
    assert triton_c.getenv_bool("TRITON_INTERPRET", False) is on  # the same answer as Triton's own reader
