"""`AttentionMetadata.key_limit` (Gemma 3's image tokens see their whole image inside the causal model) in the torch
reference and the Triton kernel, against a softmax written here: the full `[query_len, seq_len]` mask built by hand
(causal, or both tokens in the same image span, and the sliding window when set), in float64 on K/V gathered from
the paged cache by the block tables.

The batch mixes a fresh prefill with two image spans, a chunk on cached context whose span starts mid-chunk, a
span that ends the chunk, a decode row, a plain prefill and padding rows; the spans cross the kernel's 32-token query
blocks, so a block's key loop must run past its last row. Without a GPU the kernel runs in Triton's interpreter
(tests/conftest.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference

BLOCK_SIZE = 16
NUM_KV_HEADS = 2
HEAD_DIM = 32
PAD_TOKENS = 3


@dataclass(frozen=True)
class Row:
    query_len: int
    seq_len: int
    spans: tuple[tuple[int, int], ...] = ()  # image tokens [start, end), absolute positions inside the chunk


ROWS = [
    Row(40, 40, ((5, 17), (22, 35))),  # the second span crosses the query block at 32
    Row(1, 37),  # decode
    Row(40, 70, ((55, 67),)),  # 30 cached tokens; the span starts mid-chunk and crosses a query block
    Row(9, 9),  # plain prefill
    Row(12, 28, ((20, 28),)),  # the span ends the chunk: its tokens see up to seq_len - 1
    Row(0, 20),  # nothing scheduled
]
OPTIONS = {
    "plain": {},
    "window": dict(sliding_window=7),  # shorter than every image span
    "soft_cap": dict(logit_soft_cap=2.5),
    "window-soft_cap-sinks": dict(sliding_window=5, logit_soft_cap=1.5, sinks=True),
}


@dataclass
class Batch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def span_ids(row: Row) -> torch.Tensor:
    """`[seq_len]`: the index of the image span holding each position, -1 for text."""
    ids = torch.full((row.seq_len,), -1)
    for index, (start, end) in enumerate(row.spans):
        ids[start:end] = index
    return ids


def make_batch(gqa: int, seed: int) -> Batch:
    """Random K/V for every row's tokens in shuffled cache blocks; the rest of the cache is NaN, so a key read past
    a sequence shows up. `key_limit`: the span's last position for image tokens, the own position otherwise."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * sum(-(-row.seq_len // BLOCK_SIZE) for row in ROWS) + 1
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-row.seq_len // BLOCK_SIZE) for row in ROWS)
    tables = torch.tensor([[free.pop() for _ in range(max_blocks)] for _ in ROWS], dtype=torch.int32)
    k_cache = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    limits = []
    for i, row in enumerate(ROWS):
        pos = torch.arange(row.seq_len)
        slots = tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        for cache in (k_cache, v_cache):
            cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = torch.randn(row.seq_len, NUM_KV_HEADS, HEAD_DIM,
                                                                        generator=gen)
        limit = pos.clone()
        for start, end in row.spans:
            limit[start:end] = end - 1
        limits.append(limit[row.seq_len - row.query_len :])
    limits.append(torch.zeros(PAD_TOKENS, dtype=torch.long))
    starts = [0]
    for row in ROWS:
        starts.append(starts[-1] + row.query_len)
    num_tokens = starts[-1] + PAD_TOKENS
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([row.seq_len for row in ROWS], dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(row.query_len for row in ROWS),
        max_seq_len=max(row.seq_len for row in ROWS),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[row.seq_len for row in ROWS],
        key_limit=torch.cat(limits).to(torch.int32),
    )
    query = torch.randn(num_tokens, NUM_KV_HEADS * gqa, HEAD_DIM, generator=gen)
    return Batch(query, k_cache, v_cache, metadata)


