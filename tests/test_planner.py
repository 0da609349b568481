"""The memory planner against the bytes the engine really allocates, and the engine's start-up refusals.

Weights and KV figures of :mod:`turbo.core.planner` must equal the tensors the engine holds (counted from the tensors
themselves by :meth:`turbo.core.model.LlamaModel.memory_breakdown` and :attr:`PagedKVCache.nbytes`) for SmolLM2 and for
tiny models of each family, per backend layout and KV dtype; pool sizing must shrink (never grow) with a larger
prefill chunk and with memory already in use; configurations that cannot fit are refused with the shortfall.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner

from backends import Backend, LinearSpec, QuantizedWeight, TorchBackend, backend_classes
from backends.platform import Platform
from lite.formats import LiteturboError, load_config
from lite.memory import quantize_peak
from turbo import Engine, EngineConfig
from turbo import plan as planner
from turbo.cli import main
from turbo.core.model import ModelConfig, storage_nbytes as _nbytes

from conftest import usable_backends
from tiny_models import save_word_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def _planned(engine: Engine) -> dict[str, int]:
    raw = load_config(engine.path)
    wc = planner.weight_choice(engine.path, raw, engine.model.lm_head.quantized == "w8a16")
    return planner.weight_breakdown(ModelConfig.from_dict(raw), type(engine.backend), engine.platform.device.type,
                                    engine.dtype, wc)


def _kv_planned(engine: Engine) -> int:
    cfg = ModelConfig.from_dict(load_config(engine.path))
    return planner.kv_spec(cfg, engine.kv_cache_dtype, engine.config.block_size,
                           engine.block_manager.num_blocks).total_bytes()


# --- handles: each backend's linear_nbytes equals what its prepare_* allocates ------------------------------------
def _qw(out, inp, gs, bits=4, act_order=False, bias=False, scales_dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-inp // (inp if gs == -1 else gs))
    g_idx = None
    if act_order:
        g_idx = (torch.arange(inp) // gs)[torch.randperm(inp, generator=g)].to(torch.int32)
    return QuantizedWeight(bits=bits, group_size=gs, sym=False,
                           qweight=torch.randint(0, 2**bits, (out, inp), generator=g, dtype=torch.uint8),
                           qzeros=torch.randint(0, 2**bits, (groups, out), generator=g, dtype=torch.uint8),
                           scales=(torch.rand(groups, out, generator=g) * 0.01 + 1e-3).to(scales_dtype),
                           g_idx=g_idx, bias=torch.randn(out, generator=g) if bias else None)


CASES = [dict(out=48, inp=64, gs=32), dict(out=40, inp=64, gs=32),  # 40: not a multiple of 16 (no int4pack)
         dict(out=32, inp=96, gs=-1), dict(out=64, inp=128, gs=64, bias=True), dict(out=48, inp=64, gs=32, bits=8),
         dict(out=48, inp=128, gs=32, act_order=True), dict(out=16, inp=64, gs=16),  # 16: no int4pack group
         dict(out=48, inp=64, gs=32, scales_dtype=torch.bfloat16)]


def _backends_here():
    out = [("torch", TorchBackend("cpu")), ("torch-dequant", TorchBackend("cpu", int4_kernel=False))]
    if "triton" in usable_backends("cpu"):
        out.append(("triton", backend_classes()["triton"]("cpu")))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_nbytes_equals_prepared_handle(case, dtype):
    qw = _qw(case["out"], case["inp"], case["gs"], case.get("bits", 4), case.get("act_order", False),
             case.get("bias", False), case.get("scales_dtype", torch.float16))
    spec = LinearSpec(qw.out_features, qw.in_features, bits=qw.bits, group_size=qw.group_size,
                      act_order=case.get("act_order", False), bias=qw.bias is not None, scales_dtype=qw.scales.dtype)
    for name, be in _backends_here():
        handle = be.prepare_w4a16(qw, dtype)
        # the dequantize fallback is what the base class describes (and what TorchBackend holds off the CPU)
        want = Backend.linear_nbytes(spec, dtype, "cpu") if name == "torch-dequant" else \
            type(be).linear_nbytes(spec, dtype, "cpu")
        assert _nbytes(handle) == want, (name, case)
    w = torch.randn(qw.out_features, qw.in_features)
    be = TorchBackend("cpu")
    assert _nbytes(be.prepare_w8a16(w, dtype)) == TorchBackend.linear_nbytes(
        LinearSpec(*w.shape, int8_per_channel=True), dtype, "cpu")
    assert _nbytes(be.prepare_linear(w, torch.randn(w.shape[0]), dtype)) == TorchBackend.linear_nbytes(
        LinearSpec(*w.shape, bias=True), dtype, "cpu")


def test_cpu_int4pack_holds_one_byte_per_weight_and_triton_half():
    """CPU bf16 with the C++ W4A16 kernels: one packed copy (half a byte per weight, int16 zero + bf16 scale per
    group); float32 or without them: int4pack + nibbles (1 byte per weight, 4 values per group in the dtype)."""
    from backends import cpu_ext

    spec = LinearSpec(4096, 4096, bits=4, group_size=128)
    tiles = 4096 * 4096 // 2 + 4 * 32 * 4096
    int4pack = 4096 * 4096 + 4 * 32 * 4096 * 2
    want = tiles if cpu_ext.w4_tiles_expected() else int4pack
    assert TorchBackend.linear_nbytes(spec, torch.bfloat16, "cpu") == want
    assert TorchBackend.linear_nbytes(spec, torch.float32, "cpu") == 4096 * 4096 + 4 * 32 * 4096 * 4
    trit = backend_classes()["triton"]
    assert trit.linear_nbytes(spec, torch.bfloat16, "cuda") == 4096 * 4096 // 2 + 32 * 4096 * 3
    # off the CPU the torch reference keeps canonical uint8 codes + uint8 zeros + float16 scales
    assert TorchBackend.linear_nbytes(spec, torch.bfloat16, "cuda") == 4096 * 4096 + 32 * 4096 * 3


# --- whole engines: planner == allocated ----------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "int4"])
def test_smollm2_w4a16_weights_and_kv_equal_allocated(smollm2_rtn_g64, kv):
    e = Engine(smollm2_rtn_g64, EngineConfig(dtype="bfloat16", kv_cache_dtype=kv, max_kv_tokens=1024))
    assert e.model.lm_head.quantized == "w8a16"  # the CPU default for quantized checkpoints
    assert e.model.memory_breakdown() == _planned(e)
    assert e.runner.kv_bytes == _kv_planned(e) == e.block_manager.num_blocks * e.runner.kv_cache.spec.bytes_per_block()
    assert e.stats()["kv_bytes_per_token"] == planner.kv_spec(e.model.cfg, kv, 64).bytes_per_token()


def test_smollm2_16bit_weights_equal_allocated(smollm2_path):
    e = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=512))
    got = e.model.memory_breakdown()
    assert got == _planned(e)
    assert got["lm_head"] == 0  # tied to the embeddings: one table
    assert e.runner.kv_bytes == _kv_planned(e)


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=32, max_position_embeddings=96, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                                  max_position_embeddings=128, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def tiny_family_models(tmp_path_factory):
    from lite.pipeline import QuantConfig, quantize_checkpoint

    root = tmp_path_factory.mktemp("planner-tiny")
    out = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        cfg = make()
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        dense = root / name
        hf.save_pretrained(dense)
        save_word_tokenizer(dense, cfg.vocab_size)
        w4 = Path(quantize_checkpoint(str(dense), QuantConfig(w_bits=4, w_group_size=32,
                                                              work_dir=str(root / f"{name}-w4"))))
        out[name] = {"dense": dense, "w4a16": w4}
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["dense", "w4a16"])
def test_tiny_families_weights_and_kv_equal_allocated(tiny_family_models, family, kind):
    path = tiny_family_models[family][kind]
    for kv in ("float32", "bfloat16", "int8", "int4"):
        for dtype in ("float32", "bfloat16"):
            e = Engine(path, EngineConfig(dtype=dtype, kv_cache_dtype=kv, max_kv_tokens=256, block_size=16))
            assert e.model.memory_breakdown() == _planned(e), (family, kind, kv, dtype)
            assert e.runner.kv_bytes == _kv_planned(e), (family, kind, kv, dtype)


@pytest.mark.skipif("triton" not in usable_backends(), reason="triton cannot run here")
def test_triton_layout_weights_equal_allocated(tiny_family_models):
    path = tiny_family_models["qwen2"]["w4a16"]  # qkv bias: the fused bias is counted too
    e = Engine(path, EngineConfig(backend="triton", device="cpu" if not torch.cuda.is_available() else "cuda",
                                  dtype="float32", kv_cache_dtype="int4", max_kv_tokens=128, block_size=16))
    assert e.model.memory_breakdown() == _planned(e)
    assert e.runner.kv_bytes == _kv_planned(e)


# --- pool sizing and refusals ---------------------------------------------------------------------------------------
def _fake_free(monkeypatch, free_bytes):
    monkeypatch.setattr(Platform, "free_memory", lambda self: int(free_bytes))


@pytest.mark.e2e
def test_larger_prefill_chunk_never_makes_the_pool_larger(smollm2_rtn_g64, monkeypatch):
    _fake_free(monkeypatch, 2 * 2**30)
    blocks = []
    for chunk in (128, 512, 1024, 4096):
        e = Engine(smollm2_rtn_g64, EngineConfig(cache_max_entry_count=0.5, max_num_batched_tokens=chunk,
                                                 session_len=2048))
        blocks.append(e.block_manager.num_blocks)
        assert e.block_manager.num_blocks * e.runner.kv_cache.spec.bytes_per_block() <= 0.5 * (
            2 * 2**30 - e.workspace_bytes)
    assert blocks == sorted(blocks, reverse=True) and blocks[0] > blocks[-1], blocks
    cfg = ModelConfig.from_dict(load_config(smollm2_rtn_g64))
    tokens = [planner.plan(cfg, {}, model="m", device_kind="cuda", budget=4 * 2**30, budget_source="t",
                           max_num_batched_tokens=t).pool_tokens for t in (256, 1024, 8192)]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > tokens[-1], tokens


@pytest.mark.e2e
def test_memory_already_in_use_is_accounted(smollm2_rtn_g64, monkeypatch):
    _fake_free(monkeypatch, 3 * 2**30)
    big = Engine(smollm2_rtn_g64, EngineConfig(cache_max_entry_count=0.9, session_len=1024))
    _fake_free(monkeypatch, 1 * 2**30)  # another process took 2 GiB
    small = Engine(smollm2_rtn_g64, EngineConfig(cache_max_entry_count=0.9, session_len=1024))
    bb = big.runner.kv_cache.spec.bytes_per_block()
    assert big.block_manager.num_blocks == int(0.9 * (3 * 2**30 - big.workspace_bytes) // bb)
    assert small.block_manager.num_blocks == int(0.9 * (2**30 - small.workspace_bytes) // bb)
    cfg = ModelConfig.from_dict(load_config(smollm2_rtn_g64))
    free_plan = planner.plan(cfg, {}, model="m", device_kind="cuda", budget=4 * 2**30, budget_source="t")
    used_plan = planner.plan(cfg, {}, model="m", device_kind="cuda", budget=4 * 2**30, budget_source="t",
                             in_use=2**30)
    assert used_plan.pool_bytes < free_plan.pool_bytes - 0.8 * 2**30


def test_pool_that_cannot_fit_is_refused_with_the_shortfall(smollm2_rtn_g64, monkeypatch):
    _fake_free(monkeypatch, 600 * 2**20)
    with pytest.raises(LiteturboError, match=r"max_kv_tokens=200000 asks for a KV cache of .* GiB short\. To fit: "
                                             r"max_kv_tokens=\d+ \(--max-kv-tokens \d+: the most that fits\).*kv_cache_dtype='int8'"):
        Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=200000, session_len=2048))
    _fake_free(monkeypatch, 2 * 2**30)
    with pytest.raises(LiteturboError, match=r"session_len=8192 needs 8192 tokens of KV cache but the pool "
                                             r"\(max_kv_tokens=1024\) holds 1024"):
        Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=1024, session_len=8192))


def test_weights_that_cannot_fit_are_refused_before_loading(smollm2_rtn_g64, monkeypatch):
    _fake_free(monkeypatch, 100 * 2**20)
    from turbo.core.model import LlamaModel

    def never(*a, **k):
        raise AssertionError("weights were read before the refusal")
    monkeypatch.setattr(LlamaModel, "from_pretrained", never)
    with pytest.raises(LiteturboError, match=r"does not fit on cpu: its weights take 0\.\d\d GiB .* short, before any "
                                             r"KV cache.*liteturbo plan"):
        Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=256))


def _profiled_peak(fn) -> int:
    """Largest amount of CPU memory torch's allocator had handed out while ``fn`` ran, above the start (profiler)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(f"{d}/trace.json")
        events = json.loads(Path(f"{d}/trace.json").read_text())["traceEvents"]
    totals = [ev["args"]["Total Allocated"] for ev in events
              if ev.get("name") == "[memory]" and "Total Allocated" in ev.get("args", {})]
    assert totals, "the profiler recorded no allocation"
    return max(totals) - totals[0]


