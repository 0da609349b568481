"""Interchange with other tools: GPTQ v1/v2 and compressed-tensors layouts (exact round trips and hand-worked
words), ``quantization_config`` blocks as AutoAWQ/AutoGPTQ/llm-compressor write them, a hand-written GPTQ
act-order checkpoint loaded by turbo, the layer-wise pipeline (rtn/gptq/awq, resume) on a tiny random
Llama, and calibration sampling. Everything is tiny and CPU-only (no SmolLM2 weights are used)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from backends import get_backend
from backends.types import QuantizedWeight
from lite.formats import LiteturboError, load_quantized_linears, quantization_spec
from lite.formats.compressed_tensors import compressed_quantization_config, pack_compressed, unpack_compressed
from lite.formats.gptq import gptq_quantization_config, pack_gptq, unpack_gptq
from lite.formats.packing import pack_int32, unpack_int32
from lite.formats.quantized import QuantSpec
from turbo.core.model import LlamaModel

from conftest import run_turbo_logits

U32 = 1 << 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is fastest (and robust when the cores are busy)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _i32(word: int) -> int:
    """An unsigned 32-bit word as the int32 torch stores."""
    return word - U32 if word >= 1 << 31 else word


def _act_order_g_idx(in_f: int, gs: int, g: torch.Generator) -> torch.Tensor:
    """A desc_act-style g_idx: a random column order, groups of ``gs`` consecutive positions in that order."""
    perm = torch.randperm(in_f, generator=g)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // gs).to(torch.int32)
    return g_idx


def _rand_qw(out_f: int, in_f: int, gs: int, sym: bool, act_order: bool, seed: int, zmin: int = 0,
             g_idx: torch.Tensor | None = None) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    n_groups = in_f // (in_f if gs == -1 else gs)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g).to(torch.uint8)
    if sym:
        zeros = torch.full((n_groups, out_f), 8, dtype=torch.uint8)
    else:
        zeros = torch.randint(zmin, 16, (n_groups, out_f), generator=g).to(torch.uint8)
    scales = (torch.rand(n_groups, out_f, generator=g) * 0.01 + 0.002).to(torch.float16)
    if g_idx is None and act_order:
        g_idx = _act_order_g_idx(in_f, gs, g)
    return QuantizedWeight(bits=4, group_size=gs, sym=sym, qweight=codes, qzeros=zeros, scales=scales, g_idx=g_idx)


def _assert_same_qw(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert (a.bits, a.group_size, a.sym) == (b.bits, b.group_size, b.sym)
    assert a.qweight.dtype == b.qweight.dtype == torch.uint8 and torch.equal(a.qweight, b.qweight)
    assert a.qzeros.dtype == b.qzeros.dtype == torch.uint8 and torch.equal(a.qzeros, b.qzeros)
    assert b.scales.dtype == torch.float16 and torch.equal(a.scales.to(torch.float16), b.scales)
    assert torch.equal(a.group_index(), b.group_index())
    assert a.has_trivial_g_idx() == b.has_trivial_g_idx()
    assert torch.equal(a.dequantize(torch.float64), b.dequantize(torch.float64))


def _deq64(qw: QuantizedWeight) -> torch.Tensor:
    """Independent float64 dequantization: W[o, i] = (q[o, i] - z[g(i), o]) * s[g(i), o]."""
    out_f, in_f = qw.qweight.shape
    gs = in_f if qw.group_size == -1 else qw.group_size
    gi = qw.g_idx.long() if qw.g_idx is not None else torch.arange(in_f) // gs
    w = torch.empty(out_f, in_f, dtype=torch.float64)
    for i in range(in_f):
        w[:, i] = (qw.qweight[:, i].double() - qw.qzeros[gi[i]].double()) * qw.scales[gi[i]].double()
    return w


# ------------------------------------------------------------------------------------------------
# 5. GPTQ v1 / v2 and compressed-tensors: exact round trips, hand-worked words
# ------------------------------------------------------------------------------------------------
def test_pack_int32_sequential_and_unpack_inverse():
    codes = torch.arange(16, dtype=torch.uint8).view(2, 8)
    w = pack_int32(codes, 4, dim=1)
    assert w.dtype == torch.int32 and w.shape == (2, 1)
    assert int(w[0, 0]) == 0x76543210 and int(w[1, 0]) == _i32(0xFEDCBA98)
    assert torch.equal(unpack_int32(w, 4, dim=1, size=8), codes)
    w0 = pack_int32(codes.t(), 4, dim=0)  # along dim 0: [8, 2] -> [1, 2]
    assert w0.shape == (1, 2) and torch.equal(w0.view(-1), w.view(-1))
    assert torch.equal(unpack_int32(w0, 4, dim=0, size=8), codes.t())
    # padding to a multiple of 8
    odd = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    assert int(pack_int32(odd, 4, dim=1)[0, 0]) == 0x321
    with pytest.raises(LiteturboError):
        unpack_int32(w.to(torch.int64), 4, dim=1, size=8)
    with pytest.raises(LiteturboError):
        unpack_int32(w, 4, dim=1, size=9)


def test_gptq_hand_worked_qweight_and_qzeros_words():
    out_f, in_f = 16, 8
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    codes[5] = torch.arange(8)  # output channel 5: input channels 0..7 have codes 0..7
    codes[9] = torch.arange(8, 16)  # output channel 9: codes 8..15
    zeros = torch.arange(1, 17).clamp(max=15).to(torch.uint8).view(1, 16)  # zero of out channel j: j+1 (<=15)
    qw = QuantizedWeight(bits=4, group_size=-1, sym=False, qweight=codes, qzeros=zeros,
                         scales=torch.ones(1, out_f, dtype=torch.float16))
    t = pack_gptq(qw, "gptq")
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (1, 16)
    assert int(t["qweight"][0, 5]) == 0x76543210
    assert int(t["qweight"][0, 9]) == _i32(0xFEDCBA98)
    assert int(t["qweight"][0, 0]) == 0
    # v1 stores zero - 1, sequentially along the output dim: channels 0..7 -> 0..7, 8..15 -> 8..14, 14
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (1, 2)
    assert int(t["qzeros"][0, 0]) == 0x76543210
    assert int(t["qzeros"][0, 1]) == _i32(0xEEDCBA98)
    assert t["scales"].dtype == torch.float16 and t["g_idx"].dtype == torch.int32
    assert torch.equal(t["g_idx"], torch.zeros(8, dtype=torch.int32))
    # v2 stores the zero itself
    t2 = pack_gptq(qw, "gptq_v2")
    assert torch.equal(t2["qweight"], t["qweight"])
    assert int(t2["qzeros"][0, 0]) == _i32(0x87654321)
    back = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, -1, False, "gptq")
    _assert_same_qw(qw, back)


def _layout_cases(shapes):
    """(shape, group size, act_order) triples; act-order only where there are several groups."""
    return [pytest.param(shape, gs, ao, id=f"{shape[0]}x{shape[1]}-g{gs}-{'act_order' if ao else 'natural'}")
            for shape, gs in shapes for ao in ((False, True) if gs != -1 else (False,))]


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("shape,gs,act_order", _layout_cases([((48, 128), 32), ((24, 128), 64), ((40, 96), -1)]))
def test_gptq_v1_round_trip_exact(shape, gs, sym, act_order):
    out_f, in_f = shape
    qw = _rand_qw(out_f, in_f, gs, sym, act_order, seed=out_f + in_f, zmin=1)
    t = pack_gptq(qw, "gptq")
    n_groups = in_f // (in_f if gs == -1 else gs)
    assert t["qweight"].shape == (in_f // 8, out_f) and t["qzeros"].shape == (n_groups, (out_f + 7) // 8)
    assert t["scales"].shape == (n_groups, out_f) and t["g_idx"].shape == (in_f,)
    assert all(v.dtype == torch.int32 for k, v in t.items() if k != "scales")
    back = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, gs, sym, "gptq")
    _assert_same_qw(qw, back)
    assert (back.g_idx is None) == (not act_order)
    if act_order:
        assert torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.dequantize(torch.float64), _deq64(qw))


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act_order"])
def test_gptq_v2_round_trip_exact_with_zero_points_0_to_15(act_order):
    qw = _rand_qw(32, 128, 32, False, act_order, seed=21, zmin=0)
    qw.qzeros[0, :16] = torch.arange(16, dtype=torch.uint8)  # every value 0..15 occurs
    t = pack_gptq(qw, "gptq_v2")
    back = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32, False, "gptq_v2")
    _assert_same_qw(qw, back)


def test_gptq_v1_refuses_zero_point_0_and_unreadable_wrapped_zero():
    qw = _rand_qw(16, 64, 32, False, False, seed=22, zmin=1)
    qw.qzeros[1, 3] = 0
    with pytest.raises(LiteturboError, match="zero point of 0"):
        pack_gptq(qw, "gptq")
    t = pack_gptq(qw, "gptq_v2")  # v2 is fine
    # a v1 word whose nibble is 15 reads back as 16 (a zero of 0 written with the v1 offset): refused
    with pytest.raises(LiteturboError):
        unpack_gptq(t["qweight"], torch.full_like(t["qzeros"], -1), t["scales"], t["g_idx"], 4, 32, False, "gptq")
    with pytest.raises(LiteturboError):
        pack_gptq(qw, "gptq_v3")
    with pytest.raises(LiteturboError):
        unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32, False, "marlin")


def test_gptq_unpack_inconsistent_shapes_raise():
    qw = _rand_qw(16, 64, 32, False, False, seed=23, zmin=1)
    t = pack_gptq(qw, "gptq")
    with pytest.raises(LiteturboError):
        unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"][:32], 4, 32, False, "gptq")
    with pytest.raises(LiteturboError):
        unpack_gptq(t["qweight"], t["qzeros"], t["scales"][:, :8], t["g_idx"], 4, 32, False, "gptq")
    with pytest.raises(LiteturboError):
        unpack_gptq(t["qweight"], t["qzeros"][:1], t["scales"], t["g_idx"], 4, 32, False, "gptq")


def test_compressed_tensors_hand_worked_words():
    out_f, in_f = 8, 16
    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    codes[2, :8] = torch.arange(8)
    codes[2, 8:] = torch.arange(8, 16)
    zeros = torch.arange(8, dtype=torch.uint8).view(1, 8)  # out channel j: zero j
    qw = QuantizedWeight(bits=4, group_size=-1, sym=False, qweight=codes, qzeros=zeros,
                         scales=torch.ones(1, out_f, dtype=torch.float16))
    t = pack_compressed(qw)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (8, 2)
    assert int(t["weight_packed"][2, 0]) == 0x76543210 and int(t["weight_packed"][2, 1]) == _i32(0xFEDCBA98)
    assert t["weight_zero_point"].dtype == torch.int32 and t["weight_zero_point"].shape == (1, 1)
    assert int(t["weight_zero_point"][0, 0]) == 0x76543210
    assert t["weight_scale"].shape == (8, 1) and t["weight_scale"].dtype == torch.float16
    assert t["weight_shape"].tolist() == [8, 16]
    assert "weight_g_idx" not in t
    _assert_same_qw(qw, unpack_compressed(t, 4, -1, False))


@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("shape,gs,act_order", _layout_cases([((48, 128), 32), ((20, 128), 64), ((16, 96), -1)]))
def test_compressed_tensors_round_trip_exact(shape, gs, sym, act_order):
    out_f, in_f = shape
    qw = _rand_qw(out_f, in_f, gs, sym, act_order, seed=out_f * in_f)
    t = pack_compressed(qw)
    n_groups = in_f // (in_f if gs == -1 else gs)
    assert t["weight_packed"].shape == (out_f, in_f // 8) and t["weight_scale"].shape == (out_f, n_groups)
    assert ("weight_zero_point" in t) == (not sym)
    if not sym:
        assert t["weight_zero_point"].shape == ((out_f + 7) // 8, n_groups)
    assert ("weight_g_idx" in t) == act_order
    back = unpack_compressed(t, 4, gs, sym)
    _assert_same_qw(qw, back)
    assert torch.equal(back.dequantize(torch.float64), _deq64(qw))


def test_compressed_tensors_missing_tensors_raise():
    qw = _rand_qw(16, 64, 32, False, False, seed=24)
    t = pack_compressed(qw)
    with pytest.raises(LiteturboError):
        unpack_compressed({k: v for k, v in t.items() if k != "weight_zero_point"}, 4, 32, False)
    with pytest.raises(LiteturboError):
        unpack_compressed({k: v for k, v in t.items() if k != "weight_packed"}, 4, 32, False)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "compressed-tensors"])
def test_load_quantized_linears_from_state_dict(fmt):
    qws = {f"model.layers.0.{n}": _rand_qw(32, 64, 32, False, n != "mlp.up_proj", seed=30 + i, zmin=1)
           for i, n in enumerate(("self_attn.q_proj", "mlp.up_proj"))}
    sd = {"model.norm.weight": torch.ones(64)}
    for p, qw in qws.items():
        t = pack_compressed(qw) if fmt == "compressed-tensors" else pack_gptq(qw, fmt)
        sd.update({f"{p}.{k}": v for k, v in t.items()})
    if fmt == "compressed-tensors":
        config = {"quantization_config": compressed_quantization_config(4, 32, False, "group")}
    else:
        config = {"quantization_config": gptq_quantization_config(4, 32, False, True, False, 0.01, True, fmt)}
    got = load_quantized_linears(sd, quantization_spec(config))
    assert set(got) == set(qws) and list(sd) == ["model.norm.weight"]
    for p in qws:
        _assert_same_qw(qws[p], got[p])


# ------------------------------------------------------------------------------------------------
# 6. quantization_config blocks as other tools write them
# ------------------------------------------------------------------------------------------------
def test_quantization_spec_autoawq_block():
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64, "zero_point": True}
    assert quantization_spec({"quantization_config": qc}) == QuantSpec("awq", 4, 64, True, "")
    assert quantization_spec({"quantization_config": dict(qc, zero_point=False)}).zero_point is False
    # AutoAWQ's own quant_config keys
    qc2 = {"quant_method": "awq", "version": "GEMM", "w_bit": 4, "q_group_size": 128, "zero_point": True}
    assert quantization_spec({"quantization_config": qc2}) == QuantSpec("awq", 4, 128, True, "")


def test_quantization_spec_autogptq_blocks():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False,
          "checkpoint_format": "gptq"}
    assert quantization_spec({"quantization_config": qc}) == QuantSpec("gptq", 4, 64, True, "gptq")
    no_fmt = {k: v for k, v in qc.items() if k != "checkpoint_format"}
    assert quantization_spec({"quantization_config": no_fmt}) == QuantSpec("gptq", 4, 64, True, "gptq")
    v2 = dict(qc, checkpoint_format="gptq_v2", sym=True)
    assert quantization_spec({"quantization_config": v2}) == QuantSpec("gptq", 4, 64, False, "gptq_v2")
    # our own writer produces a block the reader understands
    ours = gptq_quantization_config(4, 32, False, True, False, 0.01, True)
    assert quantization_spec({"quantization_config": ours}) == QuantSpec("gptq", 4, 32, True, "gptq")


def test_quantization_spec_compressed_tensors_block():
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": 64}}}}
    assert quantization_spec({"quantization_config": qc}) == QuantSpec("compressed-tensors", 4, 64, False, "")
    chan = json.loads(json.dumps(qc))
    chan["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None, symmetric=False)
    assert quantization_spec({"quantization_config": chan}) == QuantSpec("compressed-tensors", 4, -1, True, "")
    ours = compressed_quantization_config(4, 32, False, "group")
    assert quantization_spec({"quantization_config": ours}) == QuantSpec("compressed-tensors", 4, 32, True, "")


def test_quantization_spec_none_and_unsupported():
    assert quantization_spec({}) is None
    assert quantization_spec({"quantization_config": None}) is None
    bad = [
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        {"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128, "zero_point": True},
        {"quant_method": "awq", "version": "gemm", "bits": 8, "group_size": 128, "zero_point": True},
        {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True},
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}},
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                               "strategy": "group", "group_size": 64}}}},
    ]
    for qc in bad:
        with pytest.raises(LiteturboError):
            quantization_spec({"quantization_config": qc})


# ------------------------------------------------------------------------------------------------
# 7. a GPTQ v1 act-order checkpoint written by hand loads in turbo
# ------------------------------------------------------------------------------------------------
GPTQ_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
FUSED = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv", "self_attn.o_proj": "o",
         "mlp.gate_proj": "gu", "mlp.up_proj": "gu", "mlp.down_proj": "down"}


def _random_hf_llama(cfg: dict, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return hf


def test_handwritten_gptq_v1_act_order_checkpoint_matches_float64_reference(tmp_path):
    hf = _random_hf_llama(GPTQ_TINY)
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(40)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    deq, natural = {}, {}
    for i in range(2):
        g_idx = {}  # layers fed by the same input share one g_idx (as GPTQ tools write them)
        for n, fuse in FUSED.items():
            p = f"model.layers.{i}.{n}"
            out_f, in_f = sd[f"{p}.weight"].shape
            if fuse not in g_idx:
                g_idx[fuse] = _act_order_g_idx(in_f, 32, g)
            qw = _rand_qw(out_f, in_f, 32, False, True, seed=100 + 10 * i + len(deq), zmin=1, g_idx=g_idx[fuse])
            assert not qw.has_trivial_g_idx()
            del sd[f"{p}.weight"]
            sd.update({f"{p}.{k}": v for k, v in pack_gptq(qw, "gptq").items()})
            deq[p] = _deq64(qw)
            natural[p] = _deq64(QuantizedWeight(4, 32, False, qw.qweight, qw.qzeros, qw.scales))
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                     "sym": False, "checkpoint_format": "gptq", "damp_percent": 0.01}
    (tmp_path / "config.json").write_text(json.dumps(config))

    model = LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)
    assert model.quant_method == "gptq"
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    got = run_turbo_logits(model, [ids[:17], ids[17:29], ids[29:]])

    def reference(weights):
        ref_model = hf.double()
        with torch.no_grad():
            for p, w in weights.items():
                ref_model.get_submodule(p).weight.copy_(w)
            return ref_model(torch.tensor([ids])).logits[0]

    ref = reference(deq)
    rel = float((got.double() - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, rel
    # the permuted g_idx matters: reading the same codes with natural groups gives other logits
    wrong = reference(natural)
    assert float((got.double() - wrong).abs().max() / wrong.abs().max()) > 1e-2


def test_act_order_qkv_with_different_g_idx_is_liteturbo_error_or_loads(tmp_path):
    hf = _random_hf_llama(dict(GPTQ_TINY, num_hidden_layers=1))
    hf.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for j, n in enumerate(FUSED):
        p = f"model.layers.0.{n}"
        out_f, in_f = sd.pop(f"{p}.weight").shape
        qw = _rand_qw(out_f, in_f, 32, False, True, seed=200 + j, zmin=1)  # independent g_idx per linear
        sd.update({f"{p}.{k}": v for k, v in pack_gptq(qw, "gptq").items()})
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                     "sym": False, "checkpoint_format": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from turbo.core.model import ConcatLinear

    model = LlamaModel.from_pretrained(tmp_path, get_backend("torch"), torch.float32)
    assert isinstance(model.layers[0].qkv, ConcatLinear)  # different g_idx: kept apart, not fused
    logits = run_turbo_logits(model, [[1, 2, 3, 4, 5]])
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------------
# 8. the layer-wise pipeline on a tiny random Llama
# ------------------------------------------------------------------------------------------------
PIPE_TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2)
PIPE_OPTS = dict(calib_samples=4, calib_seqlen=64, w_group_size=32, device="cpu", n_grid=5, loss_tokens=128)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer (only its tokenizer files are copied)."""
    from lite.formats import resolve_model

    try:
        smol = resolve_model(None)
    except LiteturboError as e:
        pytest.skip(f"needs the SmolLM2 tokenizer: {e}")
    path = tmp_path_factory.mktemp("tiny-src") / "tiny-llama"
    hf = _random_hf_llama(PIPE_TINY, seed=3)
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smol / name, path / name)
    return path


