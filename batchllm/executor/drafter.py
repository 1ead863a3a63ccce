"""Device proposers: they draft a row's next tokens at the end of the step that verified its last ones.

- `DraftModelDrafter`: a smaller model of the same vocabulary, run by the same machinery as the target: its
  own paged KV cache with the target's block tables, so its K/V lives in the blocks the scheduler gave the
  request (the lookahead slots included). It runs the target's flat batch in every step, so it has seen every
  token the target has, then drafts greedily, one pass per draft token, for the rows that asked.
- `MedusaDrafter`: Medusa heads on the target's last hidden state; head i drafts position +i, all at once.

Drafts are deterministic (greedy over the proposer's distribution), which is what the rejection sampler's
one-hot case expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.spec.config import DRAFT_MODEL, MEDUSA, SpeculativeConfig
from batchllm.executor.kv_cache import KVCache, allocate_kv_cache, kv_bytes_per_block
from batchllm.forward_context import AttentionMetadata, set_forward_context
from batchllm.model.config import ModelConfig
from batchllm.model.loader import load_model
from batchllm.model.medusa import load_medusa_heads


@dataclass(slots=True)
class LookaheadRows:
    """The rows that draft at the end of a step: each one's index among the step's sampled rows, its table row
    in `BlockTables`, the position its last new token will take when it is accepted (with no draft accepted), and
    how many drafts it wants."""

    sampled_rows: list[int]
    table_rows: list[int]
    positions: list[int]
    num_drafts: list[int]


class DraftModelDrafter:
    def __init__(self, config: SpeculativeConfig, device: torch.device, dtype: torch.dtype, load_format: str,
                 seed: int) -> None:
        self.device = device
        self.model, self.model_config = load_model(config.model, device, dtype, load_format=load_format, seed=seed)
        self.model.eval()
        self.kv_cache: KVCache | None = None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.model_config, block_size, dtype)

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        self.kv_cache = allocate_kv_cache(self.model, self.model_config, num_blocks, block_size, self.device, dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.kv_cache.copy_blocks(copies)

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Run the step's batch through the draft model, writing its K/V (no logits needed)."""
        with set_forward_context(metadata):
            self.model(input_ids, positions)

    def propose(self, rows: LookaheadRows, last_tokens: torch.Tensor, num_accepted: list[int],
                block_tables: np.ndarray, block_size: int, hidden: torch.Tensor, hidden_rows: torch.Tensor
                ) -> list[list[int]]:
        """Greedy drafts of each lookahead row after its `last_tokens` (device, one per row), which sits at
        `positions + num_accepted`."""
        positions = np.array(rows.positions, dtype=np.int64) + np.array(num_accepted, dtype=np.int64)
        tables = block_tables[np.array(rows.table_rows, dtype=np.int64)]
        remaining = np.array(rows.num_drafts, dtype=np.int64)
        active = np.arange(len(positions))
        tokens = last_tokens
        drafted = [[] for _ in positions]
        steps = []
        for _ in range(int(remaining.max())):
            metadata = _decode_metadata(positions[active], tables[active], block_size, self.device)
            with set_forward_context(metadata):
                hidden_out = self.model(tokens, torch.from_numpy(positions[active]).to(self.device))
            tokens = self.model.compute_logits(hidden_out).argmax(-1)
            steps.append((active, tokens))
            positions[active] += 1
            remaining[active] -= 1
            keep = remaining[active] > 0
            if not keep.all():
                tokens = tokens[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
                active = active[keep]
        for active, step_tokens in steps:  # one read-back per pass, after all of them are queued
            for row, token in zip(active.tolist(), step_tokens.tolist()):
                drafted[row].append(token)
        return drafted


class MedusaDrafter:
    """No K/V of its own: each head reads the hidden state that yielded the row's last token."""

    kv_cache = None

    def __init__(self, config: SpeculativeConfig, target_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, load_format: str, seed: int) -> None:
        self.heads = load_medusa_heads(config.model, target_config, device, dtype, load_format, seed)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        pass

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        pass

    def propose(self, rows: LookaheadRows, last_tokens: torch.Tensor, num_accepted: list[int],
                block_tables: np.ndarray, block_size: int, hidden: torch.Tensor, hidden_rows: torch.Tensor
                ) -> list[list[int]]:
        drafts = self.heads(hidden[hidden_rows]).tolist()  # [rows, num_heads]
        return [row[:n] for row, n in zip(drafts, rows.num_drafts)]


def build_drafter(config: SpeculativeConfig | None, target_config: ModelConfig, device: torch.device,
                  dtype: torch.dtype, load_format: str, seed: int) -> DraftModelDrafter | MedusaDrafter | None:
    if config is None or not config.on_device:
        return None
    if config.method == DRAFT_MODEL:
        return DraftModelDrafter(config, device, dtype, load_format, seed)
    if config.method == MEDUSA:
        return MedusaDrafter(config, target_config, device, dtype, load_format, seed)
    raise ValueError(f"speculative_config: method {config.method!r} is not available yet")


def _decode_metadata(positions: np.ndarray, tables: np.ndarray, block_size: int, device: torch.device
                     ) -> AttentionMetadata:
    """One query token per row at `positions`, K/V written into the row's own slot there."""
    n = len(positions)
    slots = tables[np.arange(n), positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = (positions + 1).astype(np.int32)

    def upload(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return AttentionMetadata(upload(slots), upload(np.arange(n + 1, dtype=np.int32)), upload(seq_lens),
                             upload(tables.astype(np.int32)), 1, int(seq_lens.max()), list(range(n + 1)),
                             seq_lens.tolist())
