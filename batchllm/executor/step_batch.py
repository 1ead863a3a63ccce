"""The runner's per-request state, and a step's requests gathered from it into the flat batch's host-side lists.

`RequestStates.gather` runs for every request of every step: it appends to Python lists and converts them to
arrays once, after the loop, so the host's cost per row stays a few list appends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.engine.interfaces import NewRequestData, ScheduledRequest, SchedulerOutput
from batchllm.executor.block_table import BlockTables
from batchllm.executor.drafter_base import LookaheadRows
from batchllm.executor.multimodal_step import MultiModalRow
from batchllm.executor.pooler import PoolRow
from batchllm.executor.sampled_rows import RequestState
from batchllm.executor.sampling_table import SamplingTable
from batchllm.forward_context import AttentionMetadata
from batchllm.lora.request import LoRARequest
from batchllm.model.layers.lora import LoRABatch
from batchllm.model.layers.sampling_tensors import keeps_token_history, make_generator


@dataclass(slots=True)
class StepBatch:
    """A step's scheduled rows in the engine's order. `token_ids` is the flat batch (a placeholder's token is 0
    until `InputBatch.fill_placeholders` writes the last step's sample there); the sampled rows are the
    scheduled rows at `sample_index`, in logits order."""

    token_ids: list[int]
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    table_rows: np.ndarray  # each row's BlockTables row
    new_rows: list[bool]  # the runner saw the row's request first this step
    num_drafts: list[int]
    sample_index: np.ndarray
    sampled_states: list[tuple[str, RequestState]]
    sample_positions: list[int]  # the position of each sampled row's first new token
    drafts: list[list[int]] | None  # speculative steps: each sampled row's drafts
    lookahead: LookaheadRows | None  # device proposers: the sampled rows that draft after this step
    placeholder_slots: list[int]  # flat token index ← row of the last step's samples
    placeholder_rows: list[int]
    lora_rows: list[tuple[LoRARequest, int, int]]  # (adapter, first flat token, tokens)
    pool_rows: list[PoolRow]
    mm_rows: list[MultiModalRow]  # the rows whose tokens reach into their prompt's images
    # Multimodal RoPE: (first flat token, tokens, delta) of the rows of prompts with images (`InputBatch.prepare`).
    position_shifts: list[tuple[int, int, int]]

    @property
    def sample_counts(self) -> np.ndarray | None:
        """Speculative steps: each sampled row's logits rows, its drafts plus one."""
        return None if self.drafts is None else np.array([len(d) + 1 for d in self.drafts], dtype=np.int64)


@dataclass(slots=True)
class DeviceInputs:
    """A step's flat batch on the device (`InputBatch.prepare`) and its adapter segments (None: no adapter row).
    `graph_shape`: the captured (rows, tokens per row) it replays (None: it runs eagerly); `query_stride`: a
    verification graph's layout, every row as that many query tokens (None: packed)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    lora_batch: LoRABatch | None
    graph_shape: tuple[int, int] | None
    query_stride: int | None
    inputs_embeds: torch.Tensor | None = None  # a step with images: the embeddings the model starts from


class RequestStates:
    """Each request the runner runs: its row in the block tables and the sampling table (both indexed by it),
    its RNG and, when its sampling reads it, its token history."""

    def __init__(self, max_blocks_per_seq: int, max_num_seqs: int, device: torch.device,
                 num_kv_groups: int = 1) -> None:
        self.states: dict[str, RequestState] = {}
        self.block_tables = BlockTables(max_blocks_per_seq, 2 * max_num_seqs, num_kv_groups)
        self.sampling_table = SamplingTable(2 * max_num_seqs)
        self.device = device

    def remove(self, request_id: str) -> RequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.block_tables.remove(state.row)
        return state

    def add(self, request_id: str, new: NewRequestData) -> RequestState:
        """The state of a request the runner has not seen, or sees again after a preemption."""
        state = self.states.get(request_id)
        params = new.sampling_params
        # A preempted request keeps its RNG stream and its table row.
        generator = state.generator if state is not None else None
        if generator is None and params.seed is not None:
            generator = make_generator(params.seed, self.device)
        row = state.row if state is not None else self.block_tables.add()
        self.sampling_table.set(row, params)
        prompt, output = [], []
        if keeps_token_history(params):
            prompt, output = new.all_token_ids[:new.num_prompt_tokens], new.all_token_ids[new.num_prompt_tokens:]
        state = self.states[request_id] = RequestState(params, row, prompt, output, generator, new.lora_request,
                                                       new.pooling, new.num_prompt_tokens, new.mm)
        return state

    def gather(self, so: SchedulerOutput, last_rows: dict[str, int]) -> StepBatch:
        """The step's batch; appends the blocks each request gained to its table. `last_rows`: each request's row
        among the last step's samples, where its placeholder token is read from."""
        num_scheduled: list[int] = []
        num_computed: list[int] = []
        token_ids: list[int] = []
        block_rows: list[int] = []
        sample_rows: list[int] = []
        sampled_states: list[tuple[str, RequestState]] = []
        sample_positions: list[int] = []
        drafts_of_rows: list[list[int]] = []
        lookahead = LookaheadRows([], [], [], [])
        new_rows: list[bool] = []
        num_drafts: list[int] = []
        placeholder_slots: list[int] = []
        placeholder_rows: list[int] = []
        lora_rows: list[tuple[LoRARequest, int, int]] = []
        pool_rows: list[PoolRow] = []
        mm_rows: list[MultiModalRow] = []
        position_shifts: list[tuple[int, int, int]] = []
        states, extend = self.states, self.block_tables.extend
        speculative = so.speculative
        for i, scheduled in enumerate(so.requests):
            request_id = scheduled.request_id
            new = scheduled.new
            state = states[request_id] if new is None else self.add(request_id, new)
            row, full_table = state.row, scheduled.full_block_table
            if full_table or scheduled.block_ids:
                extend(row, scheduled.block_ids, reset=full_table)
            new_tokens, drafts, placeholder = scheduled.token_ids, scheduled.draft_token_ids, scheduled.placeholder
            num_computed_tokens = scheduled.num_computed_tokens
            num_own = len(new_tokens) + placeholder  # the row's tokens before its drafts
            if state.pooling is not None or state.lora is not None or state.mm is not None:
                _gather_extras(request_id, state, scheduled, len(token_ids), num_own, pool_rows, lora_rows, mm_rows,
                               position_shifts)
            token_ids += new_tokens
            if placeholder:
                placeholder_slots.append(len(token_ids))
                placeholder_rows.append(last_rows[request_id])
                token_ids.append(0)
            if drafts:
                token_ids += drafts
            new_rows.append(new is not None)
            num_drafts.append(len(drafts))
            num_scheduled.append(num_own + len(drafts))
            num_computed.append(num_computed_tokens)
            block_rows.append(row)
            if scheduled.sample and state.pooling is None:
                sample_rows.append(i)
                sampled_states.append((request_id, state))
                sample_positions.append(num_computed_tokens + num_own)
                if speculative:
                    drafts_of_rows.append(drafts)
                if scheduled.num_lookahead:
                    lookahead.sampled_rows.append(len(sample_rows) - 1)
                    lookahead.table_rows.append(row)
                    lookahead.positions.append(sample_positions[-1])
                    lookahead.num_drafts.append(scheduled.num_lookahead)
        return StepBatch(
            token_ids, np.array(num_scheduled, dtype=np.int64), np.array(num_computed, dtype=np.int64),
            np.array(block_rows, dtype=np.int64), new_rows, num_drafts, np.array(sample_rows, dtype=np.int64),
            sampled_states, sample_positions, drafts_of_rows if speculative else None,
            lookahead if lookahead.num_drafts else None, placeholder_slots, placeholder_rows, lora_rows, pool_rows,
            mm_rows, position_shifts)


def _gather_extras(request_id: str, state: RequestState, scheduled: ScheduledRequest, first: int, num_own: int,
                   pool_rows: list[PoolRow], lora_rows: list[tuple[LoRARequest, int, int]],
                   mm_rows: list[MultiModalRow], position_shifts: list[tuple[int, int, int]]) -> None:
    """The rarer parts of a row of `RequestStates.gather`: a pooling request's, an adapter's, a prompt's images'.
    `first`: the row's first flat token; `num_own`: its tokens before any drafts."""
    if state.pooling is not None:
        pool_rows.append(PoolRow(request_id, state.pooling, first, num_own + len(scheduled.draft_token_ids),
                                 scheduled.num_computed_tokens, state.num_prompt_tokens, scheduled.sample))
    if state.lora is not None:
        lora_rows.append((state.lora, first, num_own))
    mm = state.mm
    if mm is not None:  # only rows that reach into their images are built (decode runs every step)
        if mm.mrope_delta:
            position_shifts.append((first, num_own, mm.mrope_delta))
        if scheduled.num_computed_tokens < mm.last_image_end:
            mm_rows.append(MultiModalRow(mm, first, scheduled.num_computed_tokens, num_own))
