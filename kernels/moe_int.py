"""4- and 8-bit integer (GPTQ, AWQ) experts in the fused MoE kernel (kernels/moe.py): decoded in registers tile by
tile (`int_weight_tile`), or expanded to the activations' dtype for the dense kernel (`dequantize_int_triton`).

The layout is `moe_reference.dequantize_int_experts`'s: each weight row's codes packed along its input features,
eight 4-bit (or four 8-bit) codes to an int32 word, with a float32 scale and a uint8 zero point per group of
input features. Both paths compute `(code - zero) * scale` in float32 and round it to the dot's dtype, so they
give the same operands. The kernel picks as for MXFP4 (whose in-register path, measured, loses to expanding for
all but the smallest batches): in registers only when no expert gets more than one row. Neither path has been
timed on a GPU yet: only their correctness is tested, in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def int_groups(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int) -> int:
    """The input features per scale group of integer experts `weight [E, N, K / pack]`, `scale`, `zero [E, N, G]`
    (K = `in_features`), checked as the kernel reads them."""
    pack = in_features // weight.shape[-1]
    assert pack in (4, 8) and weight.shape[-1] * pack == in_features, (weight.shape, in_features)
    assert scale.shape[:2] == weight.shape[:2] and zero.shape == scale.shape, (weight.shape, scale.shape, zero.shape)
    assert zero.stride() == scale.stride() and in_features % scale.shape[-1] == 0, (zero.stride(), scale.stride())
    return in_features // scale.shape[-1]


def dequantize_int_triton(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """`[..., N, K = in_features]` in `dtype` of `weight [..., N, K / pack]` int32 with `scale`, `zero [..., N, G]`
    (moe_reference's `dequantize_int_experts`), all dense."""
    assert weight.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
    assert scale.shape == zero.shape and scale.shape[:-1] == weight.shape[:-1], (weight.shape, scale.shape)
    pack, groups = in_features // weight.shape[-1], scale.shape[-1]
    assert pack in (4, 8) and weight.shape[-1] * pack == in_features and in_features % groups == 0
    out = torch.empty(*weight.shape[:-1], in_features, dtype=dtype, device=weight.device)
    block = 1024
    _dequantize_kernel[(triton.cdiv(out.numel(), block),)](weight, scale, zero, out, out.numel(), in_features,
                                                           BITS=32 // pack, GROUP=in_features // groups, BLOCK=block)
    return out


@triton.jit
def _dequantize_kernel(weight_ptr, scale_ptr, zero_ptr, out_ptr, num_values, in_features, BITS: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr):
    # Value i is (row i // K, feature k = i % K): word k // pack of the row, its group k // GROUP.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    real = i < num_values
    row, k = i // in_features, i % in_features
    pack: tl.constexpr = 32 // BITS
    word = tl.load(weight_ptr + row * (in_features // pack) + k // pack, mask=real, other=0)
    code = (word >> ((k % pack) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
    group = row * (in_features // GROUP) + k // GROUP
    zero = tl.load(zero_ptr + group, mask=real, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + group, mask=real, other=0.0)
    tl.store(out_ptr + i, ((code - zero).to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=real)


@triton.jit
def int_weight_tile(rows_ptr, scale_rows, zero_rows, k, mask, DTYPE: tl.constexpr, BITS: tl.constexpr,
                    GROUP: tl.constexpr):
    """The `[BLOCK_K, BLOCK_N]` tile `w^T` (input features `k`, one column per weight row) in DTYPE, given the
    tile's weight rows' word pointers and their scale and zero point rows' pointers, all `[1, N]`."""
    pack: tl.constexpr = 32 // BITS
    word = tl.load(rows_ptr + (k // pack)[:, None], mask=mask, other=0)
    code = (word >> ((k % pack) * BITS)[:, None]) & ((1 << BITS) - 1)
    group = (k // GROUP)[:, None]
    zero = tl.load(zero_rows + group, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_rows + group, mask=mask, other=0.0)
    return ((code - zero).to(tl.float32) * scale).to(DTYPE)
