"""AWQ GEMM packing (exact bit layout) and the pure-Python KV BlockManager."""
from __future__ import annotations

import pytest
import torch

from backends.types import QuantizedWeight
from lite.formats import LiteturboError, pack_awq, unpack_awq
from lite.formats.awq import AWQ_ORDER, pack_awq_int32, unpack_awq_int32
from turbo.core.block_manager import BlockManager, OutOfBlocks


# ------------------------------------------------------------------------------------------------
# AWQ GEMM: hand-worked words
# ------------------------------------------------------------------------------------------------
def _qw_from_codes(codes_per_out_channel: list[int], zeros: list[int] | None = None) -> QuantizedWeight:
    """out = len(codes), in = 1, one group: canonical qweight [out, 1]."""
    out_f = len(codes_per_out_channel)
    zeros = zeros if zeros is not None else [0] * out_f
    return QuantizedWeight(
        bits=4, group_size=-1, sym=False,
        qweight=torch.tensor(codes_per_out_channel, dtype=torch.uint8)[:, None],
        qzeros=torch.tensor([zeros], dtype=torch.uint8),
        scales=torch.ones(1, out_f, dtype=torch.float16),
    )


def test_awq_order_constant():
    assert AWQ_ORDER == [0, 2, 4, 6, 1, 3, 5, 7]


def test_awq_pack_hand_worked_word():
    # output channel j has code j; nibble i (from bit 0) holds channel AWQ_ORDER[i] -> 0,2,4,6,1,3,5,7
    qw = _qw_from_codes([0, 1, 2, 3, 4, 5, 6, 7], zeros=[7, 6, 5, 4, 3, 2, 1, 0])
    packed = pack_awq(qw)
    assert packed["qweight"].dtype == torch.int32
    assert packed["qweight"].shape == (1, 1)
    assert int(packed["qweight"][0, 0]) == 0x75316420
    # zeros packed the same way, no offset: channel j has zero 7-j -> nibbles 7,5,3,1,6,4,2,0
    assert packed["qzeros"].dtype == torch.int32 and packed["qzeros"].shape == (1, 1)
    assert int(packed["qzeros"][0, 0]) == 0x02461357
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (1, 8)


def test_awq_pack_signed_reinterpretation_top_nibble():
    # channel 7 sits in nibble 7 (bits 28..31); code 15 there sets the sign bit: 0xF0000000 as int32
    qw = _qw_from_codes([0, 0, 0, 0, 0, 0, 0, 15])
    word = pack_awq(qw)["qweight"]
    assert word.dtype == torch.int32
    assert int(word[0, 0]) == 0xF0000000 - (1 << 32) == -268435456

    # channels 8..15 codes 8..15: nibbles 8,10,12,14,9,11,13,15 -> 0xFDB9ECA8 (negative as int32)
    qw = _qw_from_codes(list(range(8, 16)))
    assert int(pack_awq(qw)["qweight"][0, 0]) == 0xFDB9ECA8 - (1 << 32)

    # all 15 -> 0xFFFFFFFF == -1; unpack gives back 15 everywhere
    word = pack_awq_int32(torch.full((1, 8), 15, dtype=torch.uint8))
    assert int(word[0, 0]) == -1
    assert torch.equal(unpack_awq_int32(word), torch.full((1, 8), 15, dtype=torch.uint8))


def test_awq_pack_two_columns_and_rows_hand_worked():
    # in = 2 (rows of the packed [in, out/8] tensor), out = 16 (two packed columns)
    codes = torch.zeros(16, 2, dtype=torch.uint8)  # canonical [out, in]
    codes[3, 0] = 9     # row 0, column 0, channel 3 -> nibble 5 (AWQ_ORDER[5] == 3)
    codes[8, 1] = 1     # row 1, column 1, channel 8+0 -> nibble 0
    codes[14, 1] = 0xC  # row 1, column 1, channel 8+6 -> nibble 3
    qw = QuantizedWeight(bits=4, group_size=2, sym=False, qweight=codes,
                         qzeros=torch.zeros(1, 16, dtype=torch.uint8), scales=torch.ones(1, 16, dtype=torch.float16))
    w = pack_awq(qw)["qweight"]
    assert w.shape == (2, 2)
    assert w.tolist() == [[0x00900000, 0], [0, 0x0000C001]]


