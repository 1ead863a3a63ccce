"""Pure-torch reference implementations of the kernels: paged KV cache (model dtype or FP8), RMSNorm, rotary,
SiLU-and-mul, the structured-output token bitmask, the batched multi-LoRA delta, per-token FP8 quantization and
the packed-integer (4- or 8-bit, W4A16) weight matmul.

These are the CPU path and the ground truth the Triton kernels are tested against. They favour clarity, but
avoid per-token Python loops: all decode rows of a batch share one gather and one attention call.

Cache layout (one tensor per layer, for K and for V): `[num_blocks, block_size, num_kv_heads, head_dim]`.
A flat slot `s` is `block * block_size + offset`. An FP8 cache (float8_e4m3fn) holds `x / scale`, saturated
to ±448, with one scale per layer for K and one for V; readers multiply by the scale.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from batchllm.forward_context import AttentionMetadata

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12  # keeps an all-zero row's scale positive: its values quantize to 0 and come back as 0


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store token t's key/value `[T, num_kv_heads, head_dim]` at flat slot `slot_mapping[t]`.

    Negative slots mark padding tokens (e.g. a batch padded up to a CUDA-graph size) and are skipped. FP8
    caches store `key / k_scale` and `value / v_scale`; other caches ignore the scales.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = new[keep]
        if cache.dtype == FP8_DTYPE:
            # torch has no index_copy_ for float8 dtypes: copy the bytes.
            rows = quantize_fp8(rows, scale).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """`x / scale`, divided in float32, saturated to the float8_e4m3fn range and rounded to nearest even."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row FP8 quantization of activations `[T, K]`: `(q [T, K] float8_e4m3fn, scale [T, 1] float32)`
    with `scale = max(amax / 448, FP8_MIN_SCALE)` over each row, so `q * scale` approximates `x`."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return quantize_fp8(x, scale), scale


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat mixed batch `[T, num_heads, head_dim]` over the paged KV cache.

    Every query token's own K/V must already be in the cache (`write_kv` runs first). Query token j of
    sequence i sits at absolute position `seq_lens[i] - query_len_i + j` and attends to the keys at
    positions `<=` its own. Heads are grouped (GQA): query head h reads KV head `h // (num_heads // num_kv_heads)`.
    Rows past `query_start_loc[-1]` (batch padding) come back as zeros. FP8 caches are read as
    `cache * k_scale` / `cache * v_scale`, in the query dtype.

    The options of `batchllm.model.attention.AttentionParams`: with `sliding_window` a query sees only the keys
    at positions `q - sliding_window < k <= q`; `logit_soft_cap` maps each scaled score s to
    `cap * tanh(s / cap)`; `sinks [num_heads]` adds one logit per head to each softmax's denominator, with no
    value. These take a float32 path with an explicit mask. `metadata.key_limit` moves each query's upper bound
    from its own position to its limit (the window stays relative to the own position).
    """
    if metadata.query_start_loc_cpu is None or metadata.seq_lens_cpu is None:
        raise ValueError("the reference attention loops over the metadata's host copies (query_start_loc_cpu, "
                         "seq_lens_cpu), which the metadata builder makes only for a backend that needs them")
    # One attention call per sequence over exactly its own keys: no padding to the longest sequence and no
    # masking copies, which on the CPU cost far more than the per-sequence call overhead. Only a sequence's own
    # tokens are gathered, so whatever the rest of the cache holds (NaN included) is never read.
    plain = sliding_window is None and logit_soft_cap is None and sinks is None
    output = torch.zeros_like(query)
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        if end <= start:
            continue
        # A window skips the blocks before its first query's window: a hybrid KV cache has freed them already.
        first_block = 0 if sliding_window is None else (
            max(0, seq_len - (end - start) - sliding_window + 1) // k_cache.shape[1])
        keys = _gather_sequence(k_cache, metadata.block_tables[i], seq_len, k_scale, query.dtype, first_block)
        values = _gather_sequence(v_cache, metadata.block_tables[i], seq_len, v_scale, query.dtype, first_block)
        limit = None if metadata.key_limit is None else _sequence_key_limit(metadata.key_limit, i, start, end, seq_len)
        if plain:
            output[start:end] = _sequence_attention(query[start:end], keys, values, scale, limit)
        else:
            output[start:end] = _masked_attention(query[start:end], keys, values, scale, sliding_window,
                                                  logit_soft_cap, sinks, first_block * k_cache.shape[1], limit)
    return output


def _sequence_key_limit(key_limit: torch.Tensor, seq: int, start: int, end: int, seq_len: int) -> torch.Tensor | None:
    """Sequence `seq`'s query tokens' key limits `[query_len]`, or None where every one is its own position."""
    limit = key_limit[start:end].long()
    own = torch.arange(seq_len - (end - start), seq_len, device=limit.device)
    if bool((limit < own).any()) or bool((limit >= seq_len).any()):
        raise ValueError(f"key_limit of sequence {seq} (tokens {start}..{end - 1}) must lie between each token's "
                         f"own position and seq_len - 1 = {seq_len - 1}: got {limit.tolist()}")
    return limit if bool((limit > own).any()) else None


def _sequence_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        key_limit: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's `query_len` newest tokens attending over its `seq_len` gathered keys and values, each up to
    its own position, or up to `key_limit [query_len]` (absolute positions) when given."""
    query_len, seq_len = query.shape[0], keys.shape[0]
    num_context = seq_len - query_len
    if key_limit is not None:
        mask, is_causal = torch.arange(seq_len, device=query.device)[None, :] <= key_limit[:, None], False
    elif query_len == 1:
        mask, is_causal = None, False  # a decode row sees every key
    elif num_context == 0:
        mask, is_causal = None, True
    else:
        # Query j sits at absolute position num_context + j: causal with an offset.
        query_pos = torch.arange(num_context, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        mask, is_causal = key_pos[None, :] <= query_pos[:, None], False
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def _masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      sliding_window: int | None, logit_soft_cap: float | None, sinks: torch.Tensor | None,
                      first_key: int = 0, key_limit: torch.Tensor | None = None) -> torch.Tensor:
    """`_sequence_attention` with the optional features, as an explicit float32 softmax. `keys` and `values` are
    the sequence's from position `first_key` on."""
    query_len, num_keys = query.shape[0], keys.shape[0]
    seq_len = first_key + num_keys
    query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
    key_pos = torch.arange(first_key, seq_len, device=query.device)[None, :]
    visible = key_pos <= (query_pos if key_limit is None else key_limit[:, None])
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    group = query.shape[1] // keys.shape[1]
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * torch.tanh(scores / logit_soft_cap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, query_len, 1)], dim=-1)
    probs = scores.softmax(dim=-1)[..., :num_keys]
    return torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float,
                     dtype: torch.dtype, first_block: int = 0) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence, from block `first_block` on:
    `[seq_len - first_block * block_size, num_kv_heads, head_dim]`, dequantized to `dtype`."""
    block_size = cache.shape[1]
    blocks = block_table[first_block : -(-seq_len // block_size)].long()
    tokens = cache[blocks].flatten(0, 1)[: seq_len - first_block * block_size]
    return (tokens.float() * scale).to(dtype) if cache.dtype == FP8_DTYPE else tokens


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, numerically HF's `LlamaRMSNorm`; with `residual`, the fused add.

    Returns `norm(x)`, or `(norm(x + residual), x + residual)`. The add happens in the input dtype, as HF's
    decoder layers do it; statistics are float32 and the result is cast back to the input dtype before the
    weight multiply, in that order, because that is what the checkpoints were trained and evaluated with.
    """
    if residual is not None:
        residual = x + residual
        return rms_norm(residual, weight, eps), residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def apply_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary, in place: `query [T, Hq, D]` and `key [T, Hkv, D]` rotated by `positions [T]`.

    `cos`/`sin` are float32 tables `[max_positions, D // 2]`; rows are cast to the activation dtype before
    use, as HF does. Returns `(query, key)`.
    """
    cos_t = cos[positions].to(query.dtype)[:, None, :]
    sin_t = sin[positions].to(query.dtype)[:, None, :]
    query.copy_(_rotate(query, cos_t, sin_t))
    key.copy_(_rotate(key, cos_t, sin_t))
    return query, key


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a fused gate_up projection output `[..., 2 * d]` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Bit j of byte b, for every byte: unpacks a bitmask a byte at a time, eight times less index work than
# shifting every int32 word by each of its 32 bit positions.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place on `[B, V]` logits: row `rows[i]`'s token `t` becomes -inf unless bit `t % 32` of
    `bitmask[i, t // 32]` (int32 `[len(rows), W]`, xgrammar's and llguidance's layout) is set. Tokens past the
    bitmask's `32 * W` bits (a model's padding past its tokenizer) are forbidden. Returns `logits`."""
    vocab = logits.shape[-1]
    # Viewed as little-endian bytes, word w's byte k holds the bits of tokens 32w + 8k ... 32w + 8k + 7.
    assert sys.byteorder == "little", "the bitmask is read as little-endian bytes"
    allowed = _BYTE_BITS.to(bitmask.device)[bitmask.contiguous().view(torch.uint8).long()].flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    # Every row, in order (the common case): one fill. Checked on the CPU only: on a device it would sync.
    if rows.device.type == "cpu" and len(rows) == len(logits) and torch.equal(rows, torch.arange(len(rows))):
        return logits.masked_fill_(~allowed, float("-inf"))
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits


