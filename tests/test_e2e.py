"""End-to-end tuning (lite/e2e.py, `--e2e-steps`): gradients against float64 autograd references, and a pipeline run
on a tiny Llama that keeps every code, changes only scales and norms, lowers the held-out KL and still loads."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lite.e2e import _QuantLinearFn, _RMSNormFn, _SiluMulFn
from lite.formats import LiteturboError
from lite.pipeline import PipelineConfig, quantize_model
from tests.test_lite_pipeline import OPTS, _save_tiny


@pytest.mark.parametrize("contiguous", [True, False])
def test_quant_linear_matches_float64_autograd(contiguous):
    torch.manual_seed(0)
    codes = torch.randint(-8, 8, (6, 16), dtype=torch.int8)
    gidx = None if contiguous else torch.randint(0, 4, (16,))
    s = torch.rand(4, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64)
    y = _QuantLinearFn.apply(x, codes, s, gidx, b, torch.float64)
    g = torch.randn_like(y)
    gx, gs = torch.autograd.grad(y, (x, s), g)
    sr, xr = s.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    w = codes.double() * sr[gidx if gidx is not None else torch.arange(16) // 4].t()
    yr = xr @ w.t() + b
    gxr, gsr = torch.autograd.grad(yr, (xr, sr), g)
    assert torch.allclose(y, yr, atol=1e-12)
    assert torch.allclose(gx, gxr, atol=1e-12)
    assert torch.allclose(gs, gsr, rtol=1e-5, atol=1e-5)  # the group sums run in float32
    assert gs.abs().max() > 0.1


def test_rmsnorm_and_silu_mul_match_autograd():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, requires_grad=True)
    w = (1 + 0.3 * torch.randn(32)).requires_grad_()
    y = _RMSNormFn.apply(x, w, 1e-6)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), g.double())
    assert torch.allclose(y.double(), yr, atol=1e-5) and torch.allclose(gx.double(), gxr, atol=1e-4)
    assert torch.allclose(gw.double(), gwr, atol=1e-4)
    a, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    y = _SiluMulFn.apply(a, u)
    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, (a, u), g)
    ref = torch.autograd.grad(F.silu(a) * u, (a, u), g)
    assert torch.allclose(y, F.silu(a) * u) and all(torch.allclose(p, q, atol=1e-6) for p, q in zip(ours, ref))


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors"])
def test_pipeline_e2e_keeps_codes_and_lowers_the_held_out_kl(tmp_path, smollm2_path, fmt):
    src = _save_tiny(tmp_path / "src", smollm2_path)
    opts = dict(OPTS, calib_samples=6, out_format=fmt)
    plain = quantize_model(str(src), PipelineConfig(method="gptq", **opts), str(tmp_path / "plain"))
    tuned = quantize_model(str(src), PipelineConfig(method="gptq", e2e_steps=8, **opts), str(tmp_path / "tuned"))
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert a.keys() == b.keys()
    codes = "qweight" if fmt == "awq" else "weight_packed"
    scales = "scales" if fmt == "awq" else "weight_scale"
    changed = {k.rsplit(".", 1)[-1] for k in a if not torch.equal(a[k], b[k])}
    assert codes not in changed and scales in changed and "weight" in changed  # norms change; codes do not
    assert {k for k in a if not torch.equal(a[k], b[k]) and k.endswith(".weight")} <= {
        k for k in a if k.endswith("norm.weight")}
    info = json.loads((tuned / "liteturbo_quantize.json").read_text())["e2e"]
    assert info["steps"] == 8 and info["kept"] is True
    assert (info["train_windows"], info["held_out_windows"]) == (4, 2)  # 6 windows: 2 held out, 8 steps cycle 4
    assert info["held_out_kl_after"] < info["held_out_kl_before"]
    from turbo import Engine

    out = Engine(str(tuned)).generate([[1, 2, 3, 4, 5]], max_new_tokens=3, ignore_eos=True)
    assert len(out[0].token_ids) == 3  # turbo loads the tuned checkpoint in its format


@pytest.mark.parametrize("over, message", [
    (dict(e2e_steps=-1), "--e2e-steps must be >= 0"),
    (dict(e2e_steps=2, rotate=True), "--e2e-steps and --rotate cannot be combined"),
    (dict(method="rtn", e2e_steps=2), "needs calibration data"),
])
def test_bad_e2e_options_are_named(over, message):
    with pytest.raises(LiteturboError, match=message):
        PipelineConfig(**{"method": "gptq", **over})


def test_e2e_that_cannot_fit_is_refused_before_any_work(tmp_path, smollm2_path, monkeypatch):
    """--e2e-steps holds the whole float model: with less memory than its estimate the run stops at once (no
    .partial folder, no output), naming both sizes and the fix; at the real 8B shape on this machine's 24 GiB it
    would not fit."""
    import lite.memory as memory

    src = _save_tiny(tmp_path / "src", smollm2_path)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)
    out = tmp_path / "tuned"
    with pytest.raises(LiteturboError, match=r"--e2e-steps 8 would need about .* GiB of host memory .* but 0\.0 GiB "
                                             r"is available.*Run without --e2e-steps"):
        quantize_model(str(src), PipelineConfig(method="gptq", e2e_steps=8, **dict(OPTS, calib_samples=6)), str(out))
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    monkeypatch.setenv("LITETURBO_SKIP_MEMORY_CHECK", "1")
    memory.check_e2e_fits({"hidden_size": 4096}, "gptq", 128, 512, 8, torch.device("cpu"), room=1)  # skipped
    monkeypatch.delenv("LITETURBO_SKIP_MEMORY_CHECK")
    llama8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
               "head_dim": 128, "vocab_size": 128256, "num_hidden_layers": 32}
    with pytest.raises(LiteturboError, match="holds the whole float model as its teacher"):
        memory.check_e2e_fits(llama8b, "gptq", 128, 512, 40, torch.device("cpu"), room=24 << 30)
    memory.check_e2e_fits(llama8b, "gptq", 128, 512, 40, torch.device("cpu"), room=64 << 30)  # fits: no error
