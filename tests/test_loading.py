"""Streaming checkpoint loading (``LazyStateDict`` + ``LlamaModel.from_pretrained`` layer by layer): the lazy
reader returns what ``load_state_dict`` returns, a streamed model gives bit-identical logits to one loaded from
the whole state dict (16-bit, sharded, AWQ, GPTQ act-order, compressed-tensors), no host copy of an earlier
layer is alive while a layer is prepared, and malformed checkpoints still raise ``LiteturboError``."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import transformers
from safetensors.torch import save_file

import lite.formats
from backends import get_backend
from backends.types import QuantizedWeight
from lite.formats import LazyStateDict, LiteturboError, awq_quantization_config, load_state_dict, pack_awq
from lite.formats.compressed_tensors import compressed_quantization_config, pack_compressed
from lite.formats.gptq import gptq_quantization_config, pack_gptq
from turbo.core.model import LlamaModel

from conftest import run_turbo_logits

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
LINEARS = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv", "self_attn.o_proj": "o",
           "mlp.gate_proj": "gu", "mlp.up_proj": "gu", "mlp.down_proj": "down"}
GS = 32
IDS = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is fastest (and robust when the cores are busy)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _save_hf(path, dtype=torch.float32, shard: str | None = None, **overrides) -> dict:
    """A tiny random Llama saved at ``path``; returns its state dict (contiguous CPU tensors)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**dict(TINY, **overrides)),
                                                       dtype=dtype).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return {k: v.contiguous() for k, v in hf.state_dict().items()}


def _qw(out_f: int, in_f: int, g_idx: torch.Tensor | None, seed: int) -> QuantizedWeight:
    """Random asymmetric 4-bit weight (zero points in [1, 15] so that GPTQ v1 can store them)."""
    g = torch.Generator().manual_seed(seed)
    n_groups = in_f // GS
    return QuantizedWeight(bits=4, group_size=GS, sym=False,
                           qweight=torch.randint(0, 16, (out_f, in_f), generator=g).to(torch.uint8),
                           qzeros=torch.randint(1, 16, (n_groups, out_f), generator=g).to(torch.uint8),
                           scales=(torch.rand(n_groups, out_f, generator=g) * 0.02 + 0.01).to(torch.float16),
                           g_idx=g_idx)


def _quantized_checkpoint(path, fmt: str, skip: tuple[str, ...] = ()) -> None:
    """A tiny W4A16 checkpoint in ``fmt`` (awq | gptq, act-order | compressed-tensors), written by liteturbo's own
    packers; linears named in ``skip`` stay 16-bit."""
    sd = _save_hf(path)
    pack = {"awq": pack_awq, "gptq": lambda q: pack_gptq(q, "gptq"), "compressed-tensors": pack_compressed}[fmt]
    g = torch.Generator().manual_seed(7)
    for i in range(TINY["num_hidden_layers"]):
        g_idx = {}  # linears fed by the same input share one act-order g_idx, as GPTQ tools write them
        for j, (n, fuse) in enumerate(LINEARS.items()):
            p = f"model.layers.{i}.{n}"
            if n in skip:
                continue
            out_f, in_f = sd.pop(f"{p}.weight").shape
            if fmt == "gptq" and fuse not in g_idx:
                perm = torch.randperm(in_f, generator=g)
                g_idx[fuse] = torch.empty(in_f, dtype=torch.int32)
                g_idx[fuse][perm] = (torch.arange(in_f) // GS).to(torch.int32)
            sd.update({f"{p}.{k}": v for k, v in pack(_qw(out_f, in_f, g_idx.get(fuse), 10 * i + j)).items()})
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    qc = {"awq": lambda: awq_quantization_config(4, GS, True),
          "gptq": lambda: gptq_quantization_config(4, GS, False, True, False, 0.01, True, "gptq"),
          "compressed-tensors": lambda: compressed_quantization_config(4, GS, False, "group")}[fmt]()
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))


class WholeStateDict(dict):
    """The loading path before streaming: every tensor read up front (``load_state_dict``), served as a dict.

    The tensors are copied out of ``load_file``'s memory map into torch-allocated memory: a CPU GEMM's last bits
    depend on the weight's address alignment, which for a mapped tensor is its offset in the file (the old path
    gave other float32 logits when a tensor sat at another offset); streaming reads into torch-allocated memory.
    """

    def __init__(self, path) -> None:
        super().__init__({k: v.clone() for k, v in load_state_dict(path).items()})

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)


