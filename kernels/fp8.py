"""Triton dynamic per-token FP8 quantization of activations, the input side of an FP8 GEMM.

`x [T, K]` (unit-stride rows) → `q [T, K]` float8_e4m3fn and `scale [T, 1]` float32, with the arithmetic of
`reference.quantize_fp8_per_token`: `scale = max(amax / 448, 1e-12)` per row, `q = clamp(x / scale, ±448)`.
One program per row reads it twice (the second read hits L2): once for the maximum, once to quantize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

BLOCK = 1024


def quantize_fp8_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, width = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_fp8_per_token_triton needs unit-stride rows")
    q = torch.empty(num_rows, width, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_kernel[(num_rows,)](x, q, scale, x.stride(0), width, FP8_MAX, FP8_MIN_SCALE, BLOCK=BLOCK)
    return q, scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, stride_x, width, fp8_max, min_scale, BLOCK: tl.constexpr):
    """Grid `(num_rows,)`; `q` is contiguous `[num_rows, width]`."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_scale(amax, fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * width + cols, to_fp8(x, scale, fp8_max, q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_scale(amax, fp8_max, min_scale):
    """A row's scale from the running maxima of its blocks' |x| (every kernel that quantizes rows shares it)."""
    return tl.maximum(tl.max(amax, 0) / fp8_max, min_scale)


@triton.jit
def to_fp8(x, scale, fp8_max, fp8_dtype: tl.constexpr):
    """Float32 values of a row → FP8 at the row's scale, saturating at ±448."""
    return tl.clamp(x / scale, -fp8_max, fp8_max).to(fp8_dtype)
