"""Decode attention with all of a row's KV heads in one program: an experiment for models with narrow heads.

`paged_attention_triton` gives each (query block, KV head) its own program, so a program reads one head's keys:
`head_dim * element_size` bytes a key (128 at head_dim 64) at a stride of all the heads' bytes (384 with
smollm2's 3 KV heads). That kernel reaches 98 % of an H100's copy bandwidth on llama3-8b's 256-byte rows, but
52-62 % on smollm2's 128-byte ones (benchmarks/README.md, "W1 on one H100 80GB"), and decode attention is most
of that model's decode step. Here one program reads a key's K (and V) for several adjacent KV heads at once (all
three of smollm2's), their contiguous `heads * head_dim` elements, as one `[TILE_N, heads * head_dim]` tile.

One dot still gives every query head the scores of its own KV head: the query tile is block-diagonal, row r
(query head `kv * GROUP + g`, rows ordered KV head by KV head) holding its query in KV head kv's columns and zeros
in the others. `P . V` then sums every head's values into a row, of which the row keeps only its own head's
columns when it is stored. The products grow `heads`-fold, which a memory-bound kernel can spend.

`heads_per_program` (a divisor of the KV heads) defaults to `row_heads`: the fewest heads whose row is 256 bytes,
as the paged kernel reads llama3-8b's bf16 heads at full bandwidth (two of its FP8 heads), so that the tiles stay
narrow where more heads would add only products.

Decode-only batches (`max_query_len <= 1`), no per-layer variants (window, soft cap, sinks, key limits); split-KV
writes the partials `paged_attention_triton` writes, merged by its `merge_splits`. Off in the engine until
an H100 shows it faster (`benchmarks/decode_attention.py --rows-kernel`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels.attention import SplitKVWorkspace, merge_splits
from batchllm.kernels.reference import FP8_DTYPE


def decode_attention_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          metadata: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                          workspace: SplitKVWorkspace | None = None, num_splits: int = 1, k_scale: float = 1.0,
                          v_scale: float = 1.0, tile_n: int = 32, num_warps: int = 4, num_stages: int = 3,
                          heads_per_program: int | None = None) -> torch.Tensor:
    """`paged_attention_triton`'s result for a decode-only batch, each program reading one row's keys for
    `heads_per_program` adjacent KV heads (None: `row_heads`'s choice); `num_splits` slices of the keys each (merged
    as there)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = metadata.seq_lens.shape[0]
    if metadata.max_query_len > 1:
        raise ValueError(f"decode_attention_rows takes decode rows only, got max_query_len={metadata.max_query_len}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k_cache.stride(2) != head_dim:
        raise ValueError("decode_attention_rows needs each slot's heads contiguous: caches [blocks, block, heads, dim]")
    if query.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("decode_attention_rows needs unit-stride head dims")
    heads = heads_per_program or row_heads(num_kv_heads, head_dim, k_cache.element_size())
    if num_kv_heads % heads:
        raise ValueError(f"heads_per_program={heads} does not divide the {num_kv_heads} KV heads")
    if k_cache.dtype != FP8_DTYPE:
        k_scale = v_scale = 1.0
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    constants = dict(
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P2=group_p2, HEADS=heads, HEAD_DIM=head_dim,
        ROWS_P2=max(16, triton.next_power_of_2(heads * group_p2)),
        COLS_P2=max(16, triton.next_power_of_2(heads * head_dim)), TILE_N=tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", KV_FP8=k_cache.dtype == FP8_DTYPE,
        KV_DOT_DTYPE=tl.float32 if query.dtype == torch.float32 else tl.float16,
    )
    # Programs [0, num_seqs) attend; the next num_tokens zero the padding tokens past the last sequence's.
    grid = (num_seqs + num_tokens, num_kv_heads // heads, num_splits)
    common = (query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, num_seqs,
              scale * k_scale * math.log2(math.e), v_scale, query.stride(0), query.stride(1), k_cache.stride(0),
              k_cache.stride(1), metadata.block_tables.stride(0), out, out.stride(0), out.stride(1))
    if num_splits == 1:
        _decode_rows_kernel[grid](*common, out, out, out, 0, 0, 0, 0, 0, **constants, num_warps=num_warps,
                                  num_stages=num_stages)
        return out
    if workspace is None:
        workspace = SplitKVWorkspace.allocate(num_tokens, num_heads, head_dim, num_splits, query.device)
    if workspace.max_num_tokens < num_tokens or workspace.max_splits < num_splits:
        raise ValueError(f"workspace holds {workspace.max_num_tokens} tokens x {workspace.max_splits} splits, "
                         f"the launch needs {num_tokens} x {num_splits}")
    acc, m, s = workspace.partial_acc, workspace.partial_max, workspace.partial_sum
    _decode_rows_kernel[grid](*common, acc, m, s, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0),
                              m.stride(1), **constants, num_warps=num_warps, num_stages=num_stages)
    return merge_splits(out, workspace, metadata, num_splits)


def row_heads(num_kv_heads: int, head_dim: int, element_size: int, min_bytes: int = 256) -> int:
    """The fewest adjacent KV heads (a divisor of `num_kv_heads`) whose K row per key is at least `min_bytes`: the
    row the paged kernel reads at the card's bandwidth (llama3-8b's bf16 heads), or all of them."""
    return next(h for h in range(1, num_kv_heads + 1)
                if num_kv_heads % h == 0 and (h * head_dim * element_size >= min_bytes or h == num_kv_heads))


@triton.jit
def _decode_rows_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, num_seqs,
    qk_scale, v_scale, stride_qt, stride_qh, stride_cb, stride_cs, stride_bt, out_ptr, stride_ot, stride_oh,
    acc_ptr, max_ptr, sum_ptr, stride_at, stride_ah, stride_as, stride_mt, stride_mh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROWS_P2: tl.constexpr, COLS_P2: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KV_DOT_DTYPE: tl.constexpr,
):
    """Grid `(num_seqs + num_tokens, num_kv_heads // HEADS, NUM_SPLITS)`: see the module docstring."""
    program = tl.program_id(0)
    first_kv = tl.program_id(1) * HEADS  # this program's KV heads: HEADS from here
    split = tl.program_id(2)
    rows = tl.arange(0, ROWS_P2)
    kv_of_row = rows // GROUP_P2  # among the program's heads
    row_ok = (kv_of_row < HEADS) & (rows % GROUP_P2 < GROUP)
    head = (first_kv + kv_of_row) * GROUP + rows % GROUP_P2
    cols = tl.arange(0, COLS_P2)  # the program's heads' dims, in the cache's order
    col_ok = cols < HEADS * HEAD_DIM
    mine = (cols[None, :] // HEAD_DIM == kv_of_row[:, None]) & row_ok[:, None] & col_ok[None, :]  # [rows, cols]
    out_offsets = head[:, None] * stride_oh + (cols % HEAD_DIM)[None, :]

    if program >= num_seqs:
        # A padding token's program: zero it (with splits the merge kernel does).
        token = (program - num_seqs).to(tl.int64)
        if NUM_SPLITS == 1 and token >= tl.load(query_start_loc_ptr + num_seqs):
            zeros = tl.zeros([ROWS_P2, COLS_P2], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + token * stride_ot + out_offsets, zeros, mask=mine)
        return
    q_start = tl.load(query_start_loc_ptr + program)
    if tl.load(query_start_loc_ptr + program + 1) == q_start:
        return  # nothing scheduled for this sequence
    token = q_start.to(tl.int64)
    q = tl.load(query_ptr + token * stride_qt + out_offsets, mask=mine, other=0.0)  # block-diagonal
    if KV_FP8:
        q = q.to(KV_DOT_DTYPE)
    kv_end = tl.load(seq_lens_ptr + program)  # the row is the sequence's last token: it sees every key
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)

    m_i = tl.full([ROWS_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS_P2], dtype=tl.float32)
    acc = tl.zeros([ROWS_P2, COLS_P2], dtype=tl.float32)
    table_row = block_tables_ptr + program.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + first_kv * HEAD_DIM
    v_base = v_cache_ptr + first_kv * HEAD_DIM
    for tile_start in range(kv_lo, kv_hi, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N)
        key_ok = key_pos < kv_hi
        # Masked keys load as 0: their slots may hold anything, and NaN times a zero weight is NaN.
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs
        kv_mask = key_ok[:, None] & col_ok[None, :]
        k = tl.load(k_base + slot[:, None] + cols[None, :], mask=kv_mask, other=0.0)  # the heads' rows at once
        if KV_FP8:
            k = k.to(KV_DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] + cols[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(KV_DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if KV_FP8:
        acc = acc * v_scale

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token * stride_ot + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mine)
    else:
        stat_offset = token * stride_mt + head * stride_mh + split
        tl.store(max_ptr + stat_offset, m_i, mask=row_ok)
        tl.store(sum_ptr + stat_offset, l_i, mask=row_ok)
        acc_offsets = token * stride_at + head[:, None] * stride_ah + split * stride_as + (cols % HEAD_DIM)[None, :]
        tl.store(acc_ptr + acc_offsets, acc, mask=mine)