class RecordingStateDict(LazyStateDict):
    """A ``LazyStateDict`` that logs every tensor it reads, with a weak reference to it (alive or freed)."""

    log: list = []

    def _read(self, name):
        t = super()._read(name)
        RecordingStateDict.log.append((name, weakref.ref(t), t.nbytes))
        return t


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def _logits(model) -> torch.Tensor:
    return run_turbo_logits(model, [IDS[:13], IDS[13:14], IDS[14:]])


# ------------------------------------------------------------------------------------------------
def test_lazy_state_dict_reads_what_load_state_dict_reads(tmp_path):
    _save_hf(tmp_path, dtype=torch.bfloat16, shard="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 3
    whole = load_state_dict(tmp_path)
    lazy = LazyStateDict(tmp_path)
    assert sorted(lazy) == sorted(whole) and len(lazy) == len(whole) == 3 * 9 + 3
    for k, v in whole.items():
        assert lazy.shape(k) == tuple(v.shape) and lazy.nbytes(k) == v.nbytes
        got = lazy[k]
        assert got.dtype == v.dtype == torch.bfloat16 and torch.equal(got, v), k
    emb = "model.embed_tokens.weight"
    assert lazy.nbytes(emb) == 128 * 64 * 2
    assert torch.equal(lazy.pop(emb), whole[emb]) and emb not in lazy and len(lazy) == len(whole) - 1
    assert lazy.get(emb) is None and lazy.pop(emb, "absent") == "absent"
    with pytest.raises(KeyError):
        lazy.pop(emb)
    with pytest.raises(KeyError):
        lazy[emb]


CASES = {  # name: (checkpoint maker, compute dtype)
    "fp32": (lambda p: _save_hf(p), torch.float32),
    "bf16-sharded": (lambda p: _save_hf(p, dtype=torch.bfloat16, shard="40KB"), torch.bfloat16),
    "awq": (lambda p: _quantized_checkpoint(p, "awq"), torch.float32),
    "awq-bf16": (lambda p: _quantized_checkpoint(p, "awq"), torch.bfloat16),
    "gptq-act-order": (lambda p: _quantized_checkpoint(p, "gptq"), torch.float32),
    "compressed-tensors": (lambda p: _quantized_checkpoint(p, "compressed-tensors"), torch.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_streaming_logits_are_bit_identical_to_whole_state_dict_load(tmp_path, monkeypatch, case):
    make, dtype = CASES[case]
    make(tmp_path)
    streamed = LlamaModel.from_pretrained(tmp_path, get_backend("torch"), dtype)
    monkeypatch.setattr(lite.formats, "LazyStateDict", WholeStateDict)
    whole = LlamaModel.from_pretrained(tmp_path, get_backend("torch"), dtype)
    a, b = _logits(streamed), _logits(whole)
    assert a.shape == (len(IDS), 128) and torch.isfinite(a).all()
    assert torch.equal(a, b), float((a - b).abs().max())
    if case.startswith(("awq", "gptq", "compressed")):
        assert streamed.layers[0].qkv.quantized == "w4a16"


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["bf16-sharded", "awq", "gptq-act-order"])
def test_no_host_copy_of_an_earlier_layer_is_alive_while_a_layer_is_prepared(tmp_path, monkeypatch, case):
    make, dtype = CASES[case]
    make(tmp_path)
    RecordingStateDict.log = []
    monkeypatch.setattr(lite.formats, "LazyStateDict", RecordingStateDict)
    backend = get_backend("torch")
    snapshots = []  # per prepare call: (prepare index, names read so far, names read whose tensor is alive)

    def hook(fn):
        def wrapped(*args):
            gc.collect()
            log = RecordingStateDict.log
            snapshots.append(([n for n, _, _ in log], [(n, b) for n, r, b in log if r() is not None]))
            return fn(*args)
        return wrapped

    backend.prepare_w4a16 = hook(backend.prepare_w4a16)
    backend.prepare_linear = hook(backend.prepare_linear)
    model = LlamaModel.from_pretrained(tmp_path, backend, dtype)
    gc.collect()
    kept = {n for n, r, _ in RecordingStateDict.log if r() is not None}  # read tensors the final model holds
    n_layers = TINY["num_hidden_layers"]
    assert len(snapshots) == 4 * n_layers  # qkv, o, gate_up, down per layer
    one_layer = max(sum(b for n, _, b in RecordingStateDict.log if _layer_of(n) == i) for i in range(n_layers))
    peak_transient = 0
    for k, (read, alive) in enumerate(snapshots):
        layer = k // 4
        # read so far: only tensors of layers <= the one being prepared (no embedding, no later layer)
        assert {_layer_of(n) for n in read} == set(range(layer + 1)), (k, read[-1])
        transient = [(n, b) for n, b in alive if n not in kept]
        assert all(_layer_of(n) == layer for n, _ in transient), (k, transient)
        peak_transient = max(peak_transient, sum(b for _, b in transient))
    assert peak_transient <= one_layer
    if case != "bf16-sharded":  # a quantized layer's unpacked linears wait in memory for their turn
        assert peak_transient > 0
    # what the model keeps of the read tensors as they are (no copy needed): norms, and scales of dequant handles
    assert all(n.endswith(("norm.weight", "scales", "weight_scale", "embed_tokens.weight", "lm_head.weight"))
               for n in kept), sorted(kept)
    assert torch.isfinite(_logits(model)).all()


# ------------------------------------------------------------------------------------------------
def _edit_config(path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, **fields)))