@pytest.mark.e2e
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cpu_step_memory_within_the_workspace_estimate(smollm2_rtn_g64, batch_invariant):
    """A chunked prefill (3 chunks of 256 over a 768-token prompt) and a decode batch of 8 allocate no more than
    the workspace the engine set aside; the batch-invariant path materializes its scores and needs more."""
    e = Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=4096, max_num_batched_tokens=256, max_batch_size=8,
                                             session_len=1024, batch_invariant=batch_invariant))
    ids = [100 + i % 3000 for i in range(768)]
    e.generate([ids[:32]], max_new_tokens=2, ignore_eos=True)  # warm-up
    peak = _profiled_peak(lambda: e.generate([ids], max_new_tokens=1, ignore_eos=True))
    assert peak <= e.workspace_bytes, (peak, e.workspace_bytes)
    peak = _profiled_peak(lambda: e.generate([ids[i:i + 100] for i in range(8)], max_new_tokens=4, ignore_eos=True))
    assert peak <= e.workspace_bytes, (peak, e.workspace_bytes)


# --- the 24 GB table and the CLI --------------------------------------------------------------------------------------
def _plan_json(*args) -> dict:
    r = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_published_models_on_24gib():
    rows = {}
    for name in ("llama-3-8b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "llama-3-70b"):
        for kv in ("bf16", "int8", "int4"):
            rows[name, kv] = _plan_json(str(FIXTURES / f"{name}.json"), "--gpu-mem", "24GiB", "--kv-cache-dtype", kv)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB per token in bf16
    assert rows["llama-3-8b", "bf16"]["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert rows["llama-3-8b", "int8"]["kv_bytes_per_token"] == 32 * 8 * (128 + 3) * 2
    assert rows["llama-3-8b", "int4"]["kv_bytes_per_token"] == 32 * 8 * (64 + 3) * 2
    # packed 4-bit codes for ~7B decoder parameters: between 3 and 4 GiB; embeddings + lm_head 2 x 128256 x 4096 x 2
    w = rows["llama-3-8b", "bf16"]["weights"]
    assert 3 * 2**30 < w["decoder linears"] < 4 * 2**30
    assert w["embeddings"] == w["lm_head"] == 128256 * 4096 * 2
    for kv in ("bf16", "int8", "int4"):
        assert rows["llama-3-8b", kv]["fits"] and rows["qwen2.5-7b", kv]["fits"] and rows["qwen2.5-14b", kv]["fits"]
        assert not rows["llama-3-70b", kv]["fits"]  # ~37 GiB of 4-bit weights
    assert not rows["qwen2.5-32b", "bf16"]["fits"] and rows["qwen2.5-32b", "int4"]["fits"]
    assert rows["qwen2.5-32b", "int4"]["pool_tokens"] > 3 * rows["qwen2.5-32b", "bf16"]["pool_tokens"]
    for r in rows.values():  # the parts add up to the budget
        used = r["reserve"] + r["weights_total"] + r["workspace_total"] + r["pool_bytes"]
        assert used <= r["budget"] or not r["fits"]
        assert r["sessions_at_once"] == r["pool_blocks"] // -(-r["session_len"] // r["block_size"])


def test_plan_cli_table_and_quantization_line(tmp_path):
    r = CliRunner().invoke(main, ["plan", str(FIXTURES / "qwen2.5-32b.json"), "--gpu-mem", "24GiB"])
    assert r.exit_code == 0, r.output
    assert "KV cache per token" in r.output and "sessions at once" in r.output
    assert "NO" in r.output and "to fit: --kv-cache-dtype int4" in r.output
    assert "quantize with lite (awq, 128 x 512 calibration tokens" in r.output and "peak" in r.output
    folder = tmp_path / "cfg-only"
    folder.mkdir()
    shutil.copy(FIXTURES / "llama-3-8b.json", folder / "config.json")
    d = _plan_json(str(folder), "--gpu-mem", "24GB", "--w-bits", "8", "--session-len", "4096")
    assert d["budget"] == 24 * 10**9 and d["weight_bits"] == 8 and d["session_len"] == 4096 and d["fits"]
    assert d["engine_options"]["session_len"] == 4096


def test_plan_of_a_quantized_checkpoint_matches_the_engine(smollm2_rtn_g64):
    d = _plan_json(str(smollm2_rtn_g64), "--device", "cpu", "--dtype", "bfloat16")
    e = Engine(smollm2_rtn_g64, EngineConfig(dtype="bfloat16", max_kv_tokens=1024))
    assert d["weights"] == e.model.memory_breakdown()
    assert d["quantization"] is None and d["weight_bits"] == 4 and d["group_size"] == 64


@pytest.mark.parametrize("args, message", [
    (["--gpu-mem", "lots"], "cannot read the memory size"),
    (["--gpu-mem", "0"], "must be positive"),
    (["--gpu-mem", "24GiB", "--device", "tpu"], "--device must be cpu, cuda, rocm or npu"),
    (["--kv-cache-dtype", "int2"], "--kv-cache-dtype must be one of"),
    (["--w-group-size", "100"], "does not divide the input width of every linear (4096, 14336); use 32, 64, 128, "
                                "256 or -1"),
    (["--w-group-size", "4096"], "does not divide the input width"),  # 14336 % 4096 != 0
    (["--gpu-mem", "24GiB", "--device", "cpu", "--backend", "triton"], "the triton backend runs on cuda or rocm"),
    (["--gpu-mem", "24GiB", "--backend", "ascend"], "the ascend backend runs on npu"),
    (["--calib-samples", "0"], "--calib-samples and --calib-seqlen must be >= 1"),
    (["--dtype", "float8"], "--dtype must be auto, bfloat16 (bf16), float16 (fp16, half) or float32"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["--session-len", "1"], "--session-len must be > 1"),
])
def test_plan_bad_options_are_named(args, message):
    r = CliRunner().invoke(main, ["plan", str(FIXTURES / "llama-3-8b.json"), *args])
    assert r.exit_code != 0 and message in r.output, r.output


def test_plan_bad_model_inputs(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    r = CliRunner().invoke(main, ["plan", str(bad), "--gpu-mem", "24"])
    assert r.exit_code != 0 and "lacks the field" in r.output, r.output
    bad.write_text("[1, 2]")
    r = CliRunner().invoke(main, ["plan", str(bad)])
    assert r.exit_code != 0 and "not a config.json" in r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "empty")])  # a folder without config.json
    assert r.exit_code != 0 and "has no config.json" in r.output


