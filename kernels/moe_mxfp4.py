"""MXFP4 experts in the fused MoE kernel (kernels/moe.py): the E2M1 decoding and one E8M0 block's products.

An MXFP4 weight row stores 32 values per block as 16 bytes (value 2j in the low nibble of byte j, 2j + 1 in the
high one) and one power-of-two scale: the layout of the OCP MX spec, which Triton's `tl.dot_scaled` reads as
it is (`rhs_k_pack`: two K-consecutive values per byte, the low nibble first; scales `[N, K / 32]`).

`mx_tile_scaled_dot` hands a tile to `tl.dot_scaled` (bf16 / fp16 activations times E2M1 with E8M0 scales), which
on Hopper decodes the nibbles with the compiler's own conversion sequence next to the MMA. `mx_tile_dot` decodes
by hand for float32 activations (which `dot_scaled` does not take): rather than interleave the two nibbles back
into K order (a register shuffle per element), it splits the activations instead: `x[:, even k] @ low values +
x[:, odd k] @ high values`, two dots over a tile's contiguous bytes per weight row; at 5% of the H100's bandwidth
it is there for correctness. Where neither pays, `dequantize_mxfp4_triton` expands the experts to the activations'
dtype and the dense kernel runs (kernels/moe.py's `expands_experts` decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.kernels.moe_reference import MXFP4_BLOCK

_HALF_BLOCK = tl.constexpr(MXFP4_BLOCK // 2)  # bytes per block


@triton.jit
def e2m1_values(code):
    """int32 E2M1 codes (0..15) → their float32 values, assembled as float32 bits: 0.5 * mantissa when the
    exponent field is 0, else (1 + mantissa / 2) * 2^(exponent - 1); bit 3 is the sign."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    bits = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_factor(scale):
    """uint8 E8M0 scales → 2^(scale - 127) as float32 (0 for scale 0, whose 2^-127 is below float32's normals)."""
    return (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mx_tile_dot(x_rows, x_mask, w_rows, s_rows, n_mask, k0, size, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """`[M, N]` float32: `x[:, k0 : k0 + BLOCK_K] @ w[N, k0 : k0 + BLOCK_K]^T` (features past `size` are zero),
    given x's row pointers `[M, 1]` (masked by `x_mask`), the weight rows' byte pointers `[1, N]` and their scale
    rows' `[1, N]` (masked by `n_mask`). `k0` and BLOCK_K are multiples of the 32-value block."""
    j = tl.arange(0, BLOCK_K // 2)  # the tile's bytes in each weight row
    k_even = k0 + 2 * j
    in_k = k_even < size
    x_even = tl.load(x_rows + k_even[None, :], mask=x_mask & in_k[None, :], other=0.0)
    x_odd = tl.load(x_rows + (k_even + 1)[None, :], mask=x_mask & in_k[None, :], other=0.0)
    w_mask = n_mask & in_k[:, None]
    packed = tl.load(w_rows + (j + k0 // 2)[:, None], mask=w_mask, other=0).to(tl.int32)  # [BLOCK_K / 2, N]
    # Codes times powers of two: exact in bf16 / fp16, so scaling before the dot costs no precision.
    factor = e8m0_factor(tl.load(s_rows + (j // _HALF_BLOCK + k0 // (2 * _HALF_BLOCK))[:, None], mask=w_mask,
                                 other=127))
    low = (e2m1_values(packed & 0xF) * factor).to(DTYPE)
    high = (e2m1_values(packed >> 4) * factor).to(DTYPE)
    return tl.dot(x_even, low, input_precision=DOT_PRECISION) + tl.dot(x_odd, high, input_precision=DOT_PRECISION)


@triton.jit
def mx_tile_scaled_dot(x_rows, x_mask, w_rows, s_cols, in_cols, k0, size, BLOCK_K: tl.constexpr,
                       DTYPE: tl.constexpr):
    """As `mx_tile_dot` through `tl.dot_scaled`, for 16-bit activations (`DTYPE` bfloat16 or float16), given
    the scale rows' pointers as a column `[N, 1]` (`s_cols`; dot_scaled takes the scales as `[N, K / 32]`) and
    the columns' mask `in_cols [N]`."""
    k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_rows + k[None, :], mask=x_mask & (k < size)[None, :], other=0.0)
    j = tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_rows + (j + k0 // 2)[:, None], mask=in_cols[None, :] & (k0 + 2 * j < size)[:, None], other=0)
    blocks = k0 // (2 * _HALF_BLOCK) + tl.arange(0, BLOCK_K // (2 * _HALF_BLOCK))
    # Scale 127 (factor 1) past the row's end, where the codes are zeros.
    scales = tl.load(s_cols + blocks[None, :], mask=in_cols[:, None] & (blocks < size // (2 * _HALF_BLOCK))[None, :],
                     other=127)
    if DTYPE == tl.bfloat16:
        product = tl.dot_scaled(x, None, "bf16", packed, scales, "e2m1")
    else:
        product = tl.dot_scaled(x, None, "fp16", packed, scales, "e2m1")
    return product


def dequantize_mxfp4_triton(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., K]` in `dtype` of MXFP4 `packed [..., K / 2]` with `scales [..., K / 32]` (moe_reference's
    `dequantize_mxfp4`), both dense."""
    assert packed.is_contiguous() and scales.is_contiguous() and packed.numel() == scales.numel() * 16
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype, device=packed.device)
    block = 1024
    _dequantize_kernel[(triton.cdiv(packed.numel(), block),)](packed, scales, out, packed.numel(), BLOCK=block)
    return out


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, out_ptr, num_bytes, BLOCK: tl.constexpr):
    # Every row holds whole blocks, so byte i's scale is scales[i // 16] whatever the row length.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    real = i < num_bytes
    packed = tl.load(packed_ptr + i, mask=real, other=0).to(tl.int32)
    factor = e8m0_factor(tl.load(scales_ptr + i // _HALF_BLOCK, mask=real, other=127))
    low, high = e2m1_values(packed & 0xF) * factor, e2m1_values(packed >> 4) * factor
    values = tl.reshape(tl.join(low, high), [2 * BLOCK])  # low, high, low, high, ...: K order
    out = 2 * tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out, values.to(out_ptr.dtype.element_ty), mask=out < 2 * num_bytes)
