"""The reference KV write, paged attention and token bitmask against hand-written, obviously-correct versions."""

from __future__ import annotations

import math

import pytest
import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference
from batchllm.kernels.reference import paged_attention, write_kv

BLOCK_SIZE = 8
NUM_BLOCKS = 1024
HEAD_DIM = 16


def test_write_kv_matches_a_loop_and_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    num_kv_heads = 2
    k_cache = torch.zeros(6, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 40, -1, 17, 0, -1, 47])
    key = torch.randn(len(slots), num_kv_heads, HEAD_DIM, generator=gen)
    value = torch.randn(len(slots), num_kv_heads, HEAD_DIM, generator=gen)

    write_kv(key, value, k_cache, v_cache, slots)

    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[t]
            expected_v[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[t]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# (query_len, seq_len) per sequence: decode rows, a prefill chunk on top of cached context, fresh prefills,
# sequences that end exactly on and just past a block boundary.
MIXED_BATCH = [(1, 1), (1, 37), (12, 30), (1, 16), (9, 9), (1, 17), (24, 24), (5, 41)]


@pytest.mark.parametrize("gqa_ratio", [1, 3, 4])
def test_paged_attention_matches_dense_causal_attention(gqa_ratio: int) -> None:
    gen = torch.Generator().manual_seed(gqa_ratio)
    num_kv_heads = 2
    num_heads = num_kv_heads * gqa_ratio
    scale = 1 / math.sqrt(HEAD_DIM)
    # Every slot that no sequence owns, and every owned slot past a sequence's end, holds NaN: reading any
    # of them would poison the result.
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    # Block ids drawn, shuffled, from the top of a large pool.
    free_blocks = (NUM_BLOCKS - 1 - torch.randperm(64, generator=gen)).tolist()
    max_blocks = max(-(-seq_len // BLOCK_SIZE) for _, seq_len in MIXED_BATCH)
    block_tables = torch.full((len(MIXED_BATCH), max_blocks), NUM_BLOCKS - 1, dtype=torch.int32)

    dense_keys, dense_values, queries, slot_mapping = [], [], [], []
    for i, (query_len, seq_len) in enumerate(MIXED_BATCH):
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_tables[i, : len(blocks)] = torch.tensor(blocks)
        keys = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        values = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)])
        num_context = seq_len - query_len
        # The context was written in earlier steps; this step's tokens are written through write_kv below.
        write_kv(keys[:num_context], values[:num_context], k_cache, v_cache, slots[:num_context])
        dense_keys.append(keys)
        dense_values.append(values)
        queries.append(torch.randn(query_len, num_heads, HEAD_DIM, generator=gen))
        slot_mapping.append(slots[num_context:])

    query_lens = [q for q, _ in MIXED_BATCH]
    seq_lens = [s for _, s in MIXED_BATCH]
    starts = [0] + torch.tensor(query_lens).cumsum(0).tolist()
    step_slots = torch.cat(slot_mapping)
    step_keys = torch.cat([k[s - q :] for k, (q, s) in zip(dense_keys, MIXED_BATCH)])
    step_values = torch.cat([v[s - q :] for v, (q, s) in zip(dense_values, MIXED_BATCH)])
    write_kv(step_keys, step_values, k_cache, v_cache, step_slots)
    metadata = AttentionMetadata(
        slot_mapping=step_slots,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )

    out = paged_attention(torch.cat(queries), k_cache, v_cache, metadata, scale)

    expected = torch.cat([
        _dense_causal_attention(q, k, v, scale) for q, k, v in zip(queries, dense_keys, dense_values)
    ])
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(QK^T)V for one sequence, written out: query j is the token at position seq_len - query_len + j."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    out = torch.empty_like(query)
    for h in range(num_heads):
        kv_head = h // (num_heads // num_kv_heads)
        for j in range(query_len):
            visible = seq_len - query_len + j + 1
            scores = keys[:visible, kv_head] @ query[j, h] * scale
            weights = torch.exp(scores - scores.max())
            out[j, h] = (weights / weights.sum()) @ values[:visible, kv_head]
    return out


def random_bitmask(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """int32 words, ceil(vocab / 32) per row: all-allowed, all-forbidden and random words, signs included."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (num_rows, -(-vocab // 32)), dtype=torch.int32, generator=gen)
    words[:, ::5] = -1
    words[:, 1::7] = 0
    return words


@pytest.mark.parametrize("bitmask_vocab", [100, 40])  # 40: the model's ids past 64 have no bits (padding)
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [3, 0], []])
def test_token_bitmask_matches_a_loop_over_bits(rows: list[int], bitmask_vocab: int) -> None:
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    bitmask = random_bitmask(len(rows), bitmask_vocab, seed=2)
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token in range(vocab):
            if token // 32 >= bitmask.shape[1] or not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    out = reference.apply_token_bitmask_(logits, torch.tensor(rows, dtype=torch.long), bitmask)
    assert out is logits
    assert torch.equal(logits, expected)


def test_moe_reference_equals_a_dense_per_token_loop():
    # Every token through each of its k experts, written out densely: the reference must agree, experts that no
    # token chose included (they are skipped) and biases on.
    from batchllm.kernels.moe_reference import fused_moe

    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 7, 16, 12, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [3, 1], [3, 0], [1, 3], [0, 3], [1, 0]])  # expert 2 and 4: no token
    weights = torch.rand(tokens, k, generator=gen)
    for activation in ("silu", "gelu_tanh", "swigluoai"):
        expected = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for slot in range(k):
                e = int(ids[t, slot])
                gate, up = (w13[e] @ x[t] + b13[e]).chunk(2)
                if activation == "silu":
                    act = gate / (1 + torch.exp(-gate)) * up
                elif activation == "gelu_tanh":
                    act = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
                else:
                    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                    act = gate / (1 + torch.exp(-1.702 * gate)) * (up + 1)
                expected[t] += weights[t, slot] * (w2[e] @ act + b2[e])
        got = fused_moe(x, w13, w2, weights, ids, activation, b13, b2, swiglu_limit=7.0)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