@pytest.mark.parametrize("text, value", [("24GiB", 24 * 2**30), ("24 GB", 24 * 10**9), ("24000MiB", 24000 * 2**20),
                                         ("24", 24 * 2**30), ("1.5g", int(1.5 * 2**30)), (8, 8 * 2**30),
                                         ("24Gi", 24 * 2**30), ("512M", 512 * 2**20), ("1e1", 10 * 2**30)])
def test_parse_memory(text, value):
    assert planner.parse_memory(text) == value


@pytest.mark.parametrize("text", ["-5", "0", "inf", "nan", "lots", "24 XB", float("inf")])
def test_parse_memory_refuses(text):
    with pytest.raises(LiteturboError, match="memory size"):
        planner.parse_memory(text)


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 0, "'num_attention_heads' must be a positive integer"),
    ("max_position_embeddings", 0, "'max_position_embeddings' must be a positive integer"),
    ("hidden_size", None, "lacks the field 'hidden_size'"),
    ("hidden_size", [4096], "'hidden_size' must be a positive integer"),
    ("hidden_size", 4096.5, "'hidden_size' must be a positive integer"),
    ("num_hidden_layers", True, "'num_hidden_layers' must be a positive integer"),
    ("intermediate_size", -5, "'intermediate_size' must be a positive integer"),
    ("vocab_size", 0, "'vocab_size' must be a positive integer"),
    ("num_key_value_heads", 64, "not a multiple of num_key_value_heads=64"),
    ("rope_scaling", "yes", "rope_scaling must be an object or null"),
    ("rms_norm_eps", -1, "'rms_norm_eps' must be a positive number"),
    ("quantization_config", {"quant_method": "awq", "bits": 4, "group_size": -7}, "group_size=-7"),
])
def test_malformed_configs_are_named(tmp_path, field, value, message):
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    cfg[field] = value
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["plan", str(tmp_path), "--gpu-mem", "24"])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output, r.output
    f.write_bytes(b"\xff\xfe{")
    r = CliRunner().invoke(main, ["plan", str(tmp_path)])
    assert r.exit_code != 0 and "not UTF-8" in r.output, r.output