def test_awq_unpack_hand_worked_word():
    packed = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_awq_int32(packed).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    packed = torch.tensor([[-268435456]], dtype=torch.int32)  # 0xF0000000
    assert unpack_awq_int32(packed).tolist() == [[0, 0, 0, 0, 0, 0, 0, 15]]


# ------------------------------------------------------------------------------------------------
# AWQ GEMM: round trip and errors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_f,in_f,gs", [(8, 32, 32), (64, 256, 64), (200, 384, 128), (48, 128, -1)])
def test_awq_round_trip_exact(out_f, in_f, gs):
    gen = torch.Generator().manual_seed(out_f + in_f)
    n_groups = 1 if gs == -1 else in_f // gs
    qw = QuantizedWeight(
        bits=4, group_size=gs, sym=False,
        qweight=torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8),
        qzeros=torch.randint(0, 16, (n_groups, out_f), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(n_groups, out_f, generator=gen) * 0.1).to(torch.float16),
    )
    packed = pack_awq(qw)
    assert packed["qweight"].dtype == torch.int32 and packed["qweight"].shape == (in_f, out_f // 8)
    assert packed["qzeros"].dtype == torch.int32 and packed["qzeros"].shape == (n_groups, out_f // 8)
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (n_groups, out_f)

    # packed word of qweight[k, c], nibble i == code of output channel 8c + AWQ_ORDER[i] at input k
    k, c = in_f - 1, out_f // 8 - 1
    word = int(packed["qweight"][k, c]) & 0xFFFFFFFF
    for i in range(8):
        assert (word >> (4 * i)) & 0xF == int(qw.qweight[8 * c + AWQ_ORDER[i], k])

    back = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], bits=4, group_size=gs)
    assert back.qweight.dtype == torch.uint8 and back.qzeros.dtype == torch.uint8
    assert torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.qzeros, qw.qzeros)
    assert torch.equal(back.scales, qw.scales)
    assert back.group_size == gs and back.bits == 4 and back.sym is False
    assert torch.equal(back.dequantize(torch.float64), qw.dequantize(torch.float64))