@pytest.fixture(scope="module")
def pipeline_outputs(tiny_src, tmp_path_factory):
    """Uninterrupted pipeline runs, one per method, made once and shared."""
    from lite.pipeline import PipelineConfig, quantize_model

    root = tmp_path_factory.mktemp("pipe")
    cache = {}

    def get(method: str):
        if method not in cache:
            fmt = {"out_format": "gptq"} if method == "gptq" else {}  # GPTQ v1 (the gptq default is tested apart)
            cache[method] = quantize_model(str(tiny_src), PipelineConfig(method=method, **fmt, **PIPE_OPTS),
                                           str(root / f"full-{method}"))
        return cache[method]
    return get


def _reference_logits(ckpt, ids):
    """float64 transformers forward with the checkpoint's own tensors (quantized linears dequantized)."""
    from lite.formats import load_config, load_state_dict

    config = load_config(ckpt)
    spec = quantization_spec(config)
    sd = load_state_dict(ckpt)
    for p, qw in load_quantized_linears(sd, spec).items():
        sd[f"{p}.weight"] = _deq64(qw)
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.float64).eval()
    missing, unexpected = hf.load_state_dict({k: v.double() for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


EXPECTED_QC = {
    "rtn": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True},
    "awq": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True},
    # GPTQ v1 (--format gptq) is symmetric by default: vLLM refuses asymmetric GPTQ v1 (docs/formats.md)
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
}


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_pipeline_writes_loadable_checkpoint(method, pipeline_outputs, tiny_src):
    out = pipeline_outputs(method)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    for k, v in EXPECTED_QC[method].items():
        assert qc[k] == v, (k, qc)
    spec = quantization_spec(config)
    assert spec.method == EXPECTED_QC[method]["quant_method"] and spec.group_size == 32
    assert spec.zero_point == (method != "gptq")
    if method == "gptq":
        qcfg = json.loads((out / "quantize_config.json").read_text())
        assert qcfg["checkpoint_format"] == "gptq" and "quant_method" not in qcfg
    assert (out / "tokenizer.json").is_file()
    assert not (out.parent / f"{out.name}.partial").exists()
    tensors = load_file(str(out / "model.safetensors"))
    marker = "qweight"
    n_q = sum(k.endswith(marker) for k in tensors)
    assert n_q == 2 * 7 and not any(k.startswith("model.layers.") and k.endswith("proj.weight") for k in tensors)
    if method == "gptq":  # v1 asymmetric: every stored zero - 1 is in [0, 14]
        for k, v in tensors.items():
            if k.endswith("qzeros"):
                z = unpack_int32(v, 4, dim=1, size=v.shape[1] * 8)
                assert int(z.max()) <= 14, k

    model = LlamaModel.from_pretrained(out, get_backend("torch"), torch.float32)
    assert model.quant_method == spec.method
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    got = run_turbo_logits(model, [ids[:16], ids[16:]])
    assert torch.isfinite(got).all()
    ref = _reference_logits(out, ids)
    rel = float((got.double() - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, rel
    # and it is still (roughly) the source model
    fp = LlamaModel.from_pretrained(tiny_src, get_backend("torch"), torch.float32)
    fp_logits = run_turbo_logits(fp, [ids])
    drift = float((got - fp_logits).abs().max() / fp_logits.abs().max())
    assert drift < 0.5, drift


def test_pipeline_gptq_act_order_compressed_tensors(tiny_src, tmp_path):
    from lite.pipeline import PipelineConfig, quantize_model

    cfg = PipelineConfig(method="gptq", act_order=True, static_groups=False, out_format="compressed-tensors",
                         **PIPE_OPTS)
    out = quantize_model(str(tiny_src), cfg, str(tmp_path / "ct"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    tensors = load_file(str(out / "model.safetensors"))
    assert any(k.endswith("weight_g_idx") for k in tensors)
    model = LlamaModel.from_pretrained(out, get_backend("torch"), torch.float32)
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    got = run_turbo_logits(model, [ids])
    ref = _reference_logits(out, ids)
    assert float((got.double() - ref).abs().max() / ref.abs().max()) <= 1e-4


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_pipeline_resume_is_identical_to_uninterrupted(method, pipeline_outputs, tiny_src, tmp_path):
    from lite.pipeline import PipelineConfig, quantize_model

    work = tmp_path / f"resumed-{method}"
    partial = tmp_path / f"resumed-{method}.partial"
    cfg = PipelineConfig(method=method, **({"out_format": "gptq"} if method == "gptq" else {}), **PIPE_OPTS)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(tiny_src), cfg, str(work), stop_after_layers=1)
    assert (partial / "layer_0000.safetensors").is_file()
    assert not (partial / "layer_0001.safetensors").exists()
    assert not work.exists()
    if method == "gptq":
        other = PipelineConfig(method=method, out_format="gptq", **dict(PIPE_OPTS, damp_percent=0.02))
        with pytest.raises(LiteturboError, match="options differ .damp_percent: 0.01 then, 0.02 now"):
            quantize_model(str(tiny_src), other, str(work), resume=True)
        assert (partial / "layer_0000.safetensors").is_file()  # refused before touching it
    out = quantize_model(str(tiny_src), cfg, str(work), resume=True)
    assert out == work.absolute() and not partial.exists()
    full = load_file(str(pipeline_outputs(method) / "model.safetensors"))
    resumed = load_file(str(work / "model.safetensors"))
    assert set(full) == set(resumed)
    for k in full:
        assert full[k].dtype == resumed[k].dtype and torch.equal(full[k], resumed[k]), k


def test_pipeline_resume_with_other_options_raises(tiny_src, tmp_path):
    from lite.pipeline import PipelineConfig, quantize_model

    work = tmp_path / "w"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(str(tiny_src), PipelineConfig(method="rtn", **PIPE_OPTS), str(work), stop_after_layers=1)
    with pytest.raises(LiteturboError):
        quantize_model(str(tiny_src), PipelineConfig(method="rtn", **dict(PIPE_OPTS, w_sym=True)), str(work),
                       resume=True)
    # without --resume the stale partial folder is replaced and the run completes
    out = quantize_model(str(tiny_src), PipelineConfig(method="rtn", **dict(PIPE_OPTS, w_sym=True)), str(work))
    assert quantization_spec(json.loads((out / "config.json").read_text())).zero_point is False


@pytest.mark.parametrize("bad", [dict(method="rtn", w_bits=8), dict(method="rtn", w_group_size=12),
                                 dict(method="bogus"), dict(method="awq", act_order=True),
                                 dict(method="gptq", damp_percent=0.0), dict(method="gptq", damp_percent=1.0),
                                 dict(method="awq", calib_samples=0), dict(method="rtn", out_format="gguf"),
                                 dict(method="rtn", device="tpu")])
def test_pipeline_config_validates_options(bad):
    from lite.pipeline import PipelineConfig

    with pytest.raises(LiteturboError):
        PipelineConfig(**bad)


@pytest.mark.parametrize("bad", [dict(method="gptq", block_size=0), dict(method="gptq", block_size=-8),
                                 dict(method="awq", n_grid=0)])
def test_pipeline_config_rejects_nonpositive_block_size_and_n_grid(bad):
    from lite.pipeline import PipelineConfig

    with pytest.raises(LiteturboError):
        PipelineConfig(**bad)


# ------------------------------------------------------------------------------------------------
# 9. calibration sampling
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_src):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_src))