def _edit_tensors(path, fn) -> None:
    sd = load_state_dict(path)
    sd = fn(dict(sd))
    (path / "model.safetensors").unlink()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


def _without(*names):
    return lambda sd: {k: v for k, v in sd.items() if k not in names}


ERRORS = {  # name: (checkpoint maker, edit, expected message)
    "vocab-size": ("fp32", lambda p: _edit_config(p, vocab_size=256), "model.embed_tokens.weight has shape"),
    "intermediate-16bit": ("fp32", lambda p: _edit_config(p, intermediate_size=128), "gate_proj.weight has shape"),
    "intermediate-awq": ("awq", lambda p: _edit_config(p, intermediate_size=128), "gate_proj has shape"),
    "fewer-layers": ("awq", lambda p: _edit_config(p, num_hidden_layers=1), "beyond num_hidden_layers=1"),
    "more-layers": ("fp32", lambda p: _edit_config(p, num_hidden_layers=4),
                    "num_hidden_layers=4 but the weights hold no tensor of decoder layer 3"),
    "missing-norm": ("fp32", lambda p: _edit_tensors(p, _without("model.layers.1.post_attention_layernorm.weight")),
                     "lacks tensor 'model.layers.1.post_attention_layernorm.weight'"),
    "missing-lm-head": ("fp32", lambda p: _edit_tensors(p, _without("lm_head.weight")), "lacks lm_head.weight"),
    "missing-final-norm": ("awq", lambda p: _edit_tensors(p, _without("model.norm.weight")),
                           "lacks tensor 'model.norm.weight'"),
    "missing-qzeros": ("awq", lambda p: _edit_tensors(p, _without("model.layers.2.mlp.up_proj.qzeros")),
                       "quantized layer model.layers.2.mlp.up_proj lacks tensor"),
    "unused-tensor": ("fp32", lambda p: _edit_tensors(p, lambda sd: dict(
        sd, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})), "decoder layer 0 holds tensors"),
    "quantized-lm-head": ("awq", lambda p: _edit_tensors(p, lambda sd: dict(_without("lm_head.weight")(sd), **{
        f"lm_head.{k}": v for k, v in pack_awq(_qw(128, 64, None, 1)).items()})),
        "quantized tensors outside the decoder linears"),
    "damaged-file": ("fp32", lambda p: (p / "model.safetensors").write_bytes(
        (p / "model.safetensors").read_bytes()[:1000]), "cannot read"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_malformed_checkpoints_raise_liteturbo_error(tmp_path, name):
    base, edit, needle = ERRORS[name]
    CASES[base][0](tmp_path)
    edit(tmp_path)
    with pytest.raises(LiteturboError, match=needle):
        LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)


def test_partly_quantized_fused_linear_raises(tmp_path):
    _quantized_checkpoint(tmp_path, "awq", skip=("self_attn.k_proj",))
    with pytest.raises(LiteturboError, match="partly quantized"):
        LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)


def test_missing_shard_raises(tmp_path):
    _save_hf(tmp_path, shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(LiteturboError, match="listed in the index is missing"):
        LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)


def test_layer_count_mismatch_fails_before_reading_weights(tmp_path, monkeypatch):
    _quantized_checkpoint(tmp_path, "awq")
    _edit_config(tmp_path, num_hidden_layers=2)
    RecordingStateDict.log = []
    monkeypatch.setattr(lite.formats, "LazyStateDict", RecordingStateDict)
    with pytest.raises(LiteturboError, match="beyond num_hidden_layers=2"):
        LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)
    assert RecordingStateDict.log == []
