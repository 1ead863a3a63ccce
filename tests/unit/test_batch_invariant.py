"""The batch-invariant CPU ops of `deterministic=True` (batchllm/model/layers/batch_invariant.py), small shapes.

Each gives a row the same bits alone (M = 1) and inside M = 7, 64, 300 rows, under 1 and 2 OpenMP threads; their
values equal the reference (F.linear, `kernels.reference.paged_attention`) within float32 rounding. The plain
ops' row dependence that makes them necessary is shown too, so these tests can fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference
from batchllm.model.layers.batch_invariant import ROW_CHUNK, invariant_paged_attention, row_chunked

BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 16, 40, 6, 2, 64


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_plain_linear_rounds_a_row_by_the_number_of_rows():
    torch.manual_seed(0)
    x, weight = torch.randn(64, 576), torch.randn(192, 576)
    assert not torch.equal(F.linear(x[:1], weight), F.linear(x, weight)[:1])  # what the chunking is for


def test_row_chunked_linear_gives_a_row_the_same_bits_inside_any_batch(threads):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(300, 576), torch.randn(192, 576), torch.randn(192)

    def linear(rows):
        return row_chunked(lambda chunk: F.linear(chunk, weight, bias), rows)

    alone = {i: linear(x[i:i + 1]) for i in (0, 5, 17, ROW_CHUNK + 3)}
    for rows in (7, 64, 300):
        batch = linear(x[:rows])
        for row, expected in alone.items():
            if row < rows:
                assert torch.equal(batch[row:row + 1], expected), (rows, row)
    three_d = linear(x[:64].view(8, 8, 576))
    torch.testing.assert_close(three_d.view(64, 192), x[:64] @ weight.t() + bias, rtol=1e-5, atol=1e-4)


def _cache_and_queries(seq_len: int):
    """A KV pool holding one sequence of `seq_len` tokens in shuffled blocks (the other slots NaN), and a query
    vector for each of its positions."""
    torch.manual_seed(1)
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = k_cache.clone()
    table = torch.randperm(NUM_BLOCKS)[: -(-seq_len // BLOCK_SIZE)].int()
    slots = (table.long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:seq_len]
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = torch.randn(seq_len, KV_HEADS, HEAD_DIM)
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = torch.randn(seq_len, KV_HEADS, HEAD_DIM)
    return k_cache, v_cache, table, torch.randn(seq_len, HEADS, HEAD_DIM)


def _metadata(pieces, table):
    """One step of the same sequence's pieces `(first position, query rows)`, each as a sequence of its own."""
    starts, seq_lens = [0], []
    for first, rows in pieces:
        starts.append(starts[-1] + rows)
        seq_lens.append(first + rows)
    tables = table[None].expand(len(pieces), -1).contiguous()
    return AttentionMetadata(torch.zeros(starts[-1], dtype=torch.int64), torch.tensor(starts, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), tables, max(r for _, r in pieces),
                             max(seq_lens), starts, seq_lens)


def _attend(pieces, k_cache, v_cache, table, queries, fn=invariant_paged_attention, **options):
    query = torch.cat([queries[first:first + rows] for first, rows in pieces])
    out = fn(query, k_cache, v_cache, _metadata(pieces, table), HEAD_DIM ** -0.5, **options)
    rows, start = {}, 0
    for first, count in pieces:
        for j in range(count):
            rows[first + j] = out[start + j]
        start += count
    return rows


OPTIONS = [{}, {"sliding_window": 24}, {"logit_soft_cap": 5.0}, {"sinks": torch.linspace(-1, 1, HEADS)}]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "soft-cap", "sinks"])
def test_attention_gives_a_position_the_same_bits_however_the_step_cuts_it(threads, options):
    seq_len = 150
    k_cache, v_cache, table, queries = _cache_and_queries(seq_len)
    prefill = _attend([(0, seq_len)], k_cache, v_cache, table, queries, **options)  # one prefill of every token
    # Chunked prefill (a 16-token budget), decode rows beside other sequences, a cached prefix then the rest.
    for pieces in ([(first, min(16, seq_len - first)) for first in range(0, seq_len, 16)],
                   [(149, 1), (0, 7), (80, 1), (120, 30)], [(100, 50), (3, 1)], [(63, 1), (64, 1), (0, 64)]):
        cut = _attend(pieces, k_cache, v_cache, table, queries, **options)
        for position, row in cut.items():
            assert torch.equal(row, prefill[position]), (pieces, position)
    expected = _attend([(0, seq_len)], k_cache, v_cache, table, queries, fn=reference.paged_attention, **options)
    for position in (0, 15, 16, 63, 64, 149):
        torch.testing.assert_close(prefill[position], expected[position], rtol=1e-5, atol=1e-5)


def test_plain_reference_attention_moves_with_the_step():
    k_cache, v_cache, table, queries = _cache_and_queries(150)
    prefill = _attend([(0, 150)], k_cache, v_cache, table, queries, fn=reference.paged_attention)
    # Decode rows and a short prefill (a 16-row chunk or a 50-row rest happen to round alike on this CPU).
    cut = _attend([(149, 1), (10, 1), (0, 7)], k_cache, v_cache, table, queries, fn=reference.paged_attention)
    assert all(not torch.equal(cut[p], prefill[p]) for p in (149, 10))  # what the invariant attention is for