def add_lora_(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_tokens: torch.Tensor,
              slot_starts: torch.Tensor) -> torch.Tensor:
    """In place: `out[t] += (x[t] a[s]^T) b[s]^T` for the tokens t of slot s's segment; returns `out`.

    `x [T, in]`, `out [T, out_features]`, `a [S, W, in]`, `b [S, out_features, W]`. Slot s's tokens are
    `sorted_tokens[slot_starts[s]:slot_starts[s + 1]]` (int32, `slot_starts [S + 1]`); a token is in at most
    one segment, and the others (base-model tokens, padding) are left bit-identical. Rounding: both products
    accumulate in float32; the intermediate `x a^T` is rounded to x's dtype (as a plain `x @ a.T` would be),
    and `out + delta` is rounded once to out's dtype.
    """
    starts = slot_starts.tolist()  # the CPU path: a sync on a device is acceptable here
    for slot in range(a.shape[0]):
        start, end = starts[slot], starts[slot + 1]
        if end <= start:
            continue
        tokens = sorted_tokens[start:end].long()
        y = (x.index_select(0, tokens).float() @ a[slot].float().T).to(x.dtype)
        delta = y.float() @ b[slot].float().T
        out.index_copy_(0, tokens, (out.index_select(0, tokens).float() + delta).to(out.dtype))
    return out


