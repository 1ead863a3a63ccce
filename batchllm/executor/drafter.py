"""Device proposers: they draft a row's next tokens at the end of the step that verified its last ones.

- `DraftModelDrafter`: a smaller model of the same vocabulary, run by the same machinery as the target: its
  own paged KV cache with the target's block tables, so its K/V lives in the blocks the scheduler gave the
  request (the lookahead slots included). It runs the target's flat batch in every step, so it has seen every
  token the target has, then drafts greedily, one pass per draft token, for the rows that asked.
- `MedusaDrafter`: Medusa heads on the target's last hidden state; head i drafts position +i, all at once.
- `EagleDrafter` (eagle_drafter.py): an EAGLE or EAGLE-3 head on the target's features, with its own paged KV.

Drafts are deterministic (greedy over the proposer's distribution), which is what the rejection sampler's
one-hot case expects.
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.engine.speculative.config import DRAFT_MODEL, EAGLE, EAGLE3, MEDUSA, SpeculativeConfig
from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.drafter_base import Drafter, LookaheadRows, ObservedStep, draft_chain
from batchllm.executor.eagle_drafter import EagleDrafter
from batchllm.executor.kv_cache import allocate_kv_cache, kv_bytes_per_block
from batchllm.forward_context import set_forward_context
from batchllm.model.config import ModelConfig
from batchllm.model.loader import load_model
from batchllm.model.medusa import load_medusa_heads


class DraftModelDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, device: torch.device, dtype: torch.dtype, load_format: str,
                 seed: int) -> None:
        self.device = device
        self.model, self.model_config = load_model(config.model, device, dtype, load_format=load_format, seed=seed)
        self.model.eval()

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.model_config, block_size, dtype)

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype, group: int = 0) -> None:
        self.kv_cache = allocate_kv_cache(self.model, self.model_config, num_blocks, block_size, self.device, dtype,
                                          group=group)

    def observe(self, step: ObservedStep, block_tables: np.ndarray, attention: AttentionMetadataBuilder) -> None:
        """Run the step's batch through the draft model, writing its K/V (no logits needed)."""
        with set_forward_context(step.metadata):
            self.model(step.input_ids, step.positions)

    def propose(self, rows: LookaheadRows, last_tokens: torch.Tensor, num_accepted: list[int],
                block_tables: np.ndarray, attention: AttentionMetadataBuilder, hidden: torch.Tensor,
                hidden_rows: torch.Tensor) -> list[list[int]]:
        positions = np.array(rows.positions, dtype=np.int64) + np.array(num_accepted, dtype=np.int64)
        tables = block_tables[np.array(rows.table_rows, dtype=np.int64)]

        def step(state: tuple[torch.Tensor, ...], positions: torch.Tensor):
            tokens = self.model.compute_logits(self.model(state[0], positions)).argmax(-1)
            return tokens, (tokens,)

        return draft_chain(positions, tables, rows.num_drafts, attention, (last_tokens,), step)


class MedusaDrafter(Drafter):
    """No K/V of its own: each head reads the hidden state that yielded the row's last token."""

    def __init__(self, config: SpeculativeConfig, target_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, load_format: str, seed: int) -> None:
        self.heads = load_medusa_heads(config.model, target_config, device, dtype, load_format, seed)

    def propose(self, rows: LookaheadRows, last_tokens: torch.Tensor, num_accepted: list[int],
                block_tables: np.ndarray, attention: AttentionMetadataBuilder, hidden: torch.Tensor,
                hidden_rows: torch.Tensor) -> list[list[int]]:
        drafts = self.heads(hidden[hidden_rows]).tolist()  # [rows, num_heads]
        return [row[:n] for row, n in zip(drafts, rows.num_drafts)]


def build_drafter(config: SpeculativeConfig | None, target: torch.nn.Module, target_config: ModelConfig,
                  device: torch.device, dtype: torch.dtype, load_format: str, seed: int) -> Drafter | None:
    if config is None or not config.on_device:
        return None
    if config.method == DRAFT_MODEL:
        return DraftModelDrafter(config, device, dtype, load_format, seed)
    if config.method == MEDUSA:
        return MedusaDrafter(config, target_config, device, dtype, load_format, seed)
    assert config.method in (EAGLE, EAGLE3)
    return EagleDrafter(config, target, target_config, device, dtype, load_format, seed)
