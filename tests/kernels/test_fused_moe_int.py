"""The fused MoE kernel with 4- and 8-bit integer experts (GPTQ / AWQ: codes packed along the input features, a
float32 scale and a uint8 zero point per group), against the torch reference, and the reference's dequantization
against values worked out in the test from the layout's definition.

In Triton's interpreter on the CPU (tests/conftest.py): correctness only, no GPU timing. The kernel decodes the
chosen experts' tiles in registers when no expert gets more than one row (T * k <= E: the decode routing below and
`test_int_experts_decoded_in_registers`), and otherwise expands the experts to the dense dtype and runs the dense
kernel (kernels/moe_int.py). `(code - zero) * scale` is one exact
subtraction and one rounded float32 product on both sides, so in float32 the tolerance is the summation order
alone. Unchosen experts are poisoned (NaN scales): the expansion decodes them too, but no output may read them.
"""

from __future__ import annotations

import pytest
import torch

from batchllm.kernels.moe_reference import dequantize_int_experts
from tests.kernels.test_fused_moe import ROUTINGS, _fused_moe_triton, check, make_moe, random_routing

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
HIDDEN, INTER = 128, 64  # multiples of the group sizes tested; HIDDEN is two 64-wide K tiles


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[..., K]` codes → `[..., K / pack]` int32 words, code k in bits `bits * (k % pack)` of word `k // pack`:
    the layout's definition, one field at a time in Python integers."""
    pack = 32 // bits
    flat = codes.reshape(-1, codes.shape[-1]).tolist()
    words = []
    for row in flat:
        row_words = []
        for j in range(len(row) // pack):
            word = sum(row[j * pack + i] << (bits * i) for i in range(pack))
            row_words.append(word - 2**32 if word >= 2**31 else word)
        words.append(row_words)
    return torch.tensor(words, dtype=torch.int32).reshape(*codes.shape[:-1], -1)


def int_experts(args: dict, bits: int, group_size: int, seed: int) -> dict:
    """Replace `args`' dense experts by random integer ones: codes, asymmetric zero points, scales; the unchosen
    experts' scales NaN."""
    gen = torch.Generator().manual_seed(seed)
    unchosen = sorted(set(range(args["w13"].shape[0])) - set(args["topk_ids"].flatten().tolist()))
    out = dict(args)
    for name in ("w13", "w2"):
        experts, rows, cols = args[name].shape
        groups = 1 if group_size == -1 else cols // group_size
        codes = torch.randint(0, 2**bits, (experts, rows, cols), generator=gen)
        zero = torch.randint(0, 2**bits, (experts, rows, groups), generator=gen).to(torch.uint8)
        # Codes minus zeros span +-2^bits: scales of 1 / (2^bits sqrt(K)) give outputs of order one.
        scale = torch.rand(experts, rows, groups, generator=gen) / (2**bits * cols**0.5)
        scale[unchosen] = float("nan")
        device = args["hidden"].device
        out[name], out[f"{name}_scale"], out[f"{name}_zero"] = (t.to(device) for t in (pack_rows(codes, bits), scale,
                                                                                        zero))
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("routing", ["decode T=1 k=2 (6 of 8 experts unchosen)", "uneven segments 17, 1, 0, 33",
                                     "one expert takes every token, k=1"])
def test_int_experts_against_reference(routing, group_size, bits):
    fused_moe_triton = _fused_moe_triton()
    args = int_experts(make_moe(*ROUTINGS[routing], HIDDEN, INTER, torch.float32, bias=True, seed=5), bits,
                       group_size, 6)
    check(fused_moe_triton(**args, activation="silu"), args, "silu", None)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 64), (4, -1)])
def test_int_experts_decoded_in_registers(monkeypatch, bits, group_size):
    """4 tokens, k = 2, 8 experts: no more rows than experts, so the kernel decodes the chosen experts' tiles in
    registers (expanding them would fail here); some experts take two rows, some none."""
    fused_moe_triton = _fused_moe_triton()
    from batchllm.kernels import moe

    monkeypatch.setattr(moe, "dequantize_int_triton", lambda *args: pytest.fail("expanded the experts"))
    topk_ids = random_routing(4, 2, 8, torch.Generator().manual_seed(2))
    args = int_experts(make_moe(topk_ids, 8, HIDDEN, INTER, torch.float32, bias=True, seed=9), bits, group_size, 10)
    check(fused_moe_triton(**args, activation="swigluoai", swiglu_limit=7.0), args, "swigluoai", 7.0)


def test_int_experts_float16():
    fused_moe_triton = _fused_moe_triton()
    args = make_moe(*ROUTINGS["T=9 k=2, 3 of 8 experts chosen"], HIDDEN, INTER, torch.float16, bias=False, seed=7)
    args = int_experts(args, 4, 32, 8)
    check(fused_moe_triton(**args, activation="silu"), args, "silu", None)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 64), (4, -1)])
def test_expansion_equals_the_reference_bit_for_bit(bits, group_size):
    pytest.importorskip("triton")
    from batchllm.kernels.moe_int import dequantize_int_triton

    args = int_experts(make_moe(*ROUTINGS["T=9 k=2, 3 of 8 experts chosen"], HIDDEN, INTER, torch.float32,
                                bias=False, seed=3), bits, group_size, 4)
    for name, in_features in (("w13", HIDDEN), ("w2", INTER)):
        weight, scale, zero = args[name], args[f"{name}_scale"], args[f"{name}_zero"]
        got = dequantize_int_triton(weight, scale, zero, in_features, torch.float32)
        expected = dequantize_int_experts(weight, scale, zero, in_features)
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), name


def test_int_dequantization_by_hand():
    """One 4-bit row of 16 features in two groups of 8, its two words written out nibble by nibble: feature k in
    bits 4k.. of word 0 (k < 8), then of word 1; `w = (code - zero) * scale` per group."""
    codes = [0, 1, 2, 3, 4, 5, 6, 7, 15, 14, 13, 12, 11, 10, 9, 8]
    words = torch.tensor([[[0x76543210, 0x89ABCDEF - 2**32]]], dtype=torch.int32)  # the second word's top bit is set
    scale = torch.tensor([[[0.5, 0.25]]])
    zero = torch.tensor([[[3, 8]]], dtype=torch.uint8)
    expected = [(c - 3) * 0.5 for c in codes[:8]] + [(c - 8) * 0.25 for c in codes[8:]]
    assert dequantize_int_experts(words, scale, zero, 16).tolist() == [[expected]]
    # 8 bits: four codes a word, one group over the row (per channel).
    word = torch.tensor([[[0x01FF8040, 0x7F000102]]], dtype=torch.int32)
    got = dequantize_int_experts(word, torch.tensor([[[2.0]]]), torch.tensor([[[128]]], dtype=torch.uint8), 8)
    assert got.tolist() == [[[(c - 128) * 2.0 for c in (0x40, 0x80, 0xFF, 0x01, 0x02, 0x01, 0x00, 0x7F)]]]
