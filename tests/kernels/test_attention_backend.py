"""The attention backends behind the `Attention` layer: the torch reference honours every per-layer option
(sliding window, logit soft-cap, sinks) against a hand-written masked softmax. The Triton backend, which
implements them too, is checked against this one in test_attention_variants.py."""

from __future__ import annotations

import math

import pytest
import torch

from batchllm.forward_context import AttentionMetadata, set_forward_context
from batchllm.model.attention import AttentionParams, attention_backend
from batchllm.model.layers.attention import Attention

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = HEAD_DIM**-0.5
# (context tokens already cached, new query tokens): a prefill on cached context, a fresh prefill, a decode row.
ROWS = [(5, 4), (0, 6), (9, 1)]


def hand_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, window: int | None,
                   cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query token at a time, one head at a time, in float64: softmax over the visible keys' scores."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    for i in range(q.shape[0]):
        pos = first_pos + i
        visible = [j for j in range(pos + 1) if window is None or pos - j < window]
        for h in range(NUM_HEADS):
            kv = h // group
            scores = []
            for j in visible:
                s = SCALE * float(q[i, h].double() @ keys[j, kv].double())
                scores.append(cap * math.tanh(s / cap) if cap is not None else s)
            top = max(scores + ([float(sinks[h])] if sinks is not None else []))
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
            out[i, h] = sum(w * values[j, kv].double() for w, j in zip(weights, visible)) / total
    return out


@pytest.mark.parametrize("options", [
    {},
    {"sliding_window": 3},
    {"logit_soft_cap": 2.0},
    {"sliding_window": 5, "logit_soft_cap": 1.5},
    {"sinks": True},
    {"sliding_window": 2, "logit_soft_cap": 3.0, "sinks": True},
], ids=lambda options: "-".join(options) or "plain")
def test_torch_backend_matches_a_hand_written_masked_softmax(options: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, **options)
    if layer.sinks is not None:
        layer.sinks.copy_(torch.randn(NUM_HEADS, generator=gen))
    num_blocks = 16
    # NaN everywhere a sequence does not own: a backend that reads past its keys shows it.
    layer.k_cache, layer.v_cache = (torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
                                    for _ in range(2))
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    queries, new_keys, new_values, slots, tables, dense = [], [], [], [], [], []
    for context, query_len in ROWS:
        seq_len = context + query_len
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        keys, values = (torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        row_slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        for p in range(context):  # the context's K/V, written by earlier steps
            layer.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[row_slots[p]] = keys[p]
            layer.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[row_slots[p]] = values[p]
        queries.append(torch.randn(query_len, NUM_HEADS, HEAD_DIM, generator=gen))
        new_keys.append(keys[context:])
        new_values.append(values[context:])
        slots += row_slots[context:]
        tables.append(blocks + [0] * (4 - len(blocks)))
        dense.append((keys, values, context))
    starts = [0]
    for _, query_len in ROWS:
        starts.append(starts[-1] + query_len)
    seq_lens = [context + query_len for context, query_len in ROWS]
    metadata = AttentionMetadata(torch.tensor(slots), torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
                                 max(q for _, q in ROWS), max(seq_lens), starts, seq_lens)

    with set_forward_context(metadata):
        out = layer(torch.cat(queries), torch.cat(new_keys), torch.cat(new_values))

    assert out.shape == (starts[-1], NUM_HEADS * HEAD_DIM)
    for i, (keys, values, context) in enumerate(dense):
        expected = hand_attention(queries[i], keys, values, context, options.get("sliding_window"),
                                  options.get("logit_soft_cap"), layer.sinks)
        got = out[starts[i] : starts[i + 1]].view(-1, NUM_HEADS, HEAD_DIM)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_cpu_takes_the_torch_backend_and_options_are_validated() -> None:
    assert attention_backend(torch.device("cpu")).name == "torch"
    assert attention_backend(torch.device("cpu")).needs_host_metadata
    with pytest.raises(ValueError, match="sliding_window=0"):
        AttentionParams(0.5, sliding_window=0)
    with pytest.raises(ValueError, match="logit_soft_cap=-1"):
        AttentionParams(0.5, logit_soft_cap=-1.0)
