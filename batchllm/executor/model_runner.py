"""Runs the model for a SchedulerOutput: flat batch in, sampled tokens out.

The runner owns the weights, the paged KV cache and per-request device-side state (block table, token
history for penalties, seeded generator). `execute_model_async` launches a step and returns at once; the
sampled ids stay on the device, where the next step's placeholder tokens are read from, and reach the host
through `StepOutput` (the step's one sync, which the engine takes after launching the next step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchllm.config import CacheConfig, SchedulerConfig
from batchllm.distributed.parallel_state import all_reduce_min, broadcast_from_driver, get_pp, get_tp
from batchllm.engine.interfaces import (
    AwaitingGrammar,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from batchllm.engine.speculative.config import SpeculativeConfig
from batchllm.executor.block_table import BlockTables
from batchllm.executor.cuda_graphs import DecodeGraphs
from batchllm.executor.drafter import build_drafter
from batchllm.executor.drafter_base import LookaheadRows, ObservedStep
from batchllm.executor.input_batch import InputBatch
from batchllm.executor.kv_cache import KVCache, allocate_kv_cache
from batchllm.executor.kv_connector import allocate_host_tier, build_kv_connector_workers
from batchllm.executor.lora_slots import LoRASlotManager
from batchllm.executor.pipeline import StageLink
from batchllm.executor.pooler import Pooler, PoolRow
from batchllm.executor.profiling import kv_pool_blocks
from batchllm.executor.sampled_rows import RequestState, SampledRows, record_tokens
from batchllm.executor.sampling_table import SamplingTable
from batchllm.executor.step_output import HostTokenBuffers, StepOutput
from batchllm.forward_context import set_forward_context
from batchllm.kernels import triton_enabled
from batchllm.lora.request import LoRARequest
from batchllm.model.layers.lora import set_lora_batch
from batchllm.model.layers.rejection_sampler import DraftBatch, RejectionSampler
from batchllm.model.layers.sampler import Sampler, SamplerOutput
from batchllm.model.layers.sampling_tensors import SamplingTensors, keeps_token_history, make_generator
from batchllm.model.loader import load_model
from batchllm.model.quantization.fp8 import FP8_DTYPE


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Everything needed to build a `ModelRunner`; picklable, so a tensor-parallel worker can build its own."""

    model_path: Path
    device: torch.device
    dtype: torch.dtype
    cache: CacheConfig
    scheduler: SchedulerConfig
    max_model_len: int | None
    seed: int
    eos_token_ids: frozenset[int]
    load_format: str = "auto"
    enforce_eager: bool = False
    # Steps may carry placeholder tokens (the previous step's samples): every rank needs rank 0's samples.
    async_scheduling: bool = False
    max_loras: int = 0  # adapter slots on the device; 0: no LoRA
    max_lora_rank: int = 16
    quantization: str | None = None  # "fp8"; a quantized checkpoint is detected from its config.json
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8"
    speculative: SpeculativeConfig | None = None
    # Disaggregated prefill / decode: the buffer shared with the other engine (a file), and its blocks.
    kv_link: tuple[Path, int] | None = None