@pytest.mark.parametrize("args", [
    ["qwen2.5-32b", "--gpu-mem", "24GiB"], ["qwen2.5-32b", "--gpu-mem", "24GiB", "--kv-cache-dtype", "int8"],
    ["qwen2.5-14b", "--gpu-mem", "12GiB", "--kv-cache-dtype", "int8"], ["qwen2.5-7b", "--gpu-mem", "12GiB",
                                                                          "--w-bits", "16"],
    ["qwen2.5-7b", "--device", "cpu", "--gpu-mem", "24GiB"], ["llama-3-8b", "--gpu-mem", "6"],
    ["qwen2.5-32b", "--gpu-mem", "24GiB", "--dtype", "float32"], ["llama-3-70b", "--gpu-mem", "38GiB"],
])
def test_every_suggestion_fits_when_applied(args):
    """Each "to fit" option, applied alone, gives a plan that fits (the flag is parsed back from the text)."""
    name, *rest = args
    d = _plan_json(str(FIXTURES / f"{name}.json"), *rest)
    assert not d["fits"] and d["suggestions"], d
    for sug in d["suggestions"]:
        if sug.startswith("a device with "):
            size = sug.split()[3]
            base = [a for i, a in enumerate(rest) if a != "--gpu-mem" and (i == 0 or rest[i - 1] != "--gpu-mem")]
            extra = ["--gpu-mem", f"{size}GiB"] + base
        elif sug.startswith("4-bit"):
            extra = [a for i, a in enumerate(rest) if a != "--w-bits" and (i == 0 or rest[i - 1] != "--w-bits")]
        else:
            flag, value = sug.split()[:2]
            extra = [a for i, a in enumerate(rest) if a != flag and (i == 0 or rest[i - 1] != flag)] + [flag, value]
        again = _plan_json(str(FIXTURES / f"{name}.json"), *extra)
        assert again["fits"], (sug, again["reason"])