def expected_attention(batch: Batch, scale: float, sliding_window: int | None = None,
                       logit_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                       bidirectional: bool = True) -> torch.Tensor:
    """Float64 attention with the hand-built mask; `bidirectional=False` ignores the spans (plain causal)."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    group = batch.query.shape[1] // NUM_KV_HEADS
    for i, row in enumerate(ROWS):
        start = batch.metadata.query_start_loc_cpu[i]
        pos = torch.arange(row.seq_len)
        slots = batch.metadata.block_tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        keys, values = (cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(group, dim=1)
                        for cache in (batch.k_cache, batch.v_cache))
        query_pos = pos[row.seq_len - row.query_len :, None]
        ids = span_ids(row)
        same_image = (ids[query_pos] == ids[None, :]) & (ids[None, :] >= 0)
        visible = (pos[None, :] <= query_pos) | (same_image & bidirectional)
        if sliding_window is not None:
            visible &= pos[None, :] > query_pos - sliding_window
        query = batch.query[start : start + row.query_len].double()
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        if logit_soft_cap is not None:
            scores = logit_soft_cap * torch.tanh(scores / logit_soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, row.query_len, 1)], dim=-1)
        probs = scores.softmax(dim=-1)[..., : row.seq_len]
        out[start : start + row.query_len] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def options_for(name: str, num_heads: int) -> dict:
    options = dict(OPTIONS[name])
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) + 1.0
    return options


@pytest.mark.parametrize("gqa", [1, 2])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_reference_honours_key_limit(name: str, gqa: int) -> None:
    batch = make_batch(gqa, seed=gqa)
    options = options_for(name, batch.query.shape[1])
    scale = HEAD_DIM**-0.5
    out = reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, **options)
    expected = expected_attention(batch, scale, **options)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The spans change the image rows' results, so a path that ignored the limit would fail above.
    causal = expected_attention(batch, scale, **options, bidirectional=False)
    assert not torch.allclose(causal, expected, atol=1e-3)


def test_reference_refuses_a_limit_outside_the_sequence() -> None:
    batch = make_batch(1, seed=3)
    scale = HEAD_DIM**-0.5
    batch.metadata.key_limit[40] = 37  # the decode row (sequence 1, at position 36) may not see past seq_len - 1
    with pytest.raises(ValueError, match="key_limit of sequence 1"):
        reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    batch.metadata.key_limit[40] = 35  # nor less than its own position
    with pytest.raises(ValueError, match="key_limit of sequence 1"):
        reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)


def test_set_key_limit_reaches_every_group() -> None:
    batch = make_batch(1, seed=4)
    metadata, limit = batch.metadata, batch.metadata.key_limit
    metadata.key_limit = None
    metadata.groups = [AttentionMetadata(**{f: getattr(metadata, f) for f in ("slot_mapping", "query_start_loc",
                       "seq_lens", "block_tables", "max_query_len", "max_seq_len", "query_start_loc_cpu",
                       "seq_lens_cpu")}) for _ in range(2)]
    assert metadata.set_key_limit(limit) is metadata
    assert all(m.key_limit is limit for m in [metadata, *metadata.groups])


@pytest.mark.parametrize(("name", "gqa", "num_splits"),
                         [("plain", 2, 1), ("plain", 1, 3), ("window", 2, 1), ("soft_cap", 2, 3),
                          ("window-soft_cap-sinks", 2, 1)])
def test_triton_kernel_honours_key_limit(name: str, gqa: int, num_splits: int) -> None:
    pytest.importorskip("triton")
    from batchllm.kernels.attention import paged_attention_triton

    batch = make_batch(gqa, seed=10 + gqa)
    options = options_for(name, batch.query.shape[1])
    scale = HEAD_DIM**-0.5
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, out=out,
                           num_splits=num_splits, **options)
    assert torch.equal(out[-PAD_TOKENS:], torch.zeros_like(out[-PAD_TOKENS:])), "padding rows must be zeros"
    torch.testing.assert_close(out.double(), expected_attention(batch, scale, **options), atol=2e-5, rtol=2e-5)


def test_triton_kernel_with_key_limit_is_batch_invariant() -> None:
    """`invariant=True` takes key limits: the image prefill's rows are bitwise the same alone and in the batch."""
    pytest.importorskip("triton")
    from batchllm.kernels.attention import paged_attention_triton

    batch = make_batch(2, seed=5)
    scale = HEAD_DIM**-0.5
    out = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, invariant=True)
    torch.testing.assert_close(out.double(), expected_attention(batch, scale), atol=2e-5, rtol=2e-5)
    first = ROWS[0].query_len
    alone = AttentionMetadata(batch.metadata.slot_mapping[:first], batch.metadata.query_start_loc[:2],
                              batch.metadata.seq_lens[:1], batch.metadata.block_tables[:1], first, ROWS[0].seq_len,
                              [0, first], [ROWS[0].seq_len], key_limit=batch.metadata.key_limit[:first])
    out_alone = paged_attention_triton(batch.query[:first], batch.k_cache, batch.v_cache, alone, scale,
                                       invariant=True)
    assert torch.equal(out_alone, out[:first])


@pytest.mark.parametrize("name", ["plain", "window-soft_cap-sinks"])
def test_triton_kernel_honours_key_limit_with_decode_rows_launched_apart(name: str, monkeypatch) -> None:
    """An image prefill step of a running batch: its leading decode rows (`num_decodes`) go to the decode grid, which
    reads their key limits at their own tokens; the rows after them to the general grid."""
    pytest.importorskip("triton")
    from batchllm.kernels.attention import paged_attention_triton

    monkeypatch.setattr(sys.modules[__name__], "ROWS", [Row(1, 25), Row(1, 3), Row(1, 50), *ROWS])
    batch = make_batch(2, seed=12)
    batch.metadata.num_decodes = 3
    options = options_for(name, batch.query.shape[1])
    scale = HEAD_DIM**-0.5
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, out=out, **options)
    assert torch.equal(out[-PAD_TOKENS:], torch.zeros_like(out[-PAD_TOKENS:])), "padding rows must be zeros"
    torch.testing.assert_close(out.double(), expected_attention(batch, scale, **options), atol=2e-5, rtol=2e-5)
