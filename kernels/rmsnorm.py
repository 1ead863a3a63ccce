"""Triton RMSNorm with an optional fused residual add, numerically HF's `LlamaRMSNorm`, and the same norm with its
output quantized per token to FP8 for an FP8 linear layer (`rms_norm_fp8_triton`).

Order of operations, as in `kernels/reference.py`: the residual add rounds to the input dtype (HF adds in
the model dtype), statistics are float32, the normalised row is cast back to the input dtype, and only then
multiplied by the weight (the product rounds to `promote_types(weight, x)`). One program per row; rows are
the last dimension of `x` (unit stride); the leading dimensions may be any view (a strided one is copied).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.kernels.fp8 import fp8_scale, to_fp8
from batchllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or `(norm(x + residual), x + residual)` when `residual` is given; new tensors either way."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)  # a view for the usual layouts; a copy only for exotic strides
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    # Without a residual the kernel never touches these two: `rows` stands in for the pointers.
    residual_rows = rows if residual is None else residual.reshape(-1, hidden)
    new_residual = rows if residual is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(rows, residual_rows, weight, eps, out, new_residual, residual is not None)
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_residual.view(x.shape)


def rms_norm_fp8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(q [T, hidden] float8_e4m3fn, scale [T, 1] float32, x + residual or None)`: `rms_norm_triton`'s output
    quantized per token exactly as `quantize_fp8_per_token` would quantize it, without the 16-bit output in memory."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    residual_rows = rows if residual is None else residual.reshape(-1, hidden)
    new_residual = rows if residual is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(rows, residual_rows, weight, eps, q, new_residual, residual is not None, scale,
            torch.promote_types(weight.dtype, x.dtype))
    return q, scale, None if residual is None else new_residual.view(x.shape)


def _launch(rows: torch.Tensor, residual_rows: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
            new_residual: torch.Tensor, has_residual: bool, scale: torch.Tensor | None = None,
            norm_dtype: torch.dtype | None = None) -> None:
    """One program per row; with `scale` the rows of `out` are FP8 and their scales go to `scale`."""
    hidden = rows.shape[1]
    block = triton.next_power_of_2(hidden)
    if rows.shape[0] == 0:
        return
    _rms_norm_kernel[(rows.shape[0],)](
        rows, residual_rows, weight, out, new_residual, rows.stride(0), residual_rows.stride(0), hidden, eps,
        out if scale is None else scale, FP8_MAX, FP8_MIN_SCALE,
        HAS_RESIDUAL=has_residual, BLOCK=block, QUANTIZE=scale is not None,
        NORM_DTYPE=_TL_DTYPES[norm_dtype or out.dtype], num_warps=min(16, max(4, block // 512)),
    )


_TL_DTYPES = {torch.float64: tl.float64, torch.float32: tl.float32, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x, stride_r, hidden, eps,
    scale_ptr, fp8_max, min_scale,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr, NORM_DTYPE: tl.constexpr,
):
    """Grid `(num_rows,)`; `out` and `new_residual` are contiguous `[num_rows, hidden]`. With QUANTIZE the row is
    rounded to NORM_DTYPE (what the unfused norm stores) and then quantized: `out` holds FP8, `scale` its scale."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.math.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    if QUANTIZE:
        out = out.to(NORM_DTYPE).to(tl.float32)
        scale = fp8_scale(tl.abs(out), fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * hidden + cols, to_fp8(out, scale, fp8_max, out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
