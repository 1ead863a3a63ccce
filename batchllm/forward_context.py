"""Attention metadata for the current forward pass, set by the model runner.

Model code sees only `(input_ids, positions)`; the attention layers read paging information from here.
This is what lets the same model code serve prefill, chunked prefill, decode and mixed batches.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """A flat batch of `num_tokens` query tokens from `num_seqs` sequences.

    Sequence i owns query tokens `query_start_loc[i]:query_start_loc[i+1]`, which sit at the end of its
    `seq_lens[i]` tokens of context (so `seq_lens[i] - query_len` of them were computed in earlier steps and
    live only in the KV cache). `block_tables[i, j]` is the cache block holding tokens
    `[j*block_size, (j+1)*block_size)` of sequence i. `slot_mapping[t]` is the flat cache slot
    (block * block_size + offset) where token t's K and V are written.

    With a hybrid KV cache (engine/kv_groups.py) each group of layers has its own block tables and slots:
    `groups[g]` is group g's metadata (views of one buffer), which its layers read instead.

    `key_limit[t]` (int32 `[num_tokens]`, on the metadata's device) lets query token t see keys past its own
    position: it is the absolute position of the last key t may see, so token t of sequence i at position p sees
    keys `<= key_limit[t]` with `p <= key_limit[t] < seq_lens[i]` (Gemma 3's image tokens see the whole image
    they belong to). With a sliding window keys must still be `> p - window`: the window stays relative to the
    token's own position, only the upper bound moves. None (the default) is causal: every limit is `p`. Keys up
    to the limit must be in the cache when the layer runs, so a bidirectional span is computed in one chunk (the
    K/V write precedes attention). Layers read their group's metadata: set it with `set_key_limit`, which gives
    every group the same tensor (the limit is per token, not per group).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU reference path can loop without device syncs; None where the attention backend
    # does not read them (`AttentionBackend.needs_host_metadata`).
    query_start_loc_cpu: list[int] | None
    seq_lens_cpu: list[int] | None
    groups: list[AttentionMetadata] | None = None
    key_limit: torch.Tensor | None = None  # [num_tokens] int32; None: causal
    # How many leading sequences are decode rows (one query token each) in a batch with longer queries after them:
    # the Triton backend launches them apart, with its decode kernel. 0: none, or not counted.
    num_decodes: int = 0

    def set_key_limit(self, key_limit: torch.Tensor | None) -> AttentionMetadata:
        """Set `key_limit` here and on every group's metadata, which a hybrid KV cache's layers read instead."""
        self.key_limit = key_limit
        for group in self.groups or ():
            group.key_limit = key_limit
        return self


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context: wrap the forward pass in set_forward_context()")
    return _current


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous
