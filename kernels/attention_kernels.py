"""The Triton programs of paged attention; `attention.py` launches them and its docstring describes their design
(the tile of grouped heads, the program-to-sequence search, split-KV and its merge, FP8 caches, the variants)."""

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block_id, token_offset, BLOCK_Q: tl.constexpr):
    """The largest i in [0, num_seqs] whose first query block `(query_start_loc[i] - token_offset) // BLOCK_Q + i` is
    <= q_block_id."""
    # Tensors from the start: an int argument equal to 1 arrives as a constant, which cannot be loop-carried.
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = (tl.load(query_start_loc_ptr + mid) - token_offset) // BLOCK_Q + mid <= q_block_id
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _tanh(x):
    # Through exp2 of -2|x|, which is at most 1: no overflow for large scores (Triton has no portable tanh).
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def paged_attention_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, num_tokens, token_offset, qk_scale, v_scale,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    sliding_window, soft_cap, sinks_ptr, key_limit_ptr,
    out_ptr, stride_ot, stride_oh,
    acc_ptr, max_ptr, sum_ptr, stride_at, stride_ah, stride_as, stride_mt, stride_mh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KV_DOT_DTYPE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_SINKS: tl.constexpr, HAS_KEY_LIMIT: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Grid `((num_tokens - token_offset) // BLOCK_Q + num_seqs + 1, num_kv_heads, NUM_SPLITS)`, or
    `(num_seqs * num_kv_heads, 1, NUM_SPLITS)` with DECODE; see attention.py's docstring. `token_offset`: the decode
    rows launched apart before the first sequence, one query token each (their entries in the sequence arrays come
    first)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    split = tl.program_id(2)

    if DECODE:
        # Every sequence one query token: program i is sequence i % num_seqs, KV head i // num_seqs, without the
        # search's chain of loads. (Heads of a sequence adjacent instead, reading the same cache blocks together,
        # was 13 % slower at 200 rows x 600 keys of a 3-KV-head model on an H100 and no faster at 8 heads.)
        seq = tl.program_id(0) % num_seqs
        kv_head = tl.program_id(0) // num_seqs
        q_start = tl.load(query_start_loc_ptr + seq)
        q_block = 0
    else:
        # The sequences start after the `token_offset` decode rows launched apart, one token each.
        query_start_loc_ptr += token_offset
        seq_lens_ptr += token_offset
        block_tables_ptr += token_offset * stride_bt
        q_block_id = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block_id, token_offset, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_block = q_block_id - ((q_start - token_offset) // BLOCK_Q + seq)
    # Row r of the tile is query token r // GROUP_P2 of the block, query head kv_head * GROUP + r % GROUP_P2.
    rows = tl.arange(0, BLOCK_M)
    q_index = q_block * BLOCK_Q + rows // GROUP_P2  # within this sequence's query tokens
    head = kv_head * GROUP + rows % GROUP_P2
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM

    if seq == num_seqs:
        # Padding pseudo-sequence: zero its rows. With splits the merge kernel writes them instead.
        if NUM_SPLITS == 1:
            token = (q_start + q_index).to(tl.int64)
            row_ok = (token < num_tokens) & (rows % GROUP_P2 < GROUP)
            out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            zeros = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptrs, zeros, mask=row_ok[:, None] & dim_ok[None, :])
        return
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return

    token = (q_start + q_index).to(tl.int64)
    row_ok = (q_index < query_len) & (rows % GROUP_P2 < GROUP)
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if KV_FP8:
        q = q.to(KV_DOT_DTYPE)
    context_len = tl.load(seq_lens_ptr + seq) - query_len
    q_pos = context_len + q_index  # absolute position: sees keys at positions <= q_pos
    if HAS_KEY_LIMIT:
        # Clamped into [q_pos, seq_len - 1] (checking would take a sync): never a key past the sequence, and
        # always the row's own, so l_i > 0 below.
        key_limit = tl.load(key_limit_ptr + token, mask=row_ok, other=0)
        key_limit = tl.minimum(tl.maximum(key_limit, q_pos), context_len + query_len - 1)
        # Keys visible to the block's furthest-seeing row; later keys are skipped, not just masked.
        kv_end = tl.max(tl.where(row_ok, key_limit, 0), 0) + 1
    else:
        key_limit = q_pos
        # Keys visible to the block's last row; later keys are skipped, not just masked.
        kv_end = context_len + tl.minimum(query_len, (q_block + 1) * BLOCK_Q)
    kv_start = 0
    if USE_WINDOW:
        # Keys before the block's first row's window are skipped; the loop starts on a tile boundary.
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0) // TILE_N * TILE_N
    if NUM_SPLITS == 1:
        kv_lo = kv_start
        kv_hi = kv_end
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        kv_lo = kv_start + split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        # The sink is a key of weight exp(sink) and value 0: start from it as the running max, sum 1.
        # Split slices would count it once each, so only slice 0 holds it.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        has_sink = row_ok & (split == 0)
        m_i = tl.where(has_sink, sink, m_i)
        l_i = tl.where(has_sink, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(kv_lo, kv_hi, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N)
        key_ok = key_pos < kv_hi
        # Masked keys load as 0, not from the cache: their slots (and table entries) may hold anything,
        # and a NaN times a zero softmax weight is still NaN.
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        if KV_FP8:
            # Loaded the way it lies in memory (head dims contiguous), converted, then transposed: a byte-wide
            # tile loaded transposed would be converted in a layout that wastes most of each load.
            k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                        other=0.0)
            k_t = tl.trans(k.to(KV_DOT_DTYPE))
        else:
            k_t = tl.load(k_cache_ptr + slot[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None],
                          other=0.0)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFT_CAP:
            scores = soft_cap * _tanh(scores / soft_cap)
        visible = (key_pos[None, :] <= key_limit[:, None]) & key_ok[None, :]
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with nothing visible yet keeps max -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if KV_FP8:
            v = v.to(KV_DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if KV_FP8:
        acc = acc * v_scale  # linear in V: scaling the sum equals scaling every value

    store_ok = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        # Every real row sees its own key, so l_i > 0 on the rows that are stored.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        # Empty slices store max -inf, sum 0, acc 0: they drop out of the merge.
        stat_offset = token * stride_mt + head * stride_mh + split
        tl.store(max_ptr + stat_offset, m_i, mask=row_ok)
        tl.store(sum_ptr + stat_offset, l_i, mask=row_ok)
        acc_offset = token[:, None] * stride_at + head[:, None] * stride_ah + split * stride_as + dims[None, :]
        tl.store(acc_ptr + acc_offset, acc, mask=store_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr, acc_ptr, max_ptr, sum_ptr, query_start_loc_ptr, num_seqs,
    stride_ot, stride_oh, stride_at, stride_ah, stride_as, stride_mt, stride_mh,
    NUM_SPLITS: tl.constexpr, NUM_SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):
    """Grid `(num_tokens, num_heads)`: rescale each slice's partial to the common max and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    out_ptrs = out_ptr + token * stride_ot + head * stride_oh + dims
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        # Padding row: its partials were never written.
        tl.store(out_ptrs, tl.zeros([HEAD_DIM_P2], dtype=out_ptr.dtype.element_ty), mask=dim_ok)
        return
    splits = tl.arange(0, NUM_SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    stat_ptrs = token * stride_mt + head * stride_mh + splits
    m = tl.load(max_ptr + stat_ptrs, mask=split_ok, other=float("-inf"))
    total = tl.load(sum_ptr + stat_ptrs, mask=split_ok, other=0.0)
    acc = tl.load(acc_ptr + token * stride_at + head * stride_ah + splits[:, None] * stride_as + dims[None, :],
                  mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    # Some slice holds the row's own key, so the common max is finite.
    weight = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)
