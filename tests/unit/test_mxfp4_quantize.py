"""MXFP4 quantization (`quantization="mxfp4"`, random MXFP4 experts) against a reference written here in Python
floats: each block's scale the smallest power of two with `6 * scale >= absmax` (triton_kernels' rounding up,
which transformers' gpt-oss quantizer uses), each element the nearest of the 16 E2M1 values times the scale, a tie
going to the code whose mantissa bit is 0 (OCP MX v1.0: round to nearest, ties to even)."""

from __future__ import annotations

import math

import pytest
import torch

from batchllm.kernels.moe_reference import dequantize_mxfp4
from batchllm.model.quantization.config import MXFP4, QuantConfig
from batchllm.model.quantization.experts import Mxfp4ExpertMethod
from batchllm.model.quantization.mxfp4 import quantize_mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0-7; 8-15 are their negatives


def _reference_block(values: list[float]) -> tuple[int, list[float]]:
    """(E8M0 scale byte, dequantized values) of one block of 32."""
    absmax = max(abs(v) for v in values)
    exponent = 0 if absmax == 0 else math.ceil(math.log2(absmax / 6))
    while 6 * 2.0 ** (exponent - 1) >= absmax > 0:  # log2 of a float quotient may land one off
        exponent -= 1
    while 6 * 2.0 ** exponent < absmax:
        exponent += 1
    scale = 2.0 ** exponent
    out = []
    for value in values:
        distances = [abs(abs(value) - m * scale) for m in E2M1]
        best = min(distances)
        code = min(c for c, d in enumerate(distances) if d == best and (c % 2 == 0 or distances.count(best) == 1))
        out.append(math.copysign(E2M1[code] * scale, value))
    return exponent + 127, out


@pytest.mark.parametrize("magnitude", [1e-3, 0.02, 1.0, 300.0])
def test_quantize_mxfp4_equals_the_reference(magnitude) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 96, generator=generator) * magnitude
    weight[1, 32:64] = 0  # a zero block
    # Every midpoint between E2M1 values, exactly, in a block whose absmax is 6 times a power of two: ties.
    midpoints = [(a + b) / 2 for a, b in zip(E2M1, E2M1[1:])]
    power = 2.0 ** round(math.log2(magnitude))
    weight[2, :32] = torch.tensor(([6.0] + midpoints + [-m for m in midpoints]) * 3)[:32] * power
    packed, scales = quantize_mxfp4(weight)
    got = dequantize_mxfp4(packed, scales)
    for row in range(weight.shape[0]):
        for block in range(3):
            values = weight[row, 32 * block:32 * (block + 1)].tolist()
            scale, expected = _reference_block(values)
            assert scales[row, block].item() == scale
            assert got[row, 32 * block:32 * (block + 1)].tolist() == expected


def test_the_midpoints_round_to_even_codes() -> None:
    """Worked by hand: in a block of scale 1, 0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4,
    5 → 4."""
    values = torch.zeros(1, 32)
    values[0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -5.0])
    packed, scales = quantize_mxfp4(values)
    assert scales.tolist() == [[127]]
    assert dequantize_mxfp4(packed, scales)[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, -4.0]


def test_a_split_that_cuts_a_block_is_refused() -> None:
    """A rank's expert weight of 16 input features (an intermediate size of 32 over two ranks): half a block."""
    method = Mxfp4ExpertMethod(QuantConfig(MXFP4))
    assert method.parts(64, 32)["weight_scale"].shape == (64, 1)
    with pytest.raises(ValueError, match="multiples of 32"):
        method.parts(64, 16)
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
