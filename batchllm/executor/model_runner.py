"""Runs the model for a SchedulerOutput: flat batch in, sampled tokens out.

The runner owns the weights, the paged KV cache and per-request device-side state (block table, token
history for penalties, seeded generator). `execute_model_async` launches a step and returns at once; the
sampled ids stay on the device, where the next step's placeholder tokens are read from, and reach the host
through `StepOutput` (the step's one sync, which the engine takes after launching the next step).

A step, in `execute_model_async`'s order: the finished requests leave, the KV connectors' and copy-on-write copies
run, the scheduled requests are gathered into a flat batch (step_batch.py) and uploaded, the model runs (a CUDA
graph, a pipeline stage or eagerly), the drafter sees the step, and its rows are pooled or sampled
(step_sampling.py). A decode burst runs several forward passes and samplings instead (decode_burst.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchllm.config import CacheConfig, SchedulerConfig
from batchllm.distributed.parallel_state import all_reduce_min, get_ep, get_pp, get_tp
from batchllm.engine.interfaces import AwaitingGrammar, ModelRunnerOutput, SchedulerOutput
from batchllm.engine.kv_groups import KVGroupLayout
from batchllm.engine.speculative.config import SpeculativeConfig
from batchllm.executor.calibration import Calibration, CalibrationPlan, calibrate_batch_size, calibrate_step_budget
from batchllm.executor.cuda_graphs import DecodeGraphs
from batchllm.executor.decode_burst import DecodeBurst
from batchllm.executor.drafter import build_drafter
from batchllm.executor.drafter_base import ObservedStep
from batchllm.executor.input_batch import InputBatch
from batchllm.executor.kv_cache import KVCache, allocate_kv_cache
from batchllm.executor.kv_connector import allocate_host_tier, build_kv_connector_workers
from batchllm.executor.lora_slots import LoRASlotManager
from batchllm.executor.multimodal_step import MultiModalStep
from batchllm.executor.pipeline import StageLink
from batchllm.executor.pooler import Pooler
from batchllm.executor.profiling import kv_pool_blocks
from batchllm.executor.step_batch import DeviceInputs, RequestStates, StepBatch
from batchllm.executor.step_output import HostTokenBuffers, StepOutput
from batchllm.executor.step_sampling import StepSampling
from batchllm.forward_context import set_forward_context
from batchllm.kernels import triton_enabled
from batchllm.model.layers.batch_invariant import batch_invariant_mode, make_batch_invariant
from batchllm.model.layers.lora import set_lora_batch
from batchllm.model.layers.rejection_sampler import RejectionSampler
from batchllm.model.layers.sampler import Sampler
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
    # A hybrid KV cache's groups (engine/kv_groups.py); None: one group, every block kept.
    kv_layout: KVGroupLayout | None = None
    # The MoE experts placed whole on the tensor-parallel ranks (model/layers/expert_parallel.py).
    enable_expert_parallel: bool = False
    # Batch-invariant numerics: each step runs inside `batch_invariant_mode` (model/layers/batch_invariant.py).
    deterministic: bool = False
    # The step sizes to choose by timing steps (calibration.py); None: the scheduler config's sizes stand.
    calibration: CalibrationPlan | None = None


class ModelRunner(StepSampling, DecodeBurst):
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
        plan = config.calibration
        prefill_ms: dict[int, float] = {}
        if plan is not None and plan.step_budgets:  # before anything sized by the budget: profiling, LoRA slots
            budget, prefill_ms = calibrate_step_budget(
                self.model, self.model_config, plan, self.block_size,
                config.max_model_len or self.model_config.max_model_len, device, self.kv_dtype)
            self._resize(max_num_batched_tokens=all_reduce_min(budget))
        if plan is not None and plan.batch_sizes:  # profiling sizes the logits for the largest candidate
            self._resize(max_num_seqs=plan.batch_sizes[-1])
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
        self.multimodal = (MultiModalStep(self.model, bool(self.model_config.mrope_section), device)
                           if self.model_config.vision is not None else None)
        self.rejection_sampler = RejectionSampler()
        self.eos_token_ids = config.eos_token_ids

        # Ranks may see different free memory: the pool is as large as the smallest rank can hold.
        if config.cache.num_blocks:
            num_blocks = config.cache.num_blocks
        else:
            # A draft model's or EAGLE head's K/V lives in the same blocks.
            extra = self.drafter.kv_bytes_per_block(self.block_size, self.kv_dtype) if self.drafter else 0
            num_blocks = kv_pool_blocks(self.model, self.model_config, self.scheduler_config, config.cache,
                                        self.block_size, self.kv_dtype, device, extra, config.kv_layout)
        num_blocks = all_reduce_min(num_blocks)
        layout = config.kv_layout
        self.num_kv_groups = 1 if layout is None else layout.num_groups
        self.kv_cache: KVCache = allocate_kv_cache(self.model, self.model_config, num_blocks, self.block_size,
                                                   device, self.kv_dtype, layout)
        if self.drafter is not None:
            drafter_group = None if layout is None else layout.drafter_group
            self.drafter.allocate_kv(num_blocks, self.block_size, self.kv_dtype, drafter_group or 0)
        self.num_blocks = num_blocks
        self.host_kv = allocate_host_tier(config.cache.swap_space_bytes, self.kv_cache, self.drafter, device)
        self.num_host_blocks = 0 if self.host_kv is None else self.host_kv.num_blocks
        self.host_block_bytes = 0 if self.host_kv is None else self.host_kv.bytes_per_block
        self.kv_connectors = build_kv_connector_workers(self.host_kv, config.kv_link, self.kv_cache.tensor, device)
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, num_blocks)
        decode_ms: dict[int, float] = {}
        if plan is not None and plan.batch_sizes:
            rows, decode_ms = calibrate_batch_size(self.model, self.model_config, plan, num_blocks, self.block_size,
                                                   self.num_kv_groups, self.max_model_len,
                                                   self.scheduler_config.max_num_batched_tokens, device)
            self._resize(max_num_seqs=all_reduce_min(rows))
        self.calibration = None if plan is None else Calibration(
            self.scheduler_config.max_num_seqs if plan.batch_sizes else None,
            self.scheduler_config.max_num_batched_tokens if plan.step_budgets else None, decode_ms, prefill_ms)
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.inputs = InputBatch(self.scheduler_config.max_num_batched_tokens, self.scheduler_config.max_num_seqs,
                                 max_blocks_per_seq, self.block_size, device, self.num_kv_groups)
        self.requests = RequestStates(max_blocks_per_seq, self.scheduler_config.max_num_seqs, device,
                                      self.num_kv_groups)
        self._host_tokens = HostTokenBuffers(
            self.scheduler_config.max_num_seqs * self.scheduler_config.num_decode_steps, device)
        self._share_samples = config.async_scheduling and get_tp().size > 1
        self._last_sampled, self._last_rows, self._unread = None, {}, None  # see StepSampling
        # Pipeline stages run eagerly: a decode graph replays the whole model from token ids to hidden states.
        # So do expert-parallel ranks: each MoE layer's all-to-all takes its split sizes from the host.
        use_graphs = (device.type == "cuda" and not config.enforce_eager and self.pp.size == 1
                      and get_ep().size == 1)
        if config.deterministic:  # every caller's step (execute_model, TP workers) runs batch-invariant
            make_batch_invariant(self.model)
            self.execute_model_async = _batch_invariant(self.execute_model_async)
        # The graphs record the kernels the steps run: the batch-invariant ones under the flag.
        with batch_invariant_mode() if config.deterministic else contextlib.nullcontext():
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

    def _resize(self, **sizes: int) -> None:
        self.scheduler_config = dataclasses.replace(self.scheduler_config, **sizes)

    def _resolve_max_model_len(self, requested: int | None, num_blocks: int) -> int:
        model_limit = self.model_config.max_model_len
        if requested is not None and requested > model_limit:
            raise ValueError(f"max_model_len={requested} exceeds the model's limit of {model_limit} positions")
        # Every group needs a block per block of a sequence as it is computed (window groups free theirs later).
        return min(requested or model_limit, num_blocks // self.num_kv_groups * self.block_size)

    # ----------------------------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step to the end; a constrained step must carry its `grammar` bitmask."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepOutput | AwaitingGrammar:
        """Launches the step and returns at once. A constrained step whose grammar bitmask the engine has not
        built yet returns `AwaitingGrammar`: its forward pass is queued, its sampling waits for the bitmask."""
        self._apply_finished(so.finished_request_ids)
        self._move_kv(so)
        if not so.requests:  # a step may only copy K/V (a swap-out that emptied it)
            return self._unsampled_output()
        batch = self.requests.gather(so, self._last_rows)
        if so.num_steps > 1:
            return self._execute_burst(so, batch)
        inputs = self._prepare(batch)
        hidden = self._forward(inputs)
        if hidden is None:  # a pipeline stage before the last: its activations went on to the next stage
            return self._unsampled_output()
        if self.drafter is not None:
            self._observe(so.observe_drafts, batch, inputs, hidden)
        if batch.pool_rows:
            if batch.sampled_states:
                raise RuntimeError("a step mixes pooling rows with sampled rows")  # an LLM has one task
            return self._unsampled_output(pooled=self.pooler.step(hidden, batch.pool_rows))
        if not batch.sampled_states:
            return self._unsampled_output()
        return self._sample(so, batch, hidden, inputs.logits_indices)

    def _apply_finished(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.requests.remove(request_id)
            if state is not None and state.pooling is not None:
                self.pooler.forget(request_id)

    def _move_kv(self, so: SchedulerOutput) -> None:
        """The K/V copies the scheduler decided, before the forward pass reads the blocks: each connector's
        (its metadata is what its scheduler side built for the step), then the copy-on-write copies."""
        metadata = so.kv_connector_metadata or {}
        for connector in self.kv_connectors:
            connector.wait_for_load()
            connector.start_load_kv(metadata.get(connector.name))
            connector.wait_for_save(metadata.get(connector.name))
        if so.block_copies:
            self.kv_cache.copy_blocks(so.block_copies)
            if self.drafter is not None:
                self.drafter.copy_blocks(so.block_copies)

    def _prepare(self, batch: StepBatch) -> DeviceInputs:
        """Uploads the step into the persistent input buffers, laid out as the CUDA graph it replays, if any."""
        lora_batch = self.lora.batch(batch.lora_rows) if self.lora is not None else None
        images = batch.mm_rows  # rows whose tokens reach a prompt's images
        shape = None if self.graphs is None or images else self.graphs.step_shape(
            len(batch.token_ids), batch.num_scheduled, batch.num_computed, batch.drafts is not None,
            bool(batch.lora_rows or batch.placeholder_slots), self.max_blocks_per_seq * self.block_size)
        stride = shape[1] if shape is not None and shape[1] > 1 else None  # a verification step's layout
        input_ids, positions, metadata, logits_indices = self.inputs.prepare(
            batch.token_ids, batch.num_scheduled, batch.num_computed, self.requests.block_tables.table,
            batch.table_rows, batch.sample_index, pad_to=None if shape is None else shape[0],
            sample_counts=batch.sample_counts, query_stride=stride,
            position_shifts=batch.position_shifts,
            placeholders=(batch.placeholder_slots, batch.placeholder_rows) if batch.placeholder_slots else None)
        if batch.placeholder_slots:
            self.inputs.fill_placeholders(self._last_sampled)
        inputs_embeds = None
        if images:
            inputs_embeds = self.multimodal.inputs_embeds(input_ids, images)
            host_positions = self.inputs.step.host["positions"][:len(batch.token_ids)]
            if self.multimodal.uses_mrope:
                positions = self.multimodal.positions_3d(images, host_positions)
            key_limit = self.multimodal.key_limits(images, host_positions)
            if key_limit is not None:
                metadata.set_key_limit(key_limit)
        return DeviceInputs(input_ids, positions, metadata, logits_indices, lora_batch, shape, stride, inputs_embeds)

    def _forward(self, inputs: DeviceInputs) -> torch.Tensor | None:
        """The step's hidden states: replayed from a CUDA graph, computed by this pipeline stage (None on a stage
        before the last, which hands its activations to the next), or computed eagerly."""
        if inputs.graph_shape is not None and self.graphs is not None:
            return self.graphs.replay(*inputs.graph_shape)
        if self.stage_link is not None:
            previous = None if self.pp.is_first else self.stage_link.receive(inputs.input_ids.shape[0])
            with set_forward_context(inputs.metadata):
                hidden = self.model(inputs.input_ids, inputs.positions, previous)
            if self.pp.is_last:
                return hidden
            self.stage_link.send(*hidden)
            return None
        with set_forward_context(inputs.metadata), set_lora_batch(inputs.lora_batch):
            if inputs.inputs_embeds is not None:
                return self.model(inputs.input_ids, inputs.positions, inputs_embeds=inputs.inputs_embeds)
            return self.model(inputs.input_ids, inputs.positions)

    def _observe(self, observe_drafts: bool, batch: StepBatch, inputs: DeviceInputs, hidden: torch.Tensor) -> None:
        """The drafter sees the step as the target ran it, or learns that it does not (speculation is off)."""
        if not observe_drafts:
            self.drafter.skip(batch.table_rows)
            return
        stride, num_scheduled = inputs.query_stride, batch.num_scheduled
        num_seqs = len(num_scheduled)
        query_start = np.cumsum(num_scheduled) - num_scheduled if stride is None else np.arange(num_seqs) * stride
        num_tokens = len(batch.token_ids) if stride is None else num_seqs * stride
        self.drafter.observe(
            ObservedStep(inputs.input_ids, inputs.positions, inputs.metadata, hidden, self.model.model.aux_hidden,
                         num_tokens, query_start, num_scheduled, batch.num_computed, batch.table_rows,
                         np.array(batch.new_rows), np.array(batch.num_drafts, dtype=np.int64)),
            self.requests.block_tables.table, self.inputs.attention)


def _batch_invariant(execute_model_async):
    """`execute_model_async` run inside `batch_invariant_mode` (a step's forward pass and its sampling)."""

    def run(so: SchedulerOutput) -> StepOutput | AwaitingGrammar:
        with batch_invariant_mode():
            return execute_model_async(so)

    return run