def test_cpu_plan_sizes_the_gather_workspace_by_the_pool(smollm2_rtn_g64, monkeypatch):
    """A CPU pool of 16,384 tokens never gathers more than that: 1 GiB is enough for SmolLM2 (it was refused when
    the workspace assumed 64 rows x 8,192 tokens), and the engine agrees."""
    d = _plan_json(str(smollm2_rtn_g64), "--device", "cpu", "--gpu-mem", "1.0")
    assert d["fits"] and d["workspace_total"] < 0.2 * 2**30, d
    _fake_free(monkeypatch, 0.81 * 2**30)
    e = Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=16384))
    assert e.block_manager.num_blocks == 256


def test_cpu_attention_workspace_follows_how_the_backend_reads_kv(monkeypatch):
    """The torch backend reads a 16-bit cache in place through the C++ paged attention (no gathered context), and
    gathers int8/int4 caches, batch-invariant steps and everything without the extension; a gathered context is
    never longer than the pool (Llama-3-8B: 8,192 positions, a 4,096-token pool)."""
    from backends import TorchBackend, cpu_ext
    from turbo.plan import plan_checkpoint

    monkeypatch.setattr(cpu_ext, "status", lambda: "built")
    assert TorchBackend.reads_kv_in_place("bfloat16", torch.bfloat16, "cpu")
    for args in (("int8", torch.bfloat16, "cpu"), ("int4", torch.bfloat16, "cpu"), ("bfloat16", torch.bfloat16, "cuda"),
                 ("float16", torch.bfloat16, "cpu")):
        assert not TorchBackend.reads_kv_in_place(*args), args
    assert not TorchBackend.reads_kv_in_place("bfloat16", torch.bfloat16, "cpu", batch_invariant=True)
    model = str(FIXTURES / "llama-3-8b.json")
    in_place, _ = plan_checkpoint(model, device="cpu", gpu_mem="64", max_kv_tokens=4096)
    gathered, _ = plan_checkpoint(model, device="cpu", gpu_mem="64", max_kv_tokens=4096, kv_cache_dtype="int8")
    # in place: 1,024 tokens' K/V of the step + 64 rows x 32 heads x ceil(4096 / 512) partials of 130 float32
    assert in_place.workspace["attention"] == 1024 * 2 * 8 * 128 * 2 + 64 * 32 * 8 * 130 * 4
    # gathered int8: a 1,024-token chunk over a 4,096-token context (K/V in bf16 + codes and float32: 7 bytes a
    # value) and its mask
    assert gathered.workspace["attention"] == 4096 * 2 * 8 * 128 * 7 + 1024 * 4096
    monkeypatch.setattr(cpu_ext, "status", lambda: "off")
    no_ext, _ = plan_checkpoint(model, device="cpu", gpu_mem="64", max_kv_tokens=4096)
    assert no_ext.workspace["attention"] == 4096 * 2 * 8 * 128 * 2 + 1024 * 4096


