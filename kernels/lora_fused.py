"""Triton batched multi-LoRA for decode-sized steps: shrink and expand in one launch, `y` kept in registers.

`out[t] += (x[t] a[s]^T) b[s]^T` for the tokens of each slot's segment, in place (see `reference.add_lora_`).
The two-kernel path of kernels/lora.py writes shrink's split-K partials to float32 scratch and reads them back
in expand; at decode that round trip and the second launch cost more than the products. Here each program owns
one row block of one slot (the segments' blocks, numbered as `lora._segment_rows` numbers them) and one tile of
output features: it computes its rows' rank-r intermediate `y = x a^T` itself, over all of K, then adds
`y b^T` for its tile into `out`. Every output tile of a row block recomputes the same `y`: at decode `r` is 8-64
and the block has a few rows, so the repeated shrink is a few reads of `a` from L2, cheaper than the scratch
round trip and a launch. The grid `(cdiv(T, BLOCK_M) + S, cdiv(out_features, BLOCK_N))` follows from the shapes
alone (CUDA graphs: the host never reads the segment sizes), and a token is in at most one segment, so every
`out` row has one writer.

Same bits as the two-kernel path: `y` is summed in its order, which depends on the layer's shape only: split i
of `choose_split_k(in_features)` accumulates its chunk of K in SHRINK_BLOCK_K tiles, the splits' float32 sums
are added in split order, and `y` is built and consumed in the W tiles expand uses. Rounding follows the
reference: float32 accumulation, `y` rounded to x's dtype, `out + delta` rounded once to out's dtype.
(tests/kernels/test_lora_fused.py checks the bits in the interpreter, and on a GPU when one is there.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchllm.kernels.lora import (
    BLOCK_M,
    EXPAND_BLOCK_N,
    EXPAND_MAX_BLOCK_K,
    SHRINK_BLOCK_K,
    _segment_rows,
    shrink_splits,
)

# Shrink tiles per turn of a program's K loop (see _shrink_split). Not yet tuned on a GPU.
K_UNROLL = 4


def add_lora_fused(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   sorted_tokens: torch.Tensor, slot_starts: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """`add_lora_triton`'s fused path (any T; it takes steps of at most FUSED_MAX_TOKENS): same arguments, same result
    bits as the two-kernel path for the same `split_k` (its default too: `choose_split_k(in_features)`)."""
    num_tokens, in_features = x.shape
    num_slots, width, _ = a.shape
    out_features = out.shape[1]
    assert a.shape[2] == in_features and b.shape == (num_slots, out_features, width), (a.shape, b.shape)
    assert out.shape[0] == num_tokens and slot_starts.shape == (num_slots + 1,), (out.shape, slot_starts.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    if num_tokens == 0 or num_slots == 0 or width == 0:
        return out
    split_k, chunk = shrink_splits(in_features, split_k)
    # fp32 models get fp32 products; on the GPU the default would round operands to tf32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(num_tokens, BLOCK_M) + num_slots, triton.cdiv(out_features, EXPAND_BLOCK_N))
    _fused_kernel[grid](
        x, a, b, out, sorted_tokens, slot_starts, in_features, width, out_features, chunk,
        x.stride(0), out.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        SPLIT_K=split_k, NUM_SLOTS=num_slots, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_K=SHRINK_BLOCK_K,
        BLOCK_W=min(EXPAND_MAX_BLOCK_K, max(16, triton.next_power_of_2(width))), K_UNROLL=K_UNROLL,
        DOT_PRECISION=precision,
    )
    return out


@triton.jit
def _shrink_split(x_rows, a_cols, in_segment, in_width, k_start, k_end, BLOCK_M: tl.constexpr,
                  BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, K_UNROLL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Float32 `x . a` over input features [k_start, k_end) for the block's rows and one W tile, in BLOCK_K
    tiles: one split of the two-kernel shrink, summed in its order. A program walks all of K alone (the two
    kernels spread it over split programs), so the loop takes K_UNROLL tiles a turn, their loads issued
    together, then the remaining tiles one by one: the same tiles added in the same order."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
    step = BLOCK_K * K_UNROLL
    k_whole = k_start + (k_end - k_start) // step * step
    for k0 in range(k_start, k_whole, step):  # whole turns: no K mask
        for u in tl.static_range(K_UNROLL):
            k = k0 + u * BLOCK_K + ks
            x_tile = tl.load(x_rows + k[None, :], mask=in_segment[:, None], other=0.0)
            a_tile = tl.load(a_cols + k[:, None], mask=in_width[None, :], other=0.0)  # [K, W]: a^T
            acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
    for k0 in range(k_whole, k_end, BLOCK_K):
        k = k0 + ks
        in_k = k < k_end
        x_tile = tl.load(x_rows + k[None, :], mask=in_segment[:, None] & in_k[None, :], other=0.0)
        a_tile = tl.load(a_cols + k[:, None], mask=in_k[:, None] & in_width[None, :], other=0.0)
        acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, out_ptr, sorted_tokens_ptr, slot_starts_ptr, in_features, width,
                  out_features, chunk, stride_x, stride_out, stride_a_slot, stride_a_row, stride_b_slot,
                  stride_b_row, SPLIT_K: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, K_UNROLL: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Grid `(cdiv(T, BLOCK_M) + S, cdiv(out_features, BLOCK_N))`: `out[token, n] += y[token] . b[s, n]` for
    the block's rows and the tile's n, `y = x[token] a[s]^T` computed here, W tile by W tile."""
    slot, rows, in_segment, tokens, no_block = _segment_rows(sorted_tokens_ptr, slot_starts_ptr, NUM_SLOTS, BLOCK_M)
    if no_block:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_out = cols < out_features
    x_rows = x_ptr + tokens[:, None] * stride_x
    a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot
    b_cols = b_ptr + slot.to(tl.int64) * stride_b_slot + cols[None, :].to(tl.int64) * stride_b_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(0, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        in_width = w < width
        a_cols = a_slot + w[None, :].to(tl.int64) * stride_a_row
        y = _shrink_split(x_rows, a_cols, in_segment, in_width, 0, tl.minimum(in_features, chunk), BLOCK_M,
                          BLOCK_W, BLOCK_K, K_UNROLL, DOT_PRECISION)
        for split in tl.static_range(1, SPLIT_K):  # later splits added in order, as expand sums the planes
            y += _shrink_split(x_rows, a_cols, in_segment, in_width, split * chunk,
                               tl.minimum(in_features, (split + 1) * chunk), BLOCK_M, BLOCK_W, BLOCK_K,
                               K_UNROLL, DOT_PRECISION)
        y = y.to(x_ptr.dtype.element_ty)
        b_tile = tl.load(b_cols + w[:, None], mask=in_width[:, None] & in_out[None, :], other=0.0)  # [W, N]: b^T
        acc += tl.dot(y, b_tile, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + tokens[:, None] * stride_out + cols[None, :]
    mask = in_segment[:, None] & in_out[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)
