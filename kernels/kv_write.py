"""Triton KV-cache write by slot mapping.

`key`/`value` `[num_tokens, num_kv_heads, head_dim]` (any token/head strides, unit-stride head dim, e.g.
slices of a fused qkv output) go to flat slot `slot_mapping[t] = block * block_size + offset` of caches
`[num_blocks, block_size, num_kv_heads, head_dim]`, cast to the cache dtype. A negative slot (a padding token)
is skipped inside the kernel, so there is no boolean-mask indexing and no shape that depends on device
values: the launch can be captured in a CUDA graph. FP8 caches store `key / k_scale` and `value / v_scale`,
saturated to ±448 (see `reference.write_kv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.kernels.reference import FP8_DTYPE, FP8_MAX


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("write_kv_triton needs unit-stride head dims and K/V caches of one layout")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, FP8_MAX,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), QUANTIZE=k_cache.dtype == FP8_DTYPE,
    )


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale, fp8_max,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, QUANTIZE: tl.constexpr,
):
    """Grid `(num_tokens,)`: one program copies all KV heads of one token."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    # int64 offsets: a large pool (num_blocks * block_size * heads * head_dim) passes 2**31 elements.
    dest = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if QUANTIZE:
        k = tl.clamp(k.to(tl.float32) / k_scale, -fp8_max, fp8_max)
        v = tl.clamp(v.to(tl.float32) / v_scale, -fp8_max, fp8_max)
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
