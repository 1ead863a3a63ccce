"""Triton RMSNorm with an optional fused residual add, numerically HF's `LlamaRMSNorm`.

Order of operations, as in `kernels/reference.py`: the residual add rounds to the input dtype (HF adds in
the model dtype), statistics are float32, the normalised row is cast back to the input dtype, and only then
multiplied by the weight (the product rounds to `promote_types(weight, x)`). One program per row; rows are
the last dimension of `x` (unit stride); the leading dimensions may be any view (a strided one is copied).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    block = triton.next_power_of_2(hidden)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, new_residual, rows.stride(0), residual_rows.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(4, block // 512)),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_residual.view(x.shape)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, stride_x, stride_r, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid `(num_rows,)`; `out` and `new_residual` are contiguous `[num_rows, hidden]`."""
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
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
