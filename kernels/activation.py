"""Triton fused SiLU-and-mul: `silu(gate) * up` for a fused gate_up projection output `[..., 2 * d]` (gate first).

Rounding follows the reference (`F.silu(gate) * up` in the activation dtype): the SiLU is computed in
float32 and rounded to the activation dtype before the multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """`[..., 2 * d]` → new tensor `[..., d]`."""
    d = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * d)
    out = torch.empty(rows.shape[0], d, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] > 0:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, BLOCK))](rows, out, rows.stride(0), d, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_row, d, BLOCK: tl.constexpr):
    """Grid `(num_rows, cdiv(d, BLOCK))`; `out` is contiguous `[num_rows, d]`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (silu * up).to(dtype), mask=mask)
