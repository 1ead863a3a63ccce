"""Triton in-place neox-style rotary embedding (the head dimension is split into two halves).

`query [T, Hq, D]` and `key [T, Hkv, D]` (any token/head strides, unit-stride head dim, e.g. slices of a fused
qkv output) are rotated in place by `positions [T]`, using the float32 tables `cos`/`sin`
`[max_positions, D // 2]` of `batchllm.model.layers.rotary`. Rounding follows the reference exactly: the
table entries are cast to the activation dtype first, and each product and sum rounds to that dtype, which
is what separate torch ops in bf16 do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_rotary_triton(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` and `key` in place; returns them for convenience."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("apply_rotary_triton needs unit-stride head dims and cos/sin tables of one layout")
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos, sin,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0),
            NUM_Q_HEADS=num_q_heads, Q_HEADS_P2=triton.next_power_of_2(num_q_heads),
            NUM_K_HEADS=num_k_heads, K_HEADS_P2=triton.next_power_of_2(num_k_heads),
            HALF=half, HALF_P2=triton.next_power_of_2(half),
        )
    return query, key


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
                  HALF: tl.constexpr, HALF_P2: tl.constexpr):
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HALF_P2)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x_ptr + heads * stride_h + dims
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    # Rounding each product to the activation dtype mirrors the reference's separate ops (and keeps the
    # compiler from fusing them into an FMA, which would round differently).
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_P2: tl.constexpr, NUM_K_HEADS: tl.constexpr, K_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr, HALF_P2: tl.constexpr,
):
    """Grid `(num_tokens,)`: one program rotates every query and key head of one token."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P2)
    dtype = query_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dims < HALF).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * stride_cos + dims, mask=dims < HALF).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(query_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, Q_HEADS_P2, HALF, HALF_P2)
    _rotate_heads(key_ptr + token * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, K_HEADS_P2, HALF, HALF_P2)
