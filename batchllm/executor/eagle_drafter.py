"""The EAGLE / EAGLE-3 proposer: a head on the target's features, with its own paged KV in the target's blocks.

The head's entry at position p reads the token at p + 1 and the target's feature at p (see
`batchllm.model.eagle`). So that every entry can be written from what a step already holds, the head runs one
position behind the target: a step that computes the target's positions c..c+n-1 writes the head's entries
c-1..c+n-2, pairing each token with the feature of the token before it; for the first one, c-1, that is the
feature the row's previous step left (`_last_features`). A row the runner sees first (a new request, or one
back from preemption) starts one token later. Entries written for drafts that are then rejected are rewritten
before they are read: the draft pass at the last accepted position rewrites its own, and later ones are
written again when the target recomputes their positions.

Drafting at the end of a step starts at the position of the last accepted token's feature with the newly
sampled token, then feeds the head its own output feature for each further draft. The drafts are never
trusted: the rejection sampler verifies them, so a stale entry can only lower acceptance. (One can be: a row
that starts from prefix-cached blocks reads the head's entries there as the earlier request left them, and the
last entry of such a block was not written if that request had stopped right after filling it.)
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.engine.speculative.config import EAGLE3, SpeculativeConfig
from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.drafter_base import Drafter, LookaheadRows, ObservedStep, draft_chain
from batchllm.executor.kv_cache import allocate_kv_cache, kv_bytes_per_block
from batchllm.forward_context import set_forward_context
from batchllm.model.config import ModelConfig
from batchllm.model.eagle import eagle3_aux_layers, load_eagle_head


class EagleDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, target: torch.nn.Module, target_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, load_format: str, seed: int) -> None:
        self.device = device
        self.head = load_eagle_head(config.model, config.method, target_config, device, dtype, load_format, seed)
        self.head.share_target(target)
        if config.method == EAGLE3:
            target.model.aux_layers = eagle3_aux_layers(target_config.num_layers)
        self._features: torch.Tensor | None = None  # the last step's target features, one per flat token
        self._last_features: torch.Tensor | None = None  # per BlockTables row: its last accepted token's feature
        self._stale_rows: set[int] = set()  # rows whose last step was skipped: no saved feature
        self.dtype = dtype

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.head.config, block_size, dtype)

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype, group: int = 0) -> None:
        self.kv_cache = allocate_kv_cache(self.head, self.head.config, num_blocks, block_size, self.device, dtype,
                                          group=group)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def _row_features(self, num_rows: int) -> torch.Tensor:
        if self._last_features is None or len(self._last_features) < num_rows:
            grown = torch.zeros(max(num_rows, 64), self.head.config.hidden_size, dtype=self.dtype,
                                device=self.device)
            if self._last_features is not None:
                grown[:len(self._last_features)] = self._last_features
            self._last_features = grown
        return self._last_features

    @torch.inference_mode()
    def observe(self, step: ObservedStep, block_tables: np.ndarray, attention: AttentionMetadataBuilder) -> None:
        n = step.num_tokens
        aux = None if step.aux_hidden is None else step.aux_hidden[:n]
        features = self._features = self.head.features(step.hidden[:n], aux)
        last_features = self._row_features(int(step.table_rows.max()) + 1)
        # Per row: its tokens from the second on (from the first when its previous feature is known).
        new_rows = step.new_rows
        if self._stale_rows:
            new_rows = new_rows | np.isin(step.table_rows, list(self._stale_rows))
            self._stale_rows.difference_update(step.table_rows.tolist())
        skip = new_rows.astype(np.int64)
        query_lens = step.num_scheduled - skip
        keep = query_lens > 0
        if keep.any():
            starts, lens = step.query_start[keep] + skip[keep], query_lens[keep]
            # Flat token indices of those runs, and each one's row.
            token_index = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
            owner = np.repeat(np.flatnonzero(keep), lens)
            positions = step.num_computed[owner] + (token_index - step.query_start[owner]) - 1
            tables = block_tables[step.table_rows[keep]]
            seq_lens = step.num_computed[keep] + step.num_scheduled[keep] - 1
            metadata = attention.for_rows(positions, lens, seq_lens, tables)
            # The feature of the token before: the previous flat token, or (a row's first token) the saved one.
            inputs = features[self._upload(token_index - 1)]
            first = np.flatnonzero(token_index == step.query_start[owner])
            if len(first):
                inputs[self._upload(first)] = last_features[self._upload(step.table_rows[owner[first]])]
            with set_forward_context(metadata):
                self.head(step.input_ids[self._upload(token_index)], self._upload(positions), inputs)
        # Each row's last token before its drafts: a speculative step moves it past the accepted ones later.
        last = step.query_start + step.num_scheduled - 1 - step.num_drafts
        last_features[self._upload(step.table_rows)] = features[self._upload(last)]

    def skip(self, table_rows: np.ndarray) -> None:
        self._stale_rows.update(table_rows.tolist())

    @torch.inference_mode()
    def accepted(self, table_rows: np.ndarray, last_index: torch.Tensor) -> None:
        self._last_features[self._upload(table_rows)] = self._features[last_index]

    @torch.inference_mode()
    def propose(self, rows: LookaheadRows, last_tokens: torch.Tensor, num_accepted: list[int],
                block_tables: np.ndarray, attention: AttentionMetadataBuilder, hidden: torch.Tensor,
                hidden_rows: torch.Tensor) -> list[list[int]]:
        # The first pass is the head's entry at the last accepted token's position, reading the new token.
        positions = np.array(rows.positions, dtype=np.int64) + np.array(num_accepted, dtype=np.int64) - 1
        tables = block_tables[np.array(rows.table_rows, dtype=np.int64)]

        def step(state: tuple[torch.Tensor, ...], positions: torch.Tensor):
            features = self.head(state[0], positions, state[1])
            tokens = self.head.draft(features)
            return tokens, (tokens, features)

        return draft_chain(positions, tables, rows.num_drafts, attention, (last_tokens, self._features[hidden_rows]),
                           step)