def test_awq_unpack_without_zero_point_uses_8():
    gen = torch.Generator().manual_seed(3)
    out_f, in_f, gs = 16, 64, 32
    qweight = pack_awq_int32(torch.randint(0, 16, (in_f, out_f), generator=gen, dtype=torch.uint8))
    scales = torch.rand(in_f // gs, out_f, generator=gen).to(torch.float16)
    garbage_zeros = torch.full((in_f // gs, out_f // 8), 0x12345678, dtype=torch.int32)
    qw = unpack_awq(qweight, garbage_zeros, scales, bits=4, group_size=gs, zero_point=False)
    assert qw.sym is True
    assert qw.qzeros.dtype == torch.uint8 and qw.qzeros.shape == (in_f // gs, out_f)
    assert torch.all(qw.qzeros == 8)


def test_awq_pack_act_order_raises():
    out_f, in_f, gs = 16, 64, 32
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(1))
    qw = QuantizedWeight(
        bits=4, group_size=gs, sym=False,
        qweight=torch.zeros(out_f, in_f, dtype=torch.uint8),
        qzeros=torch.zeros(in_f // gs, out_f, dtype=torch.uint8),
        scales=torch.ones(in_f // gs, out_f, dtype=torch.float16),
        g_idx=(perm // gs).to(torch.int32),
    )
    assert not qw.has_trivial_g_idx()
    with pytest.raises(LiteturboError):
        pack_awq(qw)


def test_awq_pack_trivial_explicit_g_idx_ok():
    out_f, in_f, gs = 16, 64, 32
    qw = QuantizedWeight(
        bits=4, group_size=gs, sym=False,
        qweight=torch.ones(out_f, in_f, dtype=torch.uint8),
        qzeros=torch.zeros(in_f // gs, out_f, dtype=torch.uint8),
        scales=torch.ones(in_f // gs, out_f, dtype=torch.float16),
        g_idx=(torch.arange(in_f) // gs).to(torch.int32),
    )
    packed = pack_awq(qw)
    assert torch.all(packed["qweight"] == 0x11111111)


def test_awq_pack_bad_shapes_raise():
    with pytest.raises(LiteturboError):
        pack_awq_int32(torch.zeros(2, 12, dtype=torch.uint8))  # 12 not a multiple of 8
    with pytest.raises(LiteturboError):
        pack_awq_int32(torch.zeros(2, 8, dtype=torch.uint8), bits=8)
    qweight = torch.zeros(64, 2, dtype=torch.int32)
    with pytest.raises(LiteturboError):  # scales for the wrong group count
        unpack_awq(qweight, torch.zeros(2, 2, dtype=torch.int32), torch.ones(3, 16, dtype=torch.float16), 4, 32)
    with pytest.raises(LiteturboError):  # in_features not divisible by group size
        unpack_awq(qweight, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 16, dtype=torch.float16), 4, 48)


# ------------------------------------------------------------------------------------------------
# BlockManager
# ------------------------------------------------------------------------------------------------
def test_block_manager_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert list(bm.free_queue) == [0, 1, 2, 3] and bm.num_free == 4
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(1) == 1 and bm.blocks_needed(2) == 1
    assert bm.blocks_needed(3) == 2

    a: list[int] = []
    bm.ensure_capacity(a, 3)  # 2 blocks from the head
    assert a == [0, 1]
    assert list(bm.free_queue) == [2, 3]
    assert bm.ref_count == [1, 1, 0, 0]

    bm.ensure_capacity(a, 4)  # still fits in 2 blocks: no-op
    assert a == [0, 1] and bm.num_free == 2

    b: list[int] = []
    bm.ensure_capacity(b, 1)
    assert b == [2] and list(bm.free_queue) == [3]

    bm.ensure_capacity(a, 5)  # a grows into the last block
    assert a == [0, 1, 3] and list(bm.free_queue) == [] and bm.num_free == 0
    assert bm.ref_count == [1, 1, 1, 1]

    assert bm.slots(a, 0, 5) == [0, 1, 2, 3, 6]
    assert bm.slots(a, 3, 5) == [3, 6]
    assert bm.slots(b, 0, 2) == [4, 5]
    assert bm.slots(a, 2, 2) == []

    with pytest.raises(OutOfBlocks):
        bm.ensure_capacity(b, 3)
    assert b == [2] and bm.num_free == 0  # a failed allocation changes nothing

    bm.truncate(a, 2)  # keep 1 block: releases 3 then 1 (last first)
    assert a == [0]
    assert list(bm.free_queue) == [3, 1]
    assert bm.ref_count == [1, 0, 1, 0]

    bm.truncate(a, 2)  # already minimal: no-op
    assert a == [0] and list(bm.free_queue) == [3, 1]

    bm.free(b)
    assert b == [] and list(bm.free_queue) == [3, 1, 2]

    c: list[int] = []
    bm.ensure_capacity(c, 4)  # takes from the head: 3, 1
    assert c == [3, 1] and list(bm.free_queue) == [2]
    assert bm.slots(c, 0, 4) == [6, 7, 2, 3]

    bm.free(a)
    bm.free(c)  # released last first: 1, then 3
    assert list(bm.free_queue) == [2, 0, 1, 3]
    assert bm.ref_count == [0, 0, 0, 0] and bm.num_free == 4

    d: list[int] = []
    bm.ensure_capacity(d, 8)
    assert d == [2, 0, 1, 3] and bm.num_free == 0
    assert bm.slots(d, 0, 8) == [4, 5, 0, 1, 2, 3, 6, 7]
    with pytest.raises(OutOfBlocks):
        bm.ensure_capacity([], 1)


def test_block_manager_truncate_to_zero_and_double_free():
    bm = BlockManager(4, 2)
    a: list[int] = []
    bm.ensure_capacity(a, 4)
    bm.truncate(a, 0)
    assert a == [] and list(bm.free_queue) == [2, 3, 1, 0]
    with pytest.raises(RuntimeError):
        bm._release(0)  # already free
    assert list(bm.free_queue) == [2, 3, 1, 0]


def test_block_manager_out_of_blocks_is_runtime_error_and_exact_need():
    bm = BlockManager(4, 2)
    with pytest.raises(OutOfBlocks, match="need 5 more KV blocks, 4 free of 4"):
        bm.ensure_capacity([], 9)
    assert issubclass(OutOfBlocks, RuntimeError)
    assert bm.num_free == 4


def test_block_manager_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 2)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