def test_conflicting_or_degenerate_pool_options_are_refused(smollm2_rtn_g64):
    with pytest.raises(LiteturboError, match="give one KV pool size, not kv_cache_gib=1.0 and max_kv_tokens=1000"):
        EngineConfig(max_kv_tokens=1000, kv_cache_gib=1.0)
    with pytest.raises(LiteturboError, match="kv_cache_gib must be a positive, finite number"):
        EngineConfig(kv_cache_gib=float("inf"))
    with pytest.raises(LiteturboError, match=r"kv_cache_gib=1e-09 is less than one KV block"):
        Engine(smollm2_rtn_g64, EngineConfig(kv_cache_gib=1e-9))


def test_plan_commands_follow_the_options(smollm2_rtn_g64):
    r = CliRunner().invoke(main, ["plan", "smollm2-135m-instruct", "--gpu-mem", "24GiB", "--quant-method", "gptq"])
    assert r.exit_code == 0, r.output
    assert "W4A16 g64" in r.output  # 576 is not a multiple of 128: the largest group size that divides it
    assert "liteturbo lite gptq smollm2-135m-instruct --w-group-size 64 --work-dir ./smollm2-135m-instruct-gptq" in r.output
    r = CliRunner().invoke(main, ["plan", str(smollm2_rtn_g64), "--w-bits", "4"])
    assert r.exit_code != 0 and "already quantized" in r.output
    r = CliRunner().invoke(main, ["plan", str(FIXTURES / "llama-3-8b.json"), "--gpu-mem", "24", "--w-bits", "16",
                                  "--dtype", "half", "--backend", "torch", "--block-size", "32"])
    assert r.exit_code == 0, r.output
    assert ("liteturbo serve <16-bit llama-3-8b checkpoint> --kv-cache-dtype float16 --session-len 8192" in r.output
            and "--dtype float16 --backend torch --block-size 32 --device cuda" in r.output)
    r = CliRunner().invoke(main, ["plan", str(FIXTURES / "llama-3-8b.json"), "--gpu-mem", "24", "--session-len",
                                  "100000"])
    assert "note: --session-len 100000 is capped to the model's max_position_embeddings (8192)" in r.output


