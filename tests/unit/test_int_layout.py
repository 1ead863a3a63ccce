"""The packed-integer layout every 4-/8-bit checkpoint is converted to (`batchllm/model/quantization/int_packed.py`):
packing against hand-written words, the random-weight quantizer against its definition, and the act-order sort
the GPU path does once at load against the unsorted product."""

from __future__ import annotations

import pytest
import torch

from batchllm.kernels.reference import dequantize_int, int_matmul, unpack_int
from batchllm.model.quantization.int_packed import dense_weight, pack_int, quantize_int_rtn, sort_act_order


def test_pack_int_writes_the_words_by_hand():
    # Column 0 holds codes 1..8 (row k in bits 4k..4k+3), column 1 the codes 15, 0, 15, 0, ...
    codes = torch.tensor([[k + 1, 15 * (1 - k % 2)] for k in range(8)])
    words = pack_int(codes, 4)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() & 0xFFFFFFFF == 0x87654321
    assert words[0, 1].item() & 0xFFFFFFFF == 0x0F0F0F0F
    eight = pack_int(torch.tensor([[1], [2], [255], [4]]), 8)
    assert eight[0, 0].item() & 0xFFFFFFFF == 0x04FF0201
    assert torch.equal(unpack_int(words, 4), codes.to(torch.int32))


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_are_inverse(bits):
    codes = torch.randint(0, 2**bits, (64, 10), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_int(pack_int(codes, bits), bits), codes.to(torch.int32))


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_round_to_nearest_quantizes_each_group_by_its_absmax(group_size):
    weight = torch.randn(6, 200, generator=torch.Generator().manual_seed(0))  # 200: a partial last group of 128
    packed = quantize_int_rtn(weight, 4, group_size)
    size = 200 if group_size == -1 else group_size
    groups = -(-200 // size)
    assert packed.scales.shape == (groups, 6) and torch.all(packed.zeros == 8)
    for g in range(groups):
        block = weight[:, g * size:(g + 1) * size]
        assert torch.allclose(packed.scales[g], block.abs().amax(dim=1) / 7)
    w = dequantize_int(packed.qweight, packed.scales, packed.zeros, 4, size).T
    scale_of = packed.scales.T.repeat_interleave(size, dim=1)[:, :200]
    assert torch.all((w - weight).abs() <= scale_of / 2 + 1e-6)


def act_order_weight(in_features: int, out_features: int, group_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (in_features, out_features), generator=generator)
    groups = in_features // group_size
    scales = torch.rand(groups, out_features, generator=generator) / 10 + 0.01
    zeros = torch.randint(0, 16, (groups, out_features), generator=generator).to(torch.uint8)
    # GPTQ desc_act: the features quantized in a permuted order, group i = positions [i G, (i + 1) G) of it.
    order = torch.randperm(in_features, generator=generator)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    return pack_int(codes, 4), scales, zeros, g_idx


def test_sorting_act_order_rows_keeps_the_product_and_drops_a_trivial_g_idx():
    qweight, scales, zeros, g_idx = act_order_weight(256, 24, 32)
    sorted_qweight, sorted_g_idx, perm = sort_act_order(qweight, g_idx, 4, 32)
    assert sorted_g_idx is None  # the whole layer: every group is 32 contiguous rows after the sort
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = int_matmul(x, qweight, scales, zeros, 4, 32, g_idx)
    assert torch.allclose(int_matmul(x.index_select(1, perm), sorted_qweight, scales, zeros, 4, 32), expected,
                          atol=1e-4)
    unsorted = dequantize_int(qweight, scales, zeros, 4, 32, g_idx).T
    assert torch.equal(dense_weight(sorted_qweight, scales, zeros, 4, 32, None, perm), unsorted)


def test_a_row_parallel_slice_of_an_act_order_weight_keeps_its_partial_groups():
    qweight, scales, zeros, g_idx = act_order_weight(256, 24, 32, seed=3)
    codes = unpack_int(qweight, 4)
    rank_rows = slice(128, 256)  # rank 1 of 2: its input features fall in any of the 8 groups
    part = pack_int(codes[rank_rows], 4)
    sorted_qweight, sorted_g_idx, perm = sort_act_order(part, g_idx[rank_rows], 4, 32)
    assert sorted_g_idx is not None and torch.all(sorted_g_idx[1:] >= sorted_g_idx[:-1])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = int_matmul(x, part, scales, zeros, 4, 32, g_idx[rank_rows])
    assert torch.allclose(int_matmul(x.index_select(1, perm), sorted_qweight, scales, zeros, 4, 32, sorted_g_idx),
                          expected, atol=1e-4)