class ModelRunner:
    """Runs the model on one device. Under tensor parallelism every rank has one, fed the same
    `SchedulerOutput`; each holds its shard of the weights and of the KV heads, and only rank 0 samples. Under
    pipeline parallelism each stage holds its layers (and their KV), takes the previous stage's activations and
    hands its own to the next; the last stage samples."""

    def __init__(self, config: RunnerConfig) -> None:
        torch.manual_seed(config.seed)
        device = self.device = config.device
        self.dtype = config.dtype
        self.kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else self.dtype
        self.block_size = config.cache.block_size
        self.scheduler_config = config.scheduler
        if device.type == "cuda":
            # An earlier engine's freed KV pool is still cached; weights placed in that segment would pin all of
            # it, and this pool, sized by profiling, would then find no room.
            torch.cuda.empty_cache()
        self.model, self.model_config = load_model(config.model_path, device, self.dtype,
                                                   load_format=config.load_format, seed=config.seed,
                                                   quantization=config.quantization)
        self.model.eval()
        self.pp = get_pp()
        self.stage_link = StageLink(self.model_config.hidden_size, self.dtype, device) if self.pp.size > 1 else None
        # Adapter slots are allocated before the KV pool is sized from what memory is left.
        self.lora = (LoRASlotManager(self.model, self.model_config, config.max_loras, config.max_lora_rank,
                                     self.scheduler_config.max_num_batched_tokens, device, self.dtype)
                     if config.max_loras else None)
        self.speculative = config.speculative
        self.drafter = build_drafter(config.speculative, self.model, self.model_config, device, self.dtype,
                                     config.load_format, config.seed)
        self.sampler = Sampler()
        self.pooler = Pooler(getattr(self.model, "score", None), device)
        self.rejection_sampler = RejectionSampler()
        self.eos_token_ids = config.eos_token_ids

        # Ranks may see different free memory: the pool is as large as the smallest rank can hold.
        if config.cache.num_blocks:
            num_blocks = config.cache.num_blocks
        else:
            # A draft model's or EAGLE head's K/V lives in the same blocks.
            extra = self.drafter.kv_bytes_per_block(self.block_size, self.kv_dtype) if self.drafter else 0
            num_blocks = kv_pool_blocks(self.model, self.model_config, self.scheduler_config, config.cache,
                                        self.block_size, self.kv_dtype, device, extra)
        num_blocks = all_reduce_min(num_blocks)
        self.kv_cache: KVCache = allocate_kv_cache(self.model, self.model_config, num_blocks, self.block_size,
                                                   device, self.kv_dtype)
        if self.drafter is not None:
            self.drafter.allocate_kv(num_blocks, self.block_size, self.kv_dtype)
        self.num_blocks = num_blocks
        self.host_kv = allocate_host_tier(config.cache.swap_space_bytes, self.kv_cache, self.drafter, device)
        self.num_host_blocks = 0 if self.host_kv is None else self.host_kv.num_blocks
        self.host_block_bytes = 0 if self.host_kv is None else self.host_kv.bytes_per_block
        self.kv_connectors = build_kv_connector_workers(self.host_kv, config.kv_link, self.kv_cache.tensor, device)
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, num_blocks)
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.inputs = InputBatch(self.scheduler_config.max_num_batched_tokens, self.scheduler_config.max_num_seqs,
                                 max_blocks_per_seq, self.block_size, device)
        self._states: dict[str, RequestState] = {}
        self._block_tables = BlockTables(max_blocks_per_seq, 2 * self.scheduler_config.max_num_seqs)
        self._sampling_table = SamplingTable(2 * self.scheduler_config.max_num_seqs)
        self._host_tokens = HostTokenBuffers(self.scheduler_config.max_num_seqs, device)
        self._share_samples = config.async_scheduling and get_tp().size > 1
        # The last step's sampled ids on the device, and the row of each request in it.
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self._unread: StepOutput | None = None  # the newest step whose tokens the host has not read yet
        # Pipeline stages run eagerly: a decode graph replays the whole model from token ids to hidden states.
        use_graphs = device.type == "cuda" and not config.enforce_eager and self.pp.size == 1
        self.graphs = self._capture_graphs() if use_graphs else None
        # Past this many rows a verification step runs eagerly, at a cost no draft repays (None: every step is eager).
        self.max_verify_rows = None if self.graphs is None else self.graphs.max_verify_rows

    @torch.inference_mode()
    def _capture_graphs(self) -> DecodeGraphs | None:
        if not triton_enabled():
            return None  # the reference KV write syncs with the host: it cannot be captured
        # Verification graphs: not with adapters, whose segments index the packed layout.
        spec = self.speculative
        max_query_len = 1 if spec is None or self.lora is not None else 1 + spec.num_speculative_tokens
        return DecodeGraphs(self.model, self.inputs, self.scheduler_config.max_num_seqs, self.max_model_len,
                            None if self.lora is None else self.lora.step_batch, max_query_len)

    def _resolve_max_model_len(self, requested: int | None, num_blocks: int) -> int:
        model_limit = self.model_config.max_model_len
        if requested is not None and requested > model_limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's limit of {model_limit} positions")
        return min(requested or model_limit, num_blocks * self.block_size)

    # ----------------------------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step to the end; a constrained step must carry its `grammar` bitmask."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepOutput | AwaitingGrammar:
        for request_id in so.finished_request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                self._block_tables.remove(state.row)
                if state.pooling is not None:
                    self.pooler.forget(request_id)
        metadata = so.kv_connector_metadata or {}
        for connector in self.kv_connectors:
            connector.wait_for_load()
            connector.start_load_kv(metadata.get(connector.name))
            connector.wait_for_save(metadata.get(connector.name))
        if so.block_copies:
            self.kv_cache.copy_blocks(so.block_copies)
            if self.drafter is not None:
                self.drafter.copy_blocks(so.block_copies)
        if not so.requests:  # a step may only copy K/V (a swap-out that emptied it)
            return StepOutput([], None, self._host_tokens.take(), _ignore)

        # Runs for every request of every step: Python lists here, one conversion to arrays after the loop.
        num_scheduled: list[int] = []
        num_computed: list[int] = []
        token_ids: list[int] = []
        block_rows: list[int] = []
        sample_rows: list[int] = []
        sampled_states: list[tuple[str, RequestState]] = []
        sample_positions: list[int] = []  # the position of each sampled row's first new token
        drafts: list[list[int]] = []  # speculative steps: each sampled row's drafts
        lookahead = LookaheadRows([], [], [], [])  # device proposers: the rows that draft after this step
        new_rows: list[bool] = []
        num_drafts: list[int] = []
        placeholder_slots: list[int] = []  # flat token index ← row of the last step's samples
        placeholder_rows: list[int] = []
        lora_rows: list[tuple[LoRARequest, int, int]] = []  # (adapter, first flat token, tokens)
        pool_rows: list[PoolRow] = []
        states, block_tables, last_rows = self._states, self._block_tables, self._last_rows
        for i, scheduled in enumerate(so.requests):
            request_id = scheduled.request_id
            state = states[request_id] if scheduled.new is None else self._add_state(request_id, scheduled.new)
            if scheduled.block_ids or scheduled.full_block_table:
                block_tables.extend(state.row, scheduled.block_ids, reset=scheduled.full_block_table)
            new_tokens = scheduled.token_ids
            if state.pooling is not None:
                pool_rows.append(PoolRow(request_id, state.pooling, len(token_ids), scheduled.num_tokens,
                                         scheduled.num_computed_tokens, state.num_prompt_tokens, scheduled.sample))
            if state.lora is not None:
                lora_rows.append((state.lora, len(token_ids), len(new_tokens) + scheduled.placeholder))
            token_ids += new_tokens
            if scheduled.placeholder:
                placeholder_slots.append(len(token_ids))
                placeholder_rows.append(last_rows[request_id])
                token_ids.append(0)
            token_ids += scheduled.draft_token_ids
            new_rows.append(scheduled.new is not None)
            num_drafts.append(len(scheduled.draft_token_ids))
            num_scheduled.append(scheduled.num_tokens)
            num_computed.append(scheduled.num_computed_tokens)
            block_rows.append(state.row)
            if scheduled.sample and state.pooling is None:
                sample_rows.append(i)
                sampled_states.append((request_id, state))
                sample_positions.append(scheduled.num_computed_tokens + scheduled.num_tokens
                                        - len(scheduled.draft_token_ids))
                if so.speculative:
                    drafts.append(scheduled.draft_token_ids)
                if scheduled.num_lookahead:
                    lookahead.sampled_rows.append(len(sample_rows) - 1)
                    lookahead.table_rows.append(state.row)
                    lookahead.positions.append(sample_positions[-1])
                    lookahead.num_drafts.append(scheduled.num_lookahead)
        num_seqs = len(num_scheduled)

        lora_batch = self.lora.batch(lora_rows) if self.lora is not None else None
        block_rows = np.array(block_rows, dtype=np.int64)
        sample_index = np.array(sample_rows, dtype=np.int64)
        sample_counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64) if so.speculative else None
        num_scheduled, num_computed = np.array(num_scheduled, dtype=np.int64), np.array(num_computed, dtype=np.int64)
        shape = None if self.graphs is None else self.graphs.step_shape(
            len(token_ids), num_scheduled, num_computed, so.speculative, bool(lora_rows or placeholder_slots),
            self.max_blocks_per_seq * self.block_size)
        stride = shape[1] if shape is not None and shape[1] > 1 else None  # a verification step's layout
        input_ids, positions, metadata, logits_indices = self.inputs.prepare(
            token_ids, num_scheduled, num_computed, self._block_tables.table, block_rows, sample_index,
            pad_to=None if shape is None else shape[0], sample_counts=sample_counts, query_stride=stride)
        if placeholder_slots:
            self.inputs.fill_placeholders(placeholder_slots, placeholder_rows, self._last_sampled)
        if shape is not None and self.graphs is not None:
            hidden = self.graphs.replay(*shape)
        elif self.stage_link is not None:
            previous = None if self.pp.is_first else self.stage_link.receive(input_ids.shape[0])
            with set_forward_context(metadata):
                hidden = self.model(input_ids, positions, previous)
            if not self.pp.is_last:
                self.stage_link.send(*hidden)
                return StepOutput([], None, self._host_tokens.take(), _ignore)
        else:
            with set_forward_context(metadata), set_lora_batch(lora_batch):
                hidden = self.model(input_ids, positions)
        query_start = np.cumsum(num_scheduled) - num_scheduled if stride is None else np.arange(num_seqs) * stride
        num_tokens = len(token_ids) if stride is None else num_seqs * stride
        if self.drafter is not None and not so.observe_drafts:
            self.drafter.skip(block_rows)
        elif self.drafter is not None:
            self.drafter.observe(
                ObservedStep(input_ids, positions, metadata, hidden, self.model.model.aux_hidden, num_tokens,
                             query_start, num_scheduled, num_computed, block_rows, np.array(new_rows),
                             np.array(num_drafts, dtype=np.int64)),
                self._block_tables.table, self.inputs.attention)
        if pool_rows:
            if sampled_states:
                raise RuntimeError("a step mixes pooling rows with sampled rows")  # an LLM has one task
            return StepOutput([], None, self._host_tokens.take(), _ignore, pooled=self.pooler.step(hidden, pool_rows))
        if not sampled_states:
            return StepOutput([], None, self._host_tokens.take(), _ignore)
        logits = self.model.compute_logits(hidden[logits_indices])
        rows = SampledRows(sampled_states, sample_positions, drafts if so.speculative else None,
                           lookahead if lookahead.num_drafts else None, hidden, logits_indices,
                           block_rows[sample_index])
        # The step's sampling tensors are built now, while the forward pass runs, even when the sampling itself
        # must wait for a grammar bitmask: only the bitmask's upload is left for then.
        tensors, history = (None, []) if logits is None else self._sampling_tensors(logits, rows,
                                                                                    block_rows[sample_index])
        if so.grammar_request_ids and so.grammar is None:
            # The forward pass is queued on the device; sample once the engine has the bitmask.
            return AwaitingGrammar(lambda grammar: self._sample_step(logits, rows, tensors, history, grammar))
        return self._sample_step(logits, rows, tensors, history, so.grammar)

    @torch.inference_mode()
    def _sample_step(self, logits: torch.Tensor | None, rows: SampledRows, tensors: SamplingTensors | None,
                     history: list[tuple[str, RequestState]], grammar: GrammarBitmask | None) -> StepOutput:
        """`tensors` is None on tensor-parallel ranks other than 0 (no logits); `history` holds the rows whose
        sampled tokens the runner must remember."""
        request_ids = [request_id for request_id, _ in rows.states]
        sampled = None  # stays None on tensor-parallel ranks other than 0
        if logits is not None:
            if grammar is not None:
                row_of = {request_id: row for row, request_id in enumerate(request_ids)}
                tensors.add_grammar([row_of[request_id] for request_id in grammar.request_ids], grammar.bitmask,
                                    self.device)
            if rows.drafts is None:
                sampled = self.sampler(logits, tensors)
            else:
                sampled = self.rejection_sampler(logits, tensors, DraftBatch.build(rows.drafts, self.device))
        proposals = {}
        if self.drafter is not None and sampled is not None:
            if rows.drafts is not None:
                self.drafter.accepted(rows.table_rows, rows.last_accepted_index(sampled, self.device))
            if rows.lookahead is not None:
                proposals = self._propose(rows, sampled)
        if rows.drafts is not None:
            # Speculative steps are applied before the next is scheduled: it holds no placeholder.
            self._last_sampled, self._last_rows = None, {}
        elif self._share_samples:
            ids = sampled.token_ids if sampled is not None else torch.empty(len(request_ids), dtype=torch.int64,
                                                                             device=self.device)
            self._last_sampled = broadcast_from_driver(ids)
        elif sampled is not None:
            self._last_sampled = sampled.token_ids
        if rows.drafts is None:
            self._last_rows = {request_id: row for row, request_id in enumerate(request_ids)}
        output = StepOutput(request_ids, sampled, self._host_tokens.take(),
                            (lambda result: record_tokens(history, result)) if history else _ignore, rows.drafts,
                            proposals)
        if sampled is not None:
            self._unread = output
        return output

    def _propose(self, rows: SampledRows, sampled: SamplerOutput) -> dict[str, list[int]]:
        return rows.propose(self.drafter, sampled, self._block_tables.table, self.inputs.attention, self.device)

    def _add_state(self, request_id: str, new: NewRequestData) -> RequestState:
        """The state of a request the runner has not seen, or sees again after a preemption."""
        state = self._states.get(request_id)
        params = new.sampling_params
        # A preempted request keeps its RNG stream and its table row.
        generator = state.generator if state is not None else None
        if generator is None and params.seed is not None:
            generator = make_generator(params.seed, self.device)
        row = state.row if state is not None else self._block_tables.add()
        self._sampling_table.set(row, params)
        prompt, output = [], []
        if keeps_token_history(params):
            prompt, output = new.all_token_ids[:new.num_prompt_tokens], new.all_token_ids[new.num_prompt_tokens:]
        state = self._states[request_id] = RequestState(params, row, prompt, output, generator, new.lora_request,
                                                        new.pooling, new.num_prompt_tokens)
        return state

    def _sampling_tensors(self, logits: torch.Tensor, rows: SampledRows, table_rows: np.ndarray,
                          ) -> tuple[SamplingTensors, list[tuple[str, RequestState]]]:
        """The sampling tensors of the step's logits rows (`table_rows[i]`: the SamplingTable row of sampled row
        i; a speculating row has one logits row per draft plus one), and the (request id, state) of the rows that
        keep their token history."""
        owner, offset = rows.verification_rows()
        if owner is not None:
            table_rows = table_rows[owner]
        columns, special_positions, any_history = self._sampling_table.gather(table_rows)
        if self._unread is not None and any_history:
            # Penalties and min_tokens read each row's output so far: the last step's tokens must be in.
            self._unread.result()
        self._unread = None
        special, history = rows.special_rows(special_positions.tolist(), owner, offset)
        tensors = SamplingTensors.from_columns(columns, special, logits.shape[-1], self.device, self.eos_token_ids)
        return tensors, history


def _ignore(result: ModelRunnerOutput) -> None:
    pass