def unpack_int(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[K, N]` (int32, 0 .. 2**bits - 1) of a K-packed `qweight [K * bits // 32, N]` int32: row k of the
    codes is bits `bits * (k % pack)` upwards of word row `k // pack`, with `pack = 32 // bits`."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    codes = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(qweight.shape[0] * pack, qweight.shape[1])


def dequantize_int(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                   g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 `w [K, N]` of a packed-integer weight: `w[k, n] = (code[k, n] - zeros[g, n]) * scales[g, n]`.

    The layout every 4-/8-bit checkpoint format is converted to on load: `qweight` K-packed (`unpack_int`),
    `scales [G, N]` float32 and `zeros [G, N]` uint8 (unsigned zero points, 2**(bits-1) for symmetric
    weights). Row k is in group `k // group_size`, or `g_idx[k]` (int32 `[K]`) when given (act-order rows
    whose groups are not contiguous).
    """
    codes = unpack_int(qweight, bits)
    groups = (torch.arange(codes.shape[0], device=codes.device) // group_size if g_idx is None else g_idx.long())
    return (codes - zeros.long().index_select(0, groups)).float() * scales.float().index_select(0, groups)


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ dequantize_int(...)` → `[M, N]` in x's dtype, the product accumulated in float32."""
    w = dequantize_int(qweight, scales, zeros, bits, group_size, g_idx)
    return (x.float() @ w).to(x.dtype)
