"""Pure-torch reference implementations of the kernels: paged KV cache, RMSNorm, rotary, SiLU-and-mul.

These are the CPU path and the ground truth the Triton kernels are tested against. They favour clarity, but
avoid per-token Python loops: all decode rows of a batch share one gather and one attention call.

Cache layout (one tensor per layer, for K and for V): `[num_blocks, block_size, num_kv_heads, head_dim]`.
A flat slot `s` is `block * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchllm.forward_context import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token t's key/value `[T, num_kv_heads, head_dim]` at flat slot `slot_mapping[t]`.

    Negative slots mark padding tokens (e.g. a batch padded up to a CUDA-graph size) and are skipped.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat mixed batch `[T, num_heads, head_dim]` over the paged KV cache.

    Every query token's own K/V must already be in the cache (`write_kv` runs first). Query token j of
    sequence i sits at absolute position `seq_lens[i] - query_len_i + j` and attends to the keys at
    positions `<=` its own. Heads are grouped (GQA): query head h reads KV head `h // (num_heads // num_kv_heads)`.
    Rows past `query_start_loc[-1]` (batch padding) come back as zeros.
    """
    output = torch.zeros_like(query)
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    decode_rows: list[int] = []
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if query_len == 1:
            decode_rows.append(i)
        elif query_len > 1:
            start = starts[i]
            output[start : start + query_len] = _prefill_attention(
                query[start : start + query_len], k_cache, v_cache, metadata.block_tables[i], seq_len, scale
            )
    if decode_rows:
        token_index = torch.tensor([starts[i] for i in decode_rows], device=query.device)
        rows_out = _decode_attention(
            query[token_index], k_cache, v_cache, metadata.block_tables, decode_rows,
            [seq_lens[i] for i in decode_rows], scale,
        )
        output.index_copy_(0, token_index, rows_out)
    return output


def _prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's `query_len` newest tokens attending over its first `seq_len` cached tokens."""
    query_len = query.shape[0]
    keys = _gather_sequence(k_cache, block_table, seq_len)
    values = _gather_sequence(v_cache, block_table, seq_len)
    num_context = seq_len - query_len
    if num_context == 0:
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


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Single-token queries `[B, num_heads, head_dim]` of several sequences, padded to the longest one."""
    block_size = k_cache.shape[1]
    device = query.device
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    lens = torch.tensor(seq_lens, device=device)
    tables = block_tables[torch.tensor(rows, device=device), :num_blocks].long()
    # Table entries past a sequence's last block are padding of unknown value: point them at block 0 so the
    # gather stays in bounds; the key-length mask below discards whatever they hold.
    blocks_used = (lens + block_size - 1) // block_size
    tables = torch.where(torch.arange(num_blocks, device=device) < blocks_used[:, None], tables, 0)
    key_valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]  # [B, max_len]
    keys = _gather_padded(k_cache, tables, max_len, key_valid)
    values = _gather_padded(v_cache, tables, max_len, key_valid)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys, values, attn_mask=key_valid[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return out[:, :, 0, :]


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence: `[seq_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _gather_padded(cache: torch.Tensor, tables: torch.Tensor, max_len: int, valid: torch.Tensor) -> torch.Tensor:
    """Keys or values of B sequences as `[B, num_kv_heads, max_len, head_dim]`, zero where `valid` is false.

    Zeroing matters: slots past a sequence's end may hold anything, NaN included, and a masked-out NaN still
    poisons the softmax-weighted sum (0 * NaN = NaN).
    """
    gathered = cache[tables].flatten(1, 2)[:, :max_len]  # [B, max_len, num_kv_heads, head_dim]
    gathered = torch.where(valid[:, :, None, None], gathered, 0)
    return gathered.transpose(1, 2)


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
