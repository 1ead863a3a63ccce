"""What the model runner and its device proposers exchange: the step's batch, the rows that draft, and the
builder of the attention metadata of the proposers' own passes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.kv_cache import KVCache
from batchllm.forward_context import AttentionMetadata, set_forward_context


@dataclass(slots=True)
class ObservedStep:
    """A step's flat batch as the target ran it: the device inputs and hidden states (the first `num_tokens`
    rows are real), and per scheduled row its first flat token, its token count, its computed tokens before
    the step, its `BlockTables` row, whether the runner saw it first this step, and its draft tokens."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    hidden: torch.Tensor
    aux_hidden: torch.Tensor | None
    num_tokens: int
    query_start: np.ndarray
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    table_rows: np.ndarray
    new_rows: np.ndarray
    num_drafts: np.ndarray


@dataclass(slots=True)
class LookaheadRows:
    """The rows that draft at the end of a step: each one's index among the step's sampled rows, its table row
    in `BlockTables`, the position its last new token will take when it is accepted (with no draft accepted), and
    how many drafts it wants."""

    sampled_rows: list[int]
    table_rows: list[int]
    positions: list[int]
    num_drafts: list[int]


class Drafter:
    """What every device proposer offers the runner; proposers without K/V of their own keep the defaults."""

    kv_cache: KVCache | None = None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype, group: int = 0) -> None:
        """Its K/V in the pool's block ids, read at KV group `group`'s (a hybrid KV cache's `drafter_group`)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if self.kv_cache is not None:
            self.kv_cache.copy_blocks(copies)

    def observe(self, step: ObservedStep, block_tables: np.ndarray, attention: AttentionMetadataBuilder) -> None:
        """Sees every step's batch right after the target's forward pass."""

    def skip(self, table_rows: np.ndarray) -> None:
        """A step the proposer does not run over (speculation is off): these rows' K/V there stays stale."""

    def accepted(self, table_rows: np.ndarray, last_index: torch.Tensor) -> None:
        """After a speculative step's sampling: the flat index of each sampled row's last accepted token."""

    def propose(self, rows: LookaheadRows, last_tokens: torch.Tensor, num_accepted: list[int],
                block_tables: np.ndarray, attention: AttentionMetadataBuilder, hidden: torch.Tensor,
                hidden_rows: torch.Tensor) -> list[list[int]]:
        """Drafts for each lookahead row after its `last_tokens` (device, one per row), which sits at
        `positions + num_accepted`; `hidden_rows`: the flat index of the hidden state that yielded it."""
        raise NotImplementedError


def draft_chain(positions: np.ndarray, tables: np.ndarray, num_drafts: list[int], attention: AttentionMetadataBuilder,
                state: tuple[torch.Tensor, ...],
                step: Callable[[tuple[torch.Tensor, ...], torch.Tensor], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
                ) -> list[list[int]]:
    """Greedy drafts, one pass per draft token: `step(state, positions)` runs the proposer on the rows still
    drafting, one query token each at `positions` (the forward context is set), and returns their draft
    tokens and next state (per-row tensors); a row drops out once it has `num_drafts` drafts."""
    positions = positions.copy()
    remaining = np.array(num_drafts, dtype=np.int64)
    active = np.arange(len(positions))
    passes = []
    for _ in range(int(remaining.max())):
        with set_forward_context(attention.for_decode_rows(positions[active], tables[active])):
            tokens, state = step(state, torch.from_numpy(positions[active]).to(attention.device))
        passes.append((active, tokens))
        positions[active] += 1
        remaining[active] -= 1
        keep = remaining[active] > 0
        if not keep.all():
            kept = torch.from_numpy(np.flatnonzero(keep)).to(attention.device)
            state, active = tuple(t[kept] for t in state), active[keep]
    drafted = [[] for _ in positions]
    for active, tokens in passes:  # one read-back per pass, after all of them are queued
        for row, token in zip(active.tolist(), tokens.tolist()):
            drafted[row].append(token)
    return drafted

