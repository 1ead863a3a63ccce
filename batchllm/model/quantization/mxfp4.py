"""MXFP4 (OCP Microscaling v1.0, FP4 E2M1 elements, one E8M0 scale per block of 32): quantizing a weight, and how
one MoE expert's projection becomes the parts `Mxfp4ExpertMethod` stores (quantization/experts.py).

The stored layout is the kernels' (kernels/moe_reference.py, `dequantize_mxfp4`): `weight [rows, cols / 2]` uint8,
element 2j in the low nibble of byte j and 2j + 1 in the high one, and `weight_scale [rows, cols / 32]` uint8, the
block's factor `2 ** (scale - 127)`. gpt-oss's checkpoints store exactly this per row (model/gpt_oss_mxfp4.py
reads them); `quantize_mxfp4` makes it from a full-precision weight (`quantization="mxfp4"`, random weights).
"""

from __future__ import annotations

import torch

from batchllm.kernels.moe_reference import E2M1_VALUES, MXFP4_BLOCK
from batchllm.model.checkpoint_tensor import CheckpointSlice
from batchllm.model.quantization.config import MXFP4, QuantConfig
from batchllm.model.quantization.method import Reader
from batchllm.model.quantization.unquantized import check_plain_tensor

_E2M1_MAX = 6.0  # the largest E2M1 value
_SCALE_BIAS = 127  # E8M0


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(packed [rows, cols / 2] uint8, scales [rows, cols / 32] uint8)` of `weight [rows, cols]`. Each block's
    scale is the smallest power of two that brings its absmax within E2M1's largest value, 6 (what the quantizer
    transformers uses for gpt-oss does, triton_kernels' `downcast_to_mxfp` rounding the scale up: nothing is
    clipped, unlike the OCP spec's `2 ** (floor(log2(absmax)) - 2)`); each element is its value over the scale
    rounded to the nearest E2M1 value, ties to the even code, as the OCP MX spec (v1.0) converts."""
    rows, cols = weight.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 quantizes rows in blocks of {MXFP4_BLOCK}: a [{rows}, {cols}] weight's rows are not")
    blocks = weight.float().contiguous().reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    # frexp: r = m * 2 ** e with m in [0.5, 1), so ceil(log2(r)) is e, or e - 1 when r is a power of two (m = 0.5).
    ratio = blocks.abs().amax(dim=-1) / _E2M1_MAX
    mantissa, exponent = torch.frexp(ratio)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-_SCALE_BIAS, _SCALE_BIAS)
    scaled = blocks / torch.ldexp(torch.ones_like(blocks[..., 0]), exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    magnitude = scaled.abs().clamp(max=magnitudes[-1])
    code = torch.bucketize(magnitude, midpoints)  # a value on a midpoint gets the lower of its two neighbours
    on_midpoint = (code < len(midpoints)) & (magnitude == midpoints[code.clamp(max=len(midpoints) - 1)])
    code = torch.where(on_midpoint & (code % 2 == 1), code + 1, code)  # ties to even: the code with mantissa 0
    code = (code | (scaled < 0).long() << 3).to(torch.uint8).reshape(rows, cols)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, (exponent + _SCALE_BIAS).to(torch.uint8)


class Mxfp4ExpertWeights:
    """One expert's projection → MXFP4 parts (`weight`, `weight_scale`): the `linear` of `Mxfp4ExpertMethod`.
    A full-precision weight (random, or a bf16 checkpoint's with `quantization="mxfp4"`) is quantized; MXFP4
    checkpoints store their experts stacked (gpt-oss's `*_blocks` / `*_scales`), which the family reads itself."""

    companion_tensors: tuple[str, ...] = ()

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def read_weight(self, name: str, tensor: CheckpointSlice, read: Reader, shape: tuple[int, int]
                    ) -> dict[str, torch.Tensor]:
        if self.config.checkpoint_format == MXFP4:
            raise ValueError("is a full-precision expert weight, but config.json's quantization_config says the "
                             "experts are MXFP4 (read from gpt-oss's stacked *_blocks / *_scales tensors)")
        check_plain_tensor(tensor, shape)
        return self.quantize_weight(tensor.read())

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scales = quantize_mxfp4(weight)
        return {"weight": packed, "weight_scale": scales}
