"""The lite pipeline as a new user meets it: one set of options for every method, format defaults that other tools
load, and bad input that loses nothing (no NaN/inf written, the same config/weights message as ``chat``, no
``.partial`` left by a refused run, raised GPTQ dampening reported)."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

import lite.awq
import lite.gptq
from lite.formats import LiteturboError
from lite.formats.registry import WEIGHT_FORMATS, weight_format
from lite.methods import AWQ, LayerBatch
from lite.pipeline import PipelineConfig, quantize_model
from turbo.cli import main

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2)
OPTS = dict(calib_samples=4, calib_seqlen=64, w_group_size=32, device="cpu", n_grid=4, loss_tokens=128)


def _save_tiny(path: Path, smollm2_path: Path, dtype=torch.float32, seed: int = 0, **over) -> Path:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**dict(TINY, **over)),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    hf.to(dtype).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_path / name, path / name)
    return path


# --- one pipeline, one set of options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["rtn"], ["auto-awq"], ["gptq"]])
def test_every_lite_command_takes_the_same_weight_options(cmd):
    out = CliRunner().invoke(main, ["lite", *cmd, "--help"]).output
    for opt in ("--format", "--device", "--resume", "--overwrite", "--w-sym / --w-asym", "--compute-dtype",
                "--mse-scales"):
        assert opt in out, (cmd, opt)


def test_format_defaults_are_what_readers_load():
    # GPTQ's default: compressed-tensors with zero points, act-order with static groups (vLLM and transformers read
    # it; vLLM refuses asymmetric GPTQ v1, and symmetric GPTQ was worse than RTN on SmolLM2), and it says so
    d = PipelineConfig(method="gptq")
    assert (d.out_format, d.w_sym, d.act_order, d.static_groups) == ("compressed-tensors", False, True, True)
    assert any("compressed-tensors with zero points" in c for c in d.choices)
    assert PipelineConfig(method="gptq", out_format="gptq").w_sym is True  # vLLM refuses asymmetric GPTQ v1
    a = PipelineConfig(method="awq", awq_rounding="gptq")
    assert (a.out_format, a.act_order, a.static_groups) == ("awq", True, True)
    r = PipelineConfig(method="awq")
    assert (r.act_order, r.static_groups, r.choices[-1].startswith("calibration mixture")) == (False, False, True)
    assert PipelineConfig(method="awq").w_sym is False and PipelineConfig(method="rtn").w_sym is False
    assert PipelineConfig(method="rtn", out_format="gptq").w_sym is True
    assert PipelineConfig(method="gptq", w_sym=False, out_format="compressed-tensors").w_sym is False
    assert weight_format("gptq").min_zero(False) == 1 and weight_format("gptq").min_zero(True) == 0
    assert set(WEIGHT_FORMATS) == {"awq", "gptq", "compressed-tensors"}
    with pytest.raises(LiteturboError, match="--format must be one of"):
        PipelineConfig(out_format="marlin")


def test_act_order_checkpoints_say_what_vllm_needs():
    """vLLM 0.32 refuses GPTQ desc_act=True and compressed-tensors actorder=group (a g_idx); static groups store
    the contiguous grouping and say so, and a g_idx run warns who reads it."""
    def qc(fmt, static):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = PipelineConfig(method="gptq", act_order=True, static_groups=static, out_format=fmt)
        warned = any("vLLM 0.32 refuses it" in str(w.message) for w in caught)
        return weight_format(fmt).config(cfg.format_options()), warned

    (g, warned), (gs, quiet) = qc("gptq", False), qc("gptq", True)
    assert g["desc_act"] is True and warned and gs["desc_act"] is False and gs["static_groups"] is True
    assert not quiet
    (c, _), (cs, _) = qc("compressed-tensors", False), qc("compressed-tensors", True)
    wq = lambda q: next(iter(q["config_groups"].values()))["weights"]  # noqa: E731
    assert wq(c)["actorder"] == "group" and wq(cs)["actorder"] == "static"


def test_act_order_options_are_checked_against_method_and_format():
    with pytest.raises(LiteturboError, match="use them with `lite gptq` or `lite auto-awq --rounding gptq`"):
        PipelineConfig(method="awq", act_order=True)
    for off in ({"act_order": False}, {"static_groups": False}):  # turning off what AWQ's rounding never does
        with pytest.raises(LiteturboError, match="use them with `lite gptq`"):
            PipelineConfig(method="awq", **off)
    with pytest.raises(LiteturboError, match="g_idx, which the AWQ format cannot store"):
        PipelineConfig(method="awq", awq_rounding="gptq", act_order=True, static_groups=False)
    # static groups keep the contiguous grouping: AWQ GEMM can store it
    PipelineConfig(method="awq", awq_rounding="gptq", act_order=True, static_groups=True)
    with pytest.raises(LiteturboError, match="only matters with --act-order"):
        PipelineConfig(method="gptq", act_order=False, static_groups=True)
    # the GPTQ options are the same for `gptq` and `auto-awq --rounding gptq`
    for cmd in (["gptq"], ["auto-awq"]):
        out = CliRunner().invoke(main, ["lite", *cmd, "--help"]).output
        assert all(o in out for o in ("--act-order", "--static-groups", "--damp-percent")), cmd
    PipelineConfig(method="awq", awq_rounding="gptq", damp_percent=0.1)
    with pytest.raises(LiteturboError, match="--damp-percent set GPTQ's rounding"):
        PipelineConfig(method="awq", damp_percent=0.1)


def test_rtn_writes_each_format_and_resumes(tmp_path, smollm2_path):
    src = _save_tiny(tmp_path / "src", smollm2_path)
    for fmt in WEIGHT_FORMATS:
        out = quantize_model(str(src), PipelineConfig(method="rtn", out_format=fmt, **OPTS), str(tmp_path / fmt))
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == weight_format(fmt).quant_method
    # lite rtn --resume continues an interrupted run (same fingerprint logic as the calibrated methods)
    cfg = PipelineConfig(method="rtn", **OPTS)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(src), cfg, str(tmp_path / "r"), stop_after_layers=1)
    assert (tmp_path / "r.partial" / "layer_0000.safetensors").is_file()
    out = quantize_model(str(src), cfg, str(tmp_path / "r"), resume=True)
    info = json.loads((out / "liteturbo_quantize.json").read_text())
    assert info["reused_layers"] == 1
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "awq" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- robustness -------------------------------------------------------------------------------------------------------
def test_scale_limit_keeps_folded_weight_finite_in_float16():
    prev = torch.tensor([60000.0, 1.0, -50000.0, 2.0])
    s = torch.tensor([0.1, 0.1, 0.5, 3.0])
    lim = lite.awq.activation_scale_limit(prev, s, torch.float16)
    assert lim is not None and torch.isfinite((prev / lim).half()).all()
    # beyond half of float16's range already: not allowed to grow (s >= 1); the others fit and keep their scale
    assert lim[0] == 1.0 and lim[2] == 1.0 and torch.equal(lim[1:2], s[1:2]) and torch.equal(lim[3:], s[3:])
    small = torch.tensor([20000.0, 1.0])
    lim2 = lite.awq.activation_scale_limit(small, torch.tensor([0.1, 0.1]), torch.float16)
    assert float(small[0] / lim2[0]) == pytest.approx(torch.finfo(torch.float16).max / 2) and float(lim2[1]) == pytest.approx(0.1)
    assert lite.awq.activation_scale_limit(prev, s, torch.float32) is None
    assert lite.awq.activation_scale_limit(prev, torch.ones(4), torch.float16) is None
    rows = torch.tensor([[1.0, 40000.0], [1.0, 1.0]])  # a linear's output rows (v_proj -> o_proj)
    lim = lite.awq.activation_scale_limit(rows, torch.tensor([0.2, 0.2]), torch.float16)
    assert torch.isfinite((rows / lim.unsqueeze(1)).half()).all() and float(lim[1]) == pytest.approx(0.2)


def test_awq_fold_that_would_overflow_float16_is_limited_and_keeps_the_float_model(monkeypatch):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**dict(TINY, vocab_size=96)),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.input_layernorm.weight[0] = 30000.0  # fine in float16, but not once divided by a scale < 0.55
            layer.self_attn.q_proj.weight[:, 0] /= 30000.0
            layer.self_attn.k_proj.weight[:, 0] /= 30000.0
            layer.self_attn.v_proj.weight[:, 0] /= 30000.0
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits

    def tiny_scale_search(weights, x_mean, *a, **k):
        s = torch.ones(weights[0].shape[1])
        s[0] = 0.01  # 30000 / 0.01 = 3e6: inf in float16
        return s, 0.5, 0.0

    monkeypatch.setattr(lite.awq, "search_scales", tiny_scale_search)
    method = AWQ(PipelineConfig(method="awq", w_group_size=32, clip=False, n_grid=2), "llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, layer in enumerate(hf.model.layers):
            store = []
            hd = layer.register_forward_pre_hook(
                lambda _m, args, kw: store.append((args[0] if args else kw["hidden_states"],
                                                   {k: v for k, v in kw.items() if k != "hidden_states"})),
                with_kwargs=True)
            with torch.no_grad():
                hf(ids, use_cache=False)
            hd.remove()
            method.layer_index = i
            method.fold_dtypes = {"input_layernorm": torch.float16, "post_attention_layernorm": torch.float16,
                                  "self_attn.v_proj": torch.float16, "mlp.up_proj": torch.float16}
            method.quantize_layer(layer, LayerBatch([store[0][0].detach()], [store[0][1]], torch.float32))
            assert torch.isfinite(layer.input_layernorm.weight.half()).all()
    assert any("AWQ scales limited" in str(w.message) for w in caught)
    assert [n["linear"] for n in method.notes].count("input_layernorm") == 2
    with torch.no_grad():
        out = hf(ids).logits
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5  # the fold is still exact in float32


def test_float16_checkpoint_never_gets_inf_from_the_fold(tmp_path, smollm2_path, monkeypatch):
    src = _save_tiny(tmp_path / "src", smollm2_path, dtype=torch.float16)

    def tiny_scale_search(weights, x_mean, *a, **k):
        return torch.full((weights[0].shape[1],), 1e-5), 0.5, 0.0  # norm weights ~1 / 1e-5: beyond float16

    monkeypatch.setattr(lite.awq, "search_scales", tiny_scale_search)
    out = quantize_model(str(src), PipelineConfig(method="awq", clip=False, **OPTS), str(tmp_path / "out"))
    for k, v in load_file(str(out / "model.safetensors")).items():
        if v.is_floating_point():
            assert torch.isfinite(v).all(), k
    notes = json.loads((out / "liteturbo_quantize.json").read_text())["notes"]
    assert any("AWQ scales limited" in n["event"] for n in notes)


def test_config_that_disagrees_with_weights_same_message_in_lite_and_chat(tmp_path, smollm2_path):
    src = _save_tiny(tmp_path / "src", smollm2_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["lite", "rtn", str(src), "--w-group-size", "32", "--work-dir",
                                  str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    lite_msg = r.output.strip().splitlines()[-1]
    assert "Traceback" not in r.output and "config.json does not belong to these weights" in lite_msg
    from turbo import Engine

    with pytest.raises(LiteturboError) as e:
        Engine(str(src))
    assert lite_msg == f"error: {e.value}"
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_refused_runs_leave_no_partial_folder(tmp_path, smollm2_path, monkeypatch):
    src = _save_tiny(tmp_path / "src", smollm2_path)
    out = tmp_path / "out"
    with pytest.raises(LiteturboError):  # refused before any work: bad calibration file
        quantize_model(str(src), PipelineConfig(method="awq", calib_dataset=str(tmp_path / "nope.txt"), **OPTS),
                       str(out))
    assert not Path(f"{out}.partial").exists()

    def refuse(self, layer, batch):
        raise LiteturboError("refused inside the layer loop")

    monkeypatch.setattr(AWQ, "quantize_layer", refuse)
    with pytest.raises(LiteturboError, match="inside the layer loop"):
        quantize_model(str(src), PipelineConfig(method="awq", **OPTS), str(out))
    assert not Path(f"{out}.partial").exists() and not out.exists()

    # killed (SIGTERM, as `kill` or `timeout` send) before the first layer: cleaned up as Ctrl-C is, and the
    # previous SIGTERM handler is back afterwards
    import os
    import signal

    def killed(self, layer, batch):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the run")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(AWQ, "quantize_layer", killed)
    with pytest.raises(SystemExit) as e:
        quantize_model(str(src), PipelineConfig(method="awq", **OPTS), str(out))
    assert e.value.code == 128 + signal.SIGTERM
    assert not Path(f"{out}.partial").exists() and not out.exists()
    assert signal.getsignal(signal.SIGTERM) is before


def test_raised_gptq_dampening_is_logged_and_in_the_provenance(tmp_path, smollm2_path, monkeypatch):
    src = _save_tiny(tmp_path / "src", smollm2_path)
    real = lite.gptq.gptq_quantize

    def indefinite(w, H, *a, **k):  # a Hessian that 1 % dampening cannot make positive definite (10 % can)
        shift = float(torch.linalg.eigvalsh(H.double()).min()) + 0.05 * float(torch.diag(H).mean())
        return real(w, H - shift * torch.eye(H.shape[0]), *a, **k)

    monkeypatch.setattr(lite.gptq, "gptq_quantize", indefinite)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = quantize_model(str(src), PipelineConfig(method="gptq", **OPTS), str(tmp_path / "out"))
    assert any("GPTQ dampening raised from 0.01 to 0.1" in str(w.message) for w in caught)
    notes = json.loads((out / "liteturbo_quantize.json").read_text())["notes"]
    raised = [n for n in notes if "damp_percent" in n]
    assert len(raised) == 2 * 7 and all(n["damp_percent"] == pytest.approx(0.1) for n in raised)
    assert {n["layer"] for n in raised} == {0, 1}


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
def test_lite_on_cuda_agrees_with_cpu(tmp_path, method):
    """--device cuda runs the same pipeline: float32 forwards on both sides give the same codes up to rounding ties."""
    from lite.formats import load_config, load_quantized_linears, load_state_dict, quantization_spec
    from tiny_models import save_word_tokenizer

    torch.manual_seed(0)
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**dict(TINY, vocab_size=2000)),
                                                  dtype=torch.float32).save_pretrained(src)
    save_word_tokenizer(src, 2000)
    opts = dict(OPTS, compute_dtype="float32")
    made = {}
    for dev in ("cpu", "cuda"):
        out = quantize_model(str(src), PipelineConfig(method=method, **dict(opts, device=dev)), str(tmp_path / dev))
        assert json.loads((out / "liteturbo_quantize.json").read_text())["device"] == dev
        made[dev] = load_quantized_linears(load_state_dict(out), quantization_spec(load_config(out)))
    assert made["cpu"].keys() == made["cuda"].keys() and len(made["cpu"]) == 14
    for k, a in made["cpu"].items():
        b = made["cuda"][k]
        assert float((a.qweight == b.qweight).float().mean()) >= 0.9, k
        da, db = a.dequantize(torch.float32), b.dequantize(torch.float32)
        assert float((da - db).norm() / da.norm()) <= 0.1, k


def test_block_tuning_lowers_the_layer_error_and_keeps_the_format():
    """lite.tune: starting from RTN codes, the tuned layer reproduces the float layer better on its samples, with
    codes in range, the same zero points and grouping (so the same on-disk format)."""
    from lite.rtn import quantize_rtn
    from lite.tune import tune_layer

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**dict(TINY, vocab_size=96)),
                                                       dtype=torch.float32).eval()
    layer = hf.model.layers[0]
    store = []
    hd = layer.register_forward_pre_hook(
        lambda _m, args, kw: store.append((args[0] if args else kw["hidden_states"],
                                           {k: v for k, v in kw.items() if k != "hidden_states"})), with_kwargs=True)
    with torch.no_grad():
        for s in range(4):
            hf(torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(s)), use_cache=False)
    hd.remove()
    inputs, kwargs = [h.detach() for h, _ in store], [kw for _, kw in store]
    targets = LayerBatch(inputs, kwargs).run(layer)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    qws = {n: quantize_rtn(layer.get_submodule(n).weight.data, 4, 32) for n in names}
    tuned, before, after = tune_layer(layer, qws, inputs, kwargs, targets, steps=60, batch=2)
    assert after < 0.9 * before, (before, after)
    for n in names:
        a, b = qws[n], tuned[n]
        assert torch.equal(a.qzeros, b.qzeros) and b.g_idx is None and b.scales.dtype == torch.float16
        assert int(b.qweight.max()) <= 15 and (b.qweight.int() - a.qweight.int()).abs().max() <= 1
    # and the loss it reports is the layer's: recompute with the tuned weights put in
    for n in names:
        layer.get_submodule(n).weight.data = tuned[n].dequantize(torch.float32)
    out = LayerBatch(inputs, kwargs).run(layer)
    got = sum(float((o - t).pow(2).mean()) for o, t in zip(out, targets)) / len(out)
    assert got == pytest.approx(after, rel=0.05)


def test_tuning_fits_the_float_trajectory_and_resumes_identically(tmp_path, smollm2_path, monkeypatch):
    """--tune-steps: each layer is fitted to the float model's own outputs (float layers all the way from the
    embeddings, AutoRound's targets), not to the float layer on inputs that already carry earlier layers' error;
    an interrupted tuned run resumes to the same checkpoint (the float trajectory advances through reused layers)."""
    import lite.tune

    src = _save_tiny(tmp_path / "src", smollm2_path)
    cfg = PipelineConfig(method="awq", tune_steps=3, compute_dtype="float32", **OPTS)
    seen, real = [], lite.tune.tune_layer

    def spy(layer, qws, inputs, kwargs, targets, *a, **kw):
        seen.append(([x.clone() for x in inputs], kwargs, [t.clone() for t in targets]))
        return real(layer, qws, inputs, kwargs, targets, *a, **kw)

    monkeypatch.setattr(lite.tune, "tune_layer", spy)
    whole = quantize_model(str(src), cfg, str(tmp_path / "whole"))
    assert len(seen) == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    (in0, kw0, t0), (in1, kw1, t1) = seen
    with torch.no_grad():
        float0 = [hf.model.layers[0](x, **k) for x, k in zip(in0, kw0)]
        float1 = [hf.model.layers[1](t, **k) for t, k in zip(t0, kw1)]
        float1_on_quantized = [hf.model.layers[1](x, **k) for x, k in zip(in1, kw1)]
    for got, want in zip(t0 + t1, float0 + float1):
        want = want[0] if isinstance(want, tuple) else want
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # layer 1's inputs went through the quantized layer 0, so fitting the float layer on them would differ
    off = max(float((t - (f[0] if isinstance(f, tuple) else f)).abs().max()) for t, f in zip(t1, float1_on_quantized))
    assert off > 1e-3
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(src), cfg, str(tmp_path / "r"), stop_after_layers=1)
    out = quantize_model(str(src), cfg, str(tmp_path / "r"), resume=True)
    assert json.loads((out / "liteturbo_quantize.json").read_text())["reused_layers"] == 1
    a, b = load_file(str(out / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resident_kib() -> int:
    """This process's resident memory (heap and mapped files), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_reading_every_layer_keeps_memory_at_about_one_layer(tmp_path):
    """Layer by layer stays layer by layer: after every layer of a bf16 source was materialized and released, resident
    memory grew by less than two layers' bf16 weights (it used to grow by every layer read: the kept-open source's
    mapped pages stayed resident)."""
    from safetensors.torch import save_file

    from lite.layerwise import LazyCheckpoint
    from tiny_models import build_tiny_llama

    cfg = dict(TINY, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=8, vocab_size=512)
    src = build_tiny_llama(tmp_path / "m", **cfg)
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in sd.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    del sd
    layer_kib = (4 * 512 * 512 + 3 * 512 * 2048) * 2 // 1024  # 8 MiB of bf16 weights per layer
    lazy = LazyCheckpoint(src, torch.device("cpu"))
    lazy.materialize(lazy.layers[0], "model.layers.0")  # allocator and mapping warm-up
    lazy.release(lazy.layers[0])
    before = _resident_kib()
    for i, layer in enumerate(lazy.layers):
        lazy.materialize(layer, f"model.layers.{i}")
        assert layer.mlp.up_proj.weight.dtype == torch.float32
        lazy.release(layer)
    grown = _resident_kib() - before
    assert grown < 2 * layer_kib, f"resident memory grew {grown} KiB over 8 layers of {layer_kib} KiB"