def test_calibration_samples_deterministic_per_seed(tok):
    from lite.calibration import calibration_samples

    a = calibration_samples(tok, "c4", n_samples=5, seqlen=32, seed=0)
    b = calibration_samples(tok, "c4", n_samples=5, seqlen=32, seed=0)
    c = calibration_samples(tok, "c4", n_samples=5, seqlen=32, seed=1)
    assert len(a) == 5
    for t in a:
        assert t.dtype == torch.long and t.dim() == 2 and t.shape[0] == 1 and 1 <= t.shape[1] <= 32
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, c))


def test_calibration_local_txt_and_jsonl(tok, tmp_path):
    from lite.calibration import calibration_samples, load_texts

    paras = [f"Paragraph number {i} talks about quantization of language models and calibration data."
             for i in range(30)]
    txt = tmp_path / "calib.txt"
    txt.write_text("\n\n".join(paras), encoding="utf-8")
    assert load_texts(str(txt)) == paras
    s = calibration_samples(tok, str(txt), n_samples=4, seqlen=16, seed=3)
    assert len(s) == 4 and all(1 <= t.shape[1] <= 16 for t in s)
    ids = torch.cat(s, 1)[0].tolist()
    assert tok.eos_token_id in ids  # documents are joined with EOS

    jl = tmp_path / "calib.jsonl"
    jl.write_text("\n".join(json.dumps({"text": p, "id": i}) for i, p in enumerate(paras)), encoding="utf-8")
    assert load_texts(str(jl)) == paras
    s2 = calibration_samples(tok, str(jl), n_samples=4, seqlen=16, seed=3)
    assert [t.tolist() for t in s2] == [t.tolist() for t in s]  # same documents, same windows

    nojl = tmp_path / "notext.jsonl"
    nojl.write_text("\n".join(json.dumps({"content": p}) for p in paras), encoding="utf-8")
    with pytest.raises(LiteturboError, match="text"):
        calibration_samples(tok, str(nojl), n_samples=2, seqlen=16)
    with pytest.raises(LiteturboError):
        calibration_samples(tok, str(tmp_path / "missing.jsonl"), n_samples=2, seqlen=16)
    with pytest.raises(LiteturboError):
        calibration_samples(tok, str(txt), n_samples=0, seqlen=16)
