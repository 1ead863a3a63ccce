"""Triton batched multi-LoRA: `out[t] += (x[t] a[s]^T) b[s]^T` for the tokens of each slot's segment, in place.

Two kernels over the step's segments (`sorted_tokens` grouped by slot, `slot_starts [S + 1]`): shrink computes
`y = x a^T` `[T, W]` (rows in sorted order, W = slices * max_rank), expand adds `y b^T` into `out`. Both grids
are `(cdiv(T, BLOCK_M) + S, tiles)`, fixed by the shapes alone so a CUDA graph can capture them: the host never
reads the segment sizes; each program finds its row block by scanning `slot_starts`, and one past the last block
returns at once. A token is in at
most one segment, so every `out` row has one writer and no atomics are needed.

Shrink's N (W) is small and its K (the input features, thousands) long, so at decode a few programs would each
walk all of K. It splits K instead (by the layer's width alone: batch invariance, see `choose_split_k`):
split i writes its float32 partial sums into scratch plane i
`[split_k, T, W]`, and expand sums the planes as it loads `y` (in a fixed order: deterministic).

Rounding follows the reference: float32 accumulation, `y` rounded to x's dtype (so expand's `tl.dot` takes two
operands of the model's dtype), `out + delta` rounded once to out's dtype. Block sizes and splits follow from
the shapes alone (no autotuning: CUDA graphs, and one summation order per shape). BLOCK_M = 16, the smallest
`tl.dot` tile, suits decode, where a slot has a few tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program at decode sizes ...
PREFILL_BLOCK_M = 64  # ... and from PREFILL_TOKENS on: a quarter of the programs and of the re-reads of a and b
PREFILL_TOKENS = 512
SHRINK_BLOCK_N = 64  # over W (16..192)
SHRINK_BLOCK_K = 64  # over the input features
SPLIT_K_CHUNK = 256  # input features per K split, at least ...
MAX_SPLIT_K = 4  # ... and at most this many splits (more were slower on an H200: expand re-sums them per N tile)
EXPAND_BLOCK_N = 128  # over the output features (128 beat 64 at every size timed on an H200)
EXPAND_MAX_BLOCK_K = 64  # over W: W itself (a power of two, at least 16) up to this; masked lanes read nothing


def add_lora_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    sorted_tokens: torch.Tensor, slot_starts: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """See `reference.add_lora_`. Rows of `x` and `out` may be strided; their last dimension must be dense.
    `split_k` (the number of K splits of shrink) defaults to `choose_split_k(in_features)`."""
    num_tokens, in_features = x.shape
    num_slots, width, _ = a.shape
    out_features = out.shape[1]
    assert a.shape[2] == in_features and b.shape == (num_slots, out_features, width), (a.shape, b.shape)
    assert out.shape[0] == num_tokens and slot_starts.shape == (num_slots + 1,), (out.shape, slot_starts.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    if num_tokens == 0 or num_slots == 0 or width == 0:
        return out
    block_m = BLOCK_M if num_tokens < PREFILL_TOKENS else PREFILL_BLOCK_M
    m_blocks, n_tiles = triton.cdiv(num_tokens, block_m), triton.cdiv(width, SHRINK_BLOCK_N)
    if split_k is None:
        split_k = choose_split_k(in_features)
    # Split i covers input features [i * chunk, (i + 1) * chunk): whole BLOCK_K tiles but for the last.
    chunk = triton.cdiv(triton.cdiv(in_features, split_k), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    split_k = triton.cdiv(in_features, chunk)
    partials = torch.empty(split_k, num_tokens, width, dtype=torch.float32, device=x.device)
    # fp32 models get fp32 products; on the GPU the default would round operands to tf32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _shrink_kernel[(m_blocks + num_slots, n_tiles * split_k)](
        x, a, partials, sorted_tokens, slot_starts, in_features, width, n_tiles, chunk, partials.stride(0),
        x.stride(0), a.stride(0), a.stride(1),
        NUM_SLOTS=num_slots, BLOCK_M=block_m, BLOCK_N=SHRINK_BLOCK_N, BLOCK_K=SHRINK_BLOCK_K,
        DOT_PRECISION=precision,
    )
    _expand_kernel[(m_blocks + num_slots, triton.cdiv(out_features, EXPAND_BLOCK_N))](
        partials, b, out, sorted_tokens, slot_starts, width, out_features, partials.stride(0),
        out.stride(0), b.stride(0), b.stride(1), SPLIT_K=split_k, NUM_SLOTS=num_slots, BLOCK_M=block_m,
        BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_K=min(EXPAND_MAX_BLOCK_K, max(16, triton.next_power_of_2(width))), DOT_PRECISION=precision,
    )
    return out


def choose_split_k(in_features: int) -> int:
    """Shrink's K splits: one per SPLIT_K_CHUNK input features, at most MAX_SPLIT_K. From the layer's width
    alone, not the batch's size, so a row's delta is summed in the same order whatever batch it is in (a
    CUDA-graph step padded to its captured size equals the same step run eagerly)."""
    return max(1, min(MAX_SPLIT_K, in_features // SPLIT_K_CHUNK))


@triton.jit
def _segment_rows(sorted_tokens_ptr, slot_starts_ptr, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block `program_id(0)` of the step: the segments' blocks are numbered slot after slot (slot s has
    `cdiv(len_s, BLOCK_M)`), so the grid needs `cdiv(T, BLOCK_M) + S` programs whatever the segments, not
    `S * cdiv(T, BLOCK_M)`. Returns the block's slot, its rows (positions in `sorted_tokens`), whether each is
    in the segment, their token indices (int64), and whether the program has no block (past the last)."""
    block = tl.program_id(0)
    slot, first, end, blocks_before = -1, 0, 0, 0
    for s in tl.static_range(NUM_SLOTS):  # a handful of slots, scanned here: the host builds no list of blocks
        start_s = tl.load(slot_starts_ptr + s)
        end_s = tl.load(slot_starts_ptr + s + 1)
        blocks_s = (end_s - start_s + BLOCK_M - 1) // BLOCK_M
        mine = (block >= blocks_before) & (block < blocks_before + blocks_s)
        slot = tl.where(mine, s, slot)
        first = tl.where(mine, start_s + (block - blocks_before) * BLOCK_M, first)
        end = tl.where(mine, end_s, end)
        blocks_before += blocks_s
    rows = first + tl.arange(0, BLOCK_M)
    in_segment = rows < end
    tokens = tl.load(sorted_tokens_ptr + rows, mask=in_segment, other=0).to(tl.int64)
    return slot, rows.to(tl.int64), in_segment, tokens, slot < 0


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, partials_ptr, sorted_tokens_ptr, slot_starts_ptr, in_features, width,
                   n_tiles, chunk, stride_plane, stride_x, stride_a_slot, stride_a_row,
                   NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Grid `(cdiv(T, BLOCK_M) + S, n_tiles * split_k)`: `partials[split, row, n] = x[token] . a[s, n]` over the
    split's `chunk` input features, for the block's rows; partials is contiguous `[split_k, T, W]`, its rows
    indexed by position in `sorted_tokens`."""
    slot, rows, in_segment, tokens, no_block = _segment_rows(sorted_tokens_ptr, slot_starts_ptr, NUM_SLOTS, BLOCK_M)
    if no_block:
        return
    split = tl.program_id(1) // n_tiles
    cols = (tl.program_id(1) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_width = cols < width
    ks = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(in_features, (split + 1) * chunk)
    x_rows = x_ptr + tokens[:, None] * stride_x
    a_cols = a_ptr + slot.to(tl.int64) * stride_a_slot + cols[None, :].to(tl.int64) * stride_a_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * chunk, k_end, BLOCK_K):
        k = k0 + ks
        in_k = k < k_end
        x_tile = tl.load(x_rows + k[None, :], mask=in_segment[:, None] & in_k[None, :], other=0.0)
        a_tile = tl.load(a_cols + k[:, None], mask=in_k[:, None] & in_width[None, :], other=0.0)  # [K, N]: a^T
        acc += tl.dot(x_tile, a_tile, input_precision=DOT_PRECISION)
    plane = partials_ptr + split.to(tl.int64) * stride_plane
    tl.store(plane + rows[:, None] * width + cols[None, :], acc, mask=in_segment[:, None] & in_width[None, :])


@triton.jit
def _expand_kernel(partials_ptr, b_ptr, out_ptr, sorted_tokens_ptr, slot_starts_ptr, width, out_features,
                   stride_plane, stride_out, stride_b_slot, stride_b_row, SPLIT_K: tl.constexpr,
                   NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Grid `(cdiv(T, BLOCK_M) + S, cdiv(out_features, BLOCK_N))`: `out[token, n] += y[row] . b[s, n]`, the sum
    rounded once to out's dtype, where `y` is the sum of shrink's partials rounded to b's dtype."""
    slot, rows, in_segment, tokens, no_block = _segment_rows(sorted_tokens_ptr, slot_starts_ptr, NUM_SLOTS, BLOCK_M)
    if no_block:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_out = cols < out_features
    ks = tl.arange(0, BLOCK_K)
    y_rows = partials_ptr + rows[:, None] * width
    b_cols = b_ptr + slot.to(tl.int64) * stride_b_slot + cols[None, :].to(tl.int64) * stride_b_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + ks
        in_k = k < width
        y_mask = in_segment[:, None] & in_k[None, :]
        y_ptrs = y_rows + k[None, :]
        y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0)
        for _ in tl.static_range(1, SPLIT_K):  # the next split's plane; unrolled, so the loads overlap
            y_ptrs += stride_plane
            y_tile += tl.load(y_ptrs, mask=y_mask, other=0.0)
        y_tile = y_tile.to(b_ptr.dtype.element_ty)
        b_tile = tl.load(b_cols + k[:, None], mask=in_k[:, None] & in_out[None, :], other=0.0)  # [K, N]: b^T
        acc += tl.dot(y_tile, b_tile, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + tokens[:, None] * stride_out + cols[None, :]
    mask = in_segment[:, None] & in_out[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)