# --- the lite side ----------------------------------------------------------------------------------------------------
# peak RSS from VmHWM: ru_maxrss would carry the parent's peak across fork + exec
_MEASURE = r"""
import json, sys, torch
torch.set_num_threads(1)
from lite.pipeline import PipelineConfig, quantize_model
src, out, method = sys.argv[1:4]
e2e = 0
if method.endswith("-e2e"):
    method, e2e = method[:-4], 4
# a first small run loads every library the pipeline imports; the peak it leaves is the baseline
quantize_model(src, PipelineConfig(method=method, w_group_size=32, calib_samples=1, calib_seqlen=16, n_grid=2,
                                   device="cpu"), out + "-warm")
def status(key):
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key)][0]
try:  # the peak so far is the warm-up's: reset it to the memory resident now (Linux >= 4.0), the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
except OSError:  # cannot reset: the warm-up's peak is the baseline (the run may then show less than it adds)
    base = status("VmHWM")
def hwm():
    return status("VmHWM")
quantize_model(src, PipelineConfig(method=method, w_group_size=32, calib_samples=32, calib_seqlen=256, n_grid=2,
                                   device="cpu", e2e_steps=e2e), out)
print(json.dumps({"added": hwm() - base, "base": base}))
"""


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc for peak RSS")
@pytest.mark.parametrize("method", ["awq", "gptq", "gptq-e2e"])
def test_quantize_peak_estimate_against_a_run(tmp_path, method, smollm2_path):
    """The estimate is within [1/2, 3] of the memory a run adds (peak RSS above what is resident after a warm-up run,
    the peak reset through /proc/self/clear_refs; RSS also holds what the allocator keeps after frees), on a model
    whose calibration activations dominate (hidden 256, intermediate 1024, 32 x 256 tokens). Measured 2026-12-01:
    AWQ 259-278 MiB against 210 estimated (1.23-1.32x), GPTQ 62-95 MiB against 60 (1.03-1.58x: the GPTQ estimate
    runs low) over four runs; GPTQ with 4 end-to-end tuning steps (2026-12-02) 375-411 MiB against 277. Before the reset the warm-up's peak was the baseline, and a GPTQ run once showed 8 MiB
    added."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_path / f).is_file():
            shutil.copy(smollm2_path / f, src / f)
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(tmp_path / "out"), method],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    added = json.loads(r.stdout.strip().splitlines()[-1])["added"]
    est = quantize_peak(json.loads((src / "config.json").read_text()), method.removesuffix("-e2e"), 32, 256,
                        e2e=method.endswith("-e2e")).peak
    print(f"lite {method}: peak RSS added {added / 2**20:.0f} MiB, estimated {est / 2**20:.0f} MiB")  # pytest -s
    assert added <= 2 * est and est <= 3 * added, (added, est)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_weights_exact_and_step_within_workspace(tiny_family_models, backend):
    """On a GPU: the planned weights equal the allocation, and the memory a full prefill chunk plus a decode batch
    allocate beyond weights and KV stays within the planner's workspace."""
    path = tiny_family_models["llama"]["w4a16"]
    e = Engine(path, EngineConfig(device="cuda", backend=backend, dtype="bfloat16", max_kv_tokens=4096,
                                  block_size=16, max_num_batched_tokens=256, max_batch_size=16, session_len=128))
    assert e.model.memory_breakdown() == _planned(e)
    assert e.runner.kv_bytes == _kv_planned(e)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    prompts = [[5 + (i * 7 + j) % 100 for j in range(100)] for i in range(16)]
    e.generate(prompts, max_new_tokens=8, ignore_eos=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= e.workspace_bytes
