"""Triton fused SiLU-and-mul: `silu(gate) * up` for a fused gate_up projection output `[..., 2 * d]` (gate first).

Rounding follows the reference (`F.silu(gate) * up` in the activation dtype): the SiLU is computed in
float32 and rounded to the activation dtype before the multiply.

`silu_and_mul_fp8_triton` writes the product quantized per row for an FP8 down projection, bit for bit what
`quantize_fp8_per_token_triton` makes of `silu_and_mul_triton`'s output, without that 16-bit row in memory: one
program per row computes the row's products twice (its gate_up row, ~57 KB at llama3-8b's width, is in L2 the
second time), once for the row's maximum and once to quantize. Unfused, the product is written, read back twice and
quantized: at 1,024 rows of llama3-8b that separate pass cost the down projection 25 of its 114 µs on an H200
(benchmarks/fp8_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.kernels.fp8 import fp8_scale, to_fp8
from batchllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

BLOCK = 1024


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """`[..., 2 * d]` → new tensor `[..., d]`."""
    d = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * d)
    out = torch.empty(rows.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] > 0:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, BLOCK))](rows, out, rows.stride(0), d, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], d)


def silu_and_mul_fp8_triton(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[T, 2 * d]` (unit-stride) → `(q [T, d] float8_e4m3fn, scale [T, 1] float32)` of `silu(gate) * up`."""
    num_rows, d = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul_fp8_triton needs unit-stride rows")
    q = torch.empty(num_rows, d, dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=gate_up.device)
    if num_rows:
        _silu_and_mul_fp8_kernel[(num_rows,)](gate_up, q, scale, gate_up.stride(0), d, FP8_MAX, FP8_MIN_SCALE,
                                              BLOCK=BLOCK)
    return q, scale


@triton.jit
def _silu_mul(gate_up_ptr, row, stride_row, d, cols, mask, dtype: tl.constexpr):
    """`silu(gate) * up` at `cols` of a row, in float32: the SiLU rounded to `dtype` before the multiply."""
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return silu * up


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_row, d, BLOCK: tl.constexpr):
    """Grid `(num_rows, cdiv(d, BLOCK))`; `out` is contiguous `[num_rows, d]`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * d + cols, _silu_mul(gate_up_ptr, row, stride_row, d, cols, mask, dtype).to(dtype),
             mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(gate_up_ptr, q_ptr, scale_ptr, stride_row, d, fp8_max, min_scale, BLOCK: tl.constexpr):
    """Grid `(num_rows,)`; `q` is contiguous `[num_rows, d]`. The product is rounded to the activation dtype, as the
    unfused kernel stores it, before its maximum is taken and it is quantized."""
    row = tl.program_id(0).to(tl.int64)
    dtype = gate_up_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < d
        product = _silu_mul(gate_up_ptr, row, stride_row, d, cols, mask, dtype).to(dtype).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(product))
    scale = fp8_scale(amax, fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < d
        product = _silu_mul(gate_up_ptr, row, stride_row, d, cols, mask, dtype).to(dtype).to(tl.float32)
        tl.store(q_ptr + row * d + cols, to_fp8(product, scale, fp8_max, q_ptr.dtype.element_ty), mask=mask)
