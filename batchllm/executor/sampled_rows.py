"""The runner's per-request state, and a step's sampled rows: which request each logits row belongs to (a
speculating row has one per draft plus one), the rows whose sampling reads their token history, and the
device proposer's drafts after the step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.interfaces import ModelRunnerOutput
from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.drafter_base import Drafter, LookaheadRows
from batchllm.lora.request import LoRARequest
from batchllm.model.layers.sampler import SamplerOutput
from batchllm.model.layers.sampling_tensors import SamplingRow, keeps_token_history
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    params: SamplingParams
    row: int  # its row in the runner's BlockTables and SamplingTable
    # Only for requests whose sampling reads them (penalties, min_tokens; `keeps_token_history`), else empty.
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # grows by one per sampled token
    generator: torch.Generator | None = None
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None  # a pooling request: its prompt is pooled (executor/pooler.py)
    num_prompt_tokens: int = 0
    mm: MultiModalPrompt | None = None  # the prompt's images (executor/multimodal_step.py)


@dataclass(slots=True)
class SampledRows:
    """The step's sampled requests in logits order, each one's first new position, and (speculative steps)
    each one's drafts."""

    states: list[tuple[str, RequestState]]
    positions: list[int]
    drafts: list[list[int]] | None
    lookahead: LookaheadRows | None = None
    hidden: torch.Tensor | None = None  # the step's hidden states and the logits rows' indices into them
    logits_indices: torch.Tensor | None = None
    table_rows: np.ndarray | None = None  # each sampled row's BlockTables row

    def _verification_counts(self) -> np.ndarray:
        """Logits rows per sampled row: its drafts plus one (one without speculation)."""
        if self.drafts is None:
            return np.ones(len(self.states), dtype=np.int64)
        return np.array([len(d) + 1 for d in self.drafts], dtype=np.int64)

    def verification_rows(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Speculative steps: each logits row's sampled row and its offset among that row's logits rows."""
        if self.drafts is None:
            return None, None
        counts = self._verification_counts()
        owner = np.repeat(np.arange(len(counts)), counts)
        return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)

    def special_rows(self, positions: list[int], owner: np.ndarray | None, offset: np.ndarray | None
                     ) -> tuple[list[tuple[int, SamplingRow]], list[tuple[str, RequestState]]]:
        """The `SamplingRow` of each logits row at `positions` (those needing more than the table's columns),
        and the (request id, state) of the rows that keep their token history."""
        special = []
        history = {}
        for i in positions:
            r, j = (i, 0) if owner is None else (int(owner[i]), int(offset[i]))
            request_id, state = self.states[r]
            output_token_ids = state.output_token_ids
            if keeps_token_history(state.params):
                history[request_id] = state
                if j:  # the drafts before this verification row count as its output so far
                    output_token_ids = output_token_ids + self.drafts[r][:j]
            special.append((i, SamplingRow(state.params, state.prompt_token_ids, output_token_ids, state.generator,
                                           self.positions[r] + j)))
        return special, list(history.items())

    def last_accepted_index(self, sampled: SamplerOutput, device: torch.device) -> torch.Tensor:
        """A speculative step's flat token index of each sampled row's last accepted token."""
        counts = self._verification_counts()
        starts = torch.from_numpy(np.cumsum(counts) - counts).to(device)
        return self.logits_indices[starts + sampled.num_accepted.to(device)]

    def propose(self, drafter: Drafter, sampled: SamplerOutput, block_tables: np.ndarray,
                attention: AttentionMetadataBuilder, device: torch.device) -> dict[str, list[int]]:
        """The device proposer's drafts for the lookahead rows, after their last token (one sync: how many
        drafts each row accepted decides where its last token is)."""
        lookahead = self.lookahead
        counts = self._verification_counts()
        starts = np.cumsum(counts) - counts
        accepted = [0] * len(self.states) if sampled.num_accepted is None else sampled.num_accepted.tolist()
        num_accepted = [accepted[r] for r in lookahead.sampled_rows]
        last_rows = torch.from_numpy(starts[lookahead.sampled_rows] + np.array(num_accepted, dtype=np.int64))
        last_rows = last_rows.to(device)
        drafts = drafter.propose(lookahead, sampled.token_ids[last_rows], num_accepted, block_tables, attention,
                                 self.hidden, self.logits_indices[last_rows])
        return {self.states[r][0]: d for r, d in zip(lookahead.sampled_rows, drafts)}


def record_tokens(history: list[tuple[str, RequestState]], result: ModelRunnerOutput) -> None:
    for request_id, state in history:
        state.output_token_ids.extend(token.token_id for token in result.accepted.get(request_id, ()))
        state.output_token_ids.append(result.sampled[request_id].token_id)
