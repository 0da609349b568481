"""Tensor parallelism (turbo/core/tp) on this CPU with gloo: greedy tokens at tp 2 equal tp 1 in float32 on tiny random
Llama, Qwen2, Qwen3 and Mistral models (GQA with 2 KV heads and 1 replicated KV head, 16-bit and W4A16), the per-rank
weight accounting against the tensors a rank holds, splits refused before loading, sessions saved per rank shard,
and the faults: a killed worker makes the step raise EngineDead within seconds, and no worker outlives its engine."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from backends import QuantizedWeight, TorchBackend
from lite.formats import LiteturboError
from turbo import Engine
from turbo.core import planner
from turbo.core.model import ModelConfig
from turbo.core.tp.shard import Shard, check_split, partition, working_sizes
from turbo.errors import EngineDead

from tiny_models import save_word_tokenizer

ARCH = {"llama": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
        "mistral": (transformers.MistralConfig, dict(sliding_window=None))}
# (arch, KV heads, tied embeddings, vocabulary, W4A16): every family with 2 KV heads (split) and 1 (replicated),
# 16-bit and W4A16; an odd vocabulary splits unevenly (66 + 65 rows)
MODELS = [("llama", 2, False, 131, False), ("llama", 1, True, 128, True), ("qwen2", 2, True, 128, True),
          ("qwen2", 1, False, 128, False), ("qwen3", 1, False, 128, False), ("qwen3", 2, False, 128, True),
          ("mistral", 2, False, 128, False), ("mistral", 1, False, 128, True)]
OPTS = dict(dtype="float32", max_kv_tokens=1024, block_size=8, max_num_batched_tokens=24)
PROMPTS = [[5, 17, 9, 33, 2, 41, 7, 19, 23, 11, 3, 29, 31, 13, 37, 8, 12, 50, 60, 70, 80, 90, 100, 110, 120, 4,
            6, 10, 14, 18], [44, 45, 46], [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41, 42, 43]]


def _build(path: Path, arch: str, kv_heads: int, tied: bool, vocab: int, heads: int = 4, inter: int = 128) -> Path:
    """A random 2-layer float32 model (``heads`` heads of 16, MLP ``inter``) with sharp weights (greedy decoding
    follows the context, no near-ties) and a word tokenizer with a chat template."""
    cls, extra = ARCH[arch]
    torch.manual_seed(0)
    cfg = cls(vocab_size=vocab, hidden_size=16 * heads, intermediate_size=inter, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
              rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=tied, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    save_word_tokenizer(path, vocab, bos=True)
    return path


def _w4a16(path: Path, group_size: int = 32) -> Path:
    from lite.pipeline import QuantConfig, quantize_checkpoint

    return quantize_checkpoint(str(path), QuantConfig(w_group_size=group_size, work_dir=str(path) + "-w4a16"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for arch, kv, tied, vocab, quant in MODELS:
        name = f"{arch}-kv{kv}-{'w4a16' if quant else 'f32'}"
        p = _build(root / name, arch, kv, tied, vocab)
        out[name] = _w4a16(p) if quant else p
    return out


def _greedy(engine, n: int = 10) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=n, ignore_eos=True)]


def _workers(engine) -> list:
    return engine.runner.group.procs


# --- greedy tokens: tp 2 == tp 1 ---------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("name", [f"{a}-kv{k}-{'w4a16' if q else 'f32'}" for a, k, _, _, q in MODELS])
def test_tp2_greedy_tokens_equal_tp1(models, name):
    ref = _greedy(Engine(models[name], **OPTS))
    engine = Engine(models[name], **OPTS, tensor_parallel_size=2)
    try:
        got = _greedy(engine)
        if name == "llama-kv2-f32":  # the rank-0 shard holds what the planner counts for one rank
            cfg, wc = engine.model.cfg, planner.WeightChoice(16, -1)
            want = planner.weight_breakdown(cfg, TorchBackend, "cpu", torch.float32, wc, tp=2)
            assert engine.model.memory_breakdown() == want
            assert engine.model.num_kv_heads == 1 and engine.model.embed.shape[0] == 66
    finally:
        engine.close()
    assert got == ref
    assert all(not p.is_alive() for p in _workers(engine))


# --- splits ------------------------------------------------------------------------------------------------------
def test_split_arithmetic():
    assert [partition(131, 2, r) for r in range(2)] == [(0, 66), (66, 131)]
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3))
    assert working_sizes(cfg) == [1, 3] and working_sizes(cfg, 4, 64) == [1, 3]
    with pytest.raises(LiteturboError, match=r"^tp 9 splits the 1536 MLP features \(intermediate_size\) into "
                                             r"170.667 per rank, not a whole number; tensor_parallel_size in "
                                             r"\{1, 3\} works$"):
        check_split(cfg, 9, 4, 64)
    # 3 KV heads on 9 ranks: each KV head replicated on the 3 ranks whose query head reads it
    assert [Shard(r, 9, cfg).kv_head_range() for r in (0, 2, 3, 8)] == [(0, 1), (0, 1), (1, 2), (2, 3)]
    assert [Shard(r, 3, cfg).features("down_proj") for r in range(3)] == [(0, 512), (512, 1024), (1024, 1536)]


def test_group_breaking_split_is_refused_before_loading(tmp_path, monkeypatch):
    import turbo.core.startup as startup

    # 6 heads of 16 in groups of 32: two ranks would get 48 input features of o_proj each
    path = _w4a16(_build(tmp_path / "m", "llama", 6, False, 128, heads=6, inter=96), 32)

    def never(*args, **kwargs):
        raise AssertionError("weights were read or workers started")
    monkeypatch.setattr(startup.LlamaModel, "from_pretrained", never)
    monkeypatch.setattr(startup, "WorkerGroup", never)
    with pytest.raises(LiteturboError, match=r"^tp 2 splits o_proj's 96 input features into 48, not a multiple of "
                                             r"group size 32; tensor_parallel_size in \{1, 3\} works$"):
        Engine(path, **OPTS, tensor_parallel_size=2)
    with pytest.raises(LiteturboError, match=r"^tp 4 splits the 6 attention heads into 1.5 per rank"):
        Engine(path, **OPTS, tensor_parallel_size=4)


def test_quantized_shards_are_exact_and_act_order_groups_must_stay_on_one_rank():
    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    g = torch.Generator().manual_seed(0)

    def qw(out_f, in_f, g_idx=None):
        return QuantizedWeight(4, 32, False, torch.randint(0, 16, (out_f, in_f), generator=g).to(torch.uint8),
                               torch.randint(0, 16, (in_f // 32, out_f), generator=g).to(torch.uint8),
                               torch.rand(in_f // 32, out_f, generator=g).to(torch.float16), g_idx)

    up, down = qw(128, 64), qw(64, 128)
    for r in range(2):
        s = Shard(r, 2, cfg)
        assert torch.equal(s.quantized("mlp.up_proj", up).dequantize(), up.dequantize()[64 * r:64 * (r + 1)])
        assert torch.equal(s.quantized("mlp.down_proj", down).dequantize(), down.dequantize()[:, 64 * r:64 * (r + 1)])
    # act-order: groups permuted inside each rank's half are kept (renumbered) ...
    perm = torch.cat([torch.randperm(64, generator=g), 64 + torch.randperm(64, generator=g)])
    aligned = qw(64, 128, (torch.arange(128) // 32)[perm].to(torch.int32))
    part = Shard(1, 2, cfg).quantized("mlp.down_proj", aligned)
    assert torch.equal(part.dequantize(), aligned.dequantize()[:, 64:]) and part.scales.shape[0] == 2
    # ... a group spread over both halves is refused, naming the layer
    spread = qw(64, 128, (torch.arange(128) // 32)[torch.randperm(128, generator=g)].to(torch.int32))
    with pytest.raises(LiteturboError, match="model.layers.0.mlp.down_proj's 128 input features into 64 per rank, "
                                             "but its act-order groups"):
        Shard(0, 2, cfg).quantized("model.layers.0.mlp.down_proj", spread)


def test_plan_answers_per_device():
    from turbo import plan as tplan

    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                     tie_word_embeddings=True))
    args = dict(model="m", device_kind="cuda", budget=4 << 30, budget_source="test", dtype=torch.bfloat16,
                weights=planner.WeightChoice(4, 64), session_len=2048)
    one, three = tplan.plan(cfg, {}, **args), tplan.plan(cfg, {}, **args, tp=3)
    # a third of the linears each (the Triton layout pads the smaller per-rank shapes a little)
    assert 1 <= three.weights["decoder linears"] * 3 / one.weights["decoder linears"] < 1.05
    assert three.weights["embeddings"] * 3 == one.weights["embeddings"]
    assert three.kv_bytes_per_token * 3 == one.kv_bytes_per_token
    assert three.engine_options["tensor_parallel_size"] == 3 and "3 x cuda" in three.table()
    with pytest.raises(LiteturboError, match=r"tp 2 splits the 9 attention heads.*\{1, 3\} works"):
        tplan.plan(cfg, {}, **args, tp=2)


# --- sessions ----------------------------------------------------------------------------------------------------
def test_sessions_save_kv_per_rank_shard_and_recompute_under_another_size(models, tmp_path):
    path = models["qwen2-kv2-w4a16"]
    two = Engine(path, **OPTS, tensor_parallel_size=2)
    try:
        s = two.session()
        s.chat("the of and", max_new_tokens=4, ignore_eos=True)
        s.save(tmp_path / "s", include_kv=True)
    finally:
        two.close()
    fresh = Engine(path, **OPTS, tensor_parallel_size=2)  # nothing cached: what it reuses comes from the file
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            restored = fresh.load_session(tmp_path / "s")  # same size: each rank loads its saved shard
        reply = restored.chat("to a in", max_new_tokens=4, ignore_eos=True)
        assert restored.last.cached_tokens > 0  # from the file: this engine had nothing cached
    finally:
        fresh.close()
    one = Engine(path, **OPTS)
    with pytest.warns(UserWarning, match="tensor_parallel_size=2 ranks.*this engine runs 1"):
        other = one.load_session(tmp_path / "s")
    assert other.chat("to a in", max_new_tokens=4, ignore_eos=True) == reply  # recomputed at tp 1: the same
    assert other.last.cached_tokens == 0


# --- faults ------------------------------------------------------------------------------------------------------
def test_killed_worker_makes_the_next_step_raise(models):
    engine = Engine(models["llama-kv1-w4a16"], **OPTS, tensor_parallel_size=2)
    try:
        engine.generate(PROMPTS[0], max_new_tokens=2)
        worker = _workers(engine)[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match=rf"rank 1 \(pid {worker.pid}\) was killed by signal SIGKILL"):
            engine.generate(PROMPTS[1], max_new_tokens=4)
        assert time.monotonic() - t0 < 5
        assert "rank 1" in engine.dead
    finally:
        engine.close()


def test_worker_killed_during_a_step_fails_it_within_seconds(models):
    engine = Engine(models["mistral-kv2-f32"], **dict(OPTS, max_num_batched_tokens=256, max_kv_tokens=4096),
                    tensor_parallel_size=2)
    try:
        worker = _workers(engine)[0]
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(EngineDead, match="rank 1 .* SIGKILL"):
            engine.generate([PROMPTS[0]] * 8, max_new_tokens=200, ignore_eos=True)
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDead):  # and every later step
            engine.generate(PROMPTS[1], max_new_tokens=1)
    finally:
        engine.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_workers_exit_when_rank_0_is_killed(models, tmp_path):
    script = textwrap.dedent(f"""
        import os
        from turbo import Engine
        if __name__ == "__main__":
            e = Engine({str(models['qwen3-kv1-f32'])!r}, dtype="float32", max_kv_tokens=256, tensor_parallel_size=2)
            print(e.runner.group.procs[0].pid, flush=True)
            os.kill(os.getpid(), 9)
        """)
    (tmp_path / "rank0.py").write_text(script)
    rank0 = subprocess.Popen([sys.executable, str(tmp_path / "rank0.py")], stdout=subprocess.PIPE, text=True)
    pid = int(rank0.stdout.readline())
    assert rank0.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"worker {pid} outlived its killed rank 0")


# --- SmolLM2 (9 heads, 3 KV heads) at tp 3, W4A16 g64 -------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.slow
def test_smollm2_w4a16_g64_tp3_greedy_equals_tp1(smollm2_rtn_g64):
    opts = dict(dtype="float32", max_kv_tokens=2048)
    prompts = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, there was a"]
    ref = [o.token_ids for o in Engine(smollm2_rtn_g64, **opts).generate(prompts, max_new_tokens=24)]
    engine = Engine(smollm2_rtn_g64, **opts, tensor_parallel_size=3)
    try:
        got = [o.token_ids for o in engine.generate(prompts, max_new_tokens=24)]
    finally:
        engine.close()
    assert got == ref
