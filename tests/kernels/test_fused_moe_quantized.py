"""The fused MoE kernel with quantized experts (FP8 E4M3 per-row scales; MXFP4 E2M1 codes with E8M0 block scales),
dequantized in registers, against the torch reference, and the reference's MXFP4 decoding against values worked
out by hand from the OCP Microscaling (MX) v1.0 specification.

In the interpreter on the CPU (tests/conftest.py) in float32 and float16 (see test_fused_moe.py for bfloat16). An
E4M3 or E2M1 code times its scale is exact in either dtype, so the kernel and the reference multiply the same
values: the float32 tolerance is the summation order alone. Unchosen experts are poisoned: NaN FP8 scales, and
MXFP4 scale 255 (NaN in E8M0; infinity, hence NaN or infinity on every product, in the kernel's decoding).
"""

from __future__ import annotations

import pytest
import torch

from batchllm.kernels.moe_reference import dequantize_mxfp4
from tests.kernels.test_fused_moe import ROUTINGS, _fused_moe_triton, check, make_moe

# Expanding MXFP4 experts (the kernel's path for all but the smallest batches) decodes the unchosen, poisoned ones too.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
HIDDEN, INTER = 96, 64  # multiples of the MXFP4 block (32); HIDDEN is not a multiple of the 64-wide K tile


def quantize_experts(args: dict, fmt: str, seed: int) -> dict:
    """Replace `args`' dense expert weights by random FP8 / MXFP4 ones (and their scales), unchosen experts poisoned."""
    gen = torch.Generator().manual_seed(seed)
    unchosen = sorted(set(range(args["w13"].shape[0])) - set(args["topk_ids"].flatten().tolist()))
    device = args["hidden"].device
    out = dict(args)
    for name in ("w13", "w2"):
        experts, rows, cols = args[name].shape
        if fmt == "fp8":
            codes = (torch.randn(experts, rows, cols, generator=gen) * 100).clamp(-448, 448)
            scale = torch.rand(experts, rows, generator=gen) * cols ** -0.5 / 50
            scale[unchosen] = float("nan")
            out[name], out[f"{name}_scale"] = codes.to(torch.float8_e4m3fn), scale
        else:
            packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
            # 2^-3 .. 2^-1 times codes up to 6, over K terms: outputs of order one.
            scale = torch.randint(124, 127, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
            scale[unchosen] = 255
            out[name], out[f"{name}_scale"] = packed, scale
        out[name], out[f"{name}_scale"] = out[name].to(device), out[f"{name}_scale"].to(device)
    return out


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("routing", ["decode T=1 k=2 (6 of 8 experts unchosen)", "uneven segments 17, 1, 0, 33",
                                     "one expert takes every token, k=1", "64-row blocks, a partial last one"])
def test_quantized_experts_against_reference(routing, fmt):
    fused_moe_triton = _fused_moe_triton()
    args = quantize_experts(make_moe(*ROUTINGS[routing], HIDDEN, INTER, torch.float32, bias=True, seed=5), fmt, 6)
    check(fused_moe_triton(**args, activation="swigluoai", swiglu_limit=7.0), args, "swigluoai", 7.0)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantized_experts_float16(fmt):
    fused_moe_triton = _fused_moe_triton()
    args = make_moe(*ROUTINGS["T=9 k=2, 3 of 8 experts chosen"], HIDDEN, INTER, torch.float16, bias=False, seed=7)
    args = quantize_experts(args, fmt, 8)
    check(fused_moe_triton(**args, activation="silu"), args, "silu", None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("routing", ["decode T=1 k=2 (6 of 8 experts unchosen)", "uneven segments 17, 1, 0, 33",
                                     "64-row blocks, a partial last one"])
def test_mxfp4_experts_through_dot_scaled(routing, dtype):
    """16-bit activations take MXFP4 experts in registers (`tl.dot_scaled`) up to decode-sized batches, not
    expanded: the unchosen experts' NaN scales stay unread, and the tiles' K tails (HIDDEN = 96 = 64 + 32) are
    masked."""
    from batchllm.kernels import moe

    assert not moe.expands_experts(moe.MXFP4, moe.MXFP4_EXPAND_ABOVE_PAIRS, 8, dtype)
    assert moe.expands_experts(moe.MXFP4, moe.MXFP4_EXPAND_ABOVE_PAIRS + 1, 8, dtype)
    fused_moe_triton = _fused_moe_triton()
    args = quantize_experts(make_moe(*ROUTINGS[routing], HIDDEN, INTER, dtype, bias=True, seed=9), "mxfp4", 10)
    check(fused_moe_triton(**args, activation="swigluoai", swiglu_limit=7.0), args, "swigluoai", 7.0)


def test_mxfp4_decoding_by_hand():
    """Per the OCP MX v1.0 spec: E2M1 has bias 1; exponent field 0 is subnormal (0.5 * mantissa), otherwise
    (1 + mantissa / 2) * 2^(e - 1); bit 3 is the sign. E8M0 scale s is 2^(s - 127). Byte j of a row holds
    element 2j in its low nibble, 2j + 1 in its high one."""
    # Codes 0..15 spelled out from the bit fields, not from a table.
    by_hand = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    for code, value in enumerate(by_hand):
        sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
        magnitude = 0.5 * mantissa if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
        assert (-1) ** sign * magnitude == value
    # One row of 32 values: byte j = (code of 2j + 1) << 4 | (code of 2j), codes 0..15 then 15..0.
    codes = list(range(16)) + list(range(15, -1, -1))
    packed = torch.tensor([[codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)]], dtype=torch.uint8)
    for scale, factor in ((127, 1.0), (130, 8.0), (125, 0.25)):
        got = dequantize_mxfp4(packed, torch.tensor([[scale]], dtype=torch.uint8))
        assert got.tolist() == [[by_hand[c] * factor for c in codes]]
