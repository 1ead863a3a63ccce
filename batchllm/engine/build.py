"""The composition root: an `EngineConfig` becomes a running engine.

`resolve_engine` settles what depends on the checkpoint (its path, step budget, pooling, quantization, tokenizer)
without reading a weight — `batchllm run --dry-run` stops there. `build_engine` then starts the executor and wires
KV cache manager → scheduler → executor → `EngineCore`, in `wire_core`; a disaggregated layout calls `wire_core`
once per engine (`prefill_decode_build.py`). Torch and the model layer are imported only when an engine is
built: the config and the engine layer do without them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.config import SchedulerConfig, default_step_budget
from batchllm.engine.detokenizer import Detokenizer
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.kv_groups import KVGroupLayout, plan_kv_groups, with_drafter_group
from batchllm.engine.speculative.config import MEDUSA, NGRAM
from batchllm.engine.structured.manager import StructuredOutputManager
from batchllm.engine_config import EngineConfig
from batchllm.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedEngine:
    """An `EngineConfig` checked against its checkpoint: everything an engine needs but its weights."""

    # `scheduler.max_num_batched_tokens` is final here, but where a GPU engine times its steps (`build_engine`).
    config: EngineConfig
    model_path: Path
    hf_config: dict[str, Any]
    model_config: Any  # batchllm.model.config.ModelConfig
    pooling_params: PoolingParams | None  # None when generating
    embedding_dim: int  # a pooled vector's length (0 when generating)
    kv_cache_dtype: str  # canonical: "auto" or "fp8"
    pinned_quantization: str | None  # what a job manifest pins (batchllm.model.quantization.pinned_quantization)
    tokenizer: Any  # None with skip_tokenizer_init
    eos_token_ids: frozenset[int]
    structured: StructuredOutputManager | None  # None without a tokenizer


@dataclass(slots=True)
class BuiltEngine:
    resolved: ResolvedEngine
    engine: Any  # EngineCore, or DisaggregatedEngineCore
    runner: Any  # the executor: a ModelRunner, a MultiprocExecutor group, or the disaggregated EnginePair


def resolve_engine(config: EngineConfig) -> ResolvedEngine:
    """The checks of `LLM(...)` that read the model directory (config.json, tokenizer), in its order."""
    import torch

    from batchllm.distributed.parallel_state import check_expert_parallel
    from batchllm.executor.build import check_quantization
    from batchllm.model.config import ModelConfig, architecture_of, read_hf_config
    from batchllm.model.loader import resolve_model_path
    from batchllm.model.pooling_config import pooled_dim, resolve_pooling
    from batchllm.model.quantization import check_expert_split, pinned_quantization, resolve_quantization
    from batchllm.model.registry import get_model_class
    from batchllm.model.size import model_size
    from batchllm.model.spec_checks import check_speculative_model
    from batchllm.tokenizer import load_tokenizer, resolve_eos_token_ids

    model, pooling = config.model, config.pooling
    model_path = resolve_model_path(model.model)
    hf_config = read_hf_config(model_path)
    get_model_class(architecture_of(hf_config))  # the loader's first check, made before anything heavy
    model_config = ModelConfig.from_hf_dict(hf_config)
    device = torch.device(model.device)
    if not config.step_budget_given:
        budget = default_step_budget(pooling.task, device.type, model_size(model_config).layers)
        config = config.replace(scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=budget))
    pooling_params = resolve_pooling(model_path, model_config, pooling.task, pooling.pooling, pooling.normalize)
    layout, spec = config.kv_transfer.disaggregated, config.speculative
    if pooling_params is not None and (layout is not None or spec is not None):
        raise ValueError(f"LLM argument task={pooling.task!r} does not work with "
                         f"{'disaggregated' if layout is not None else 'speculative_config'}")
    quantization = config.quantization.quantization
    kv_cache_dtype = check_quantization(model_path, quantization, config.quantization.kv_cache_dtype, device,
                                        model.load_format)
    if spec is not None:
        check_speculative_model(spec, model_path, config.parallel.tensor_parallel_size)
    parallel = config.parallel
    if parallel.enable_expert_parallel and parallel.tensor_parallel_size > 1 and model_config.moe is not None:
        check_expert_parallel(model_config.moe.num_experts, parallel.tensor_parallel_size)
    if not parallel.enable_expert_parallel and model_config.moe is not None:
        check_expert_split(resolve_quantization(hf_config, quantization), model_config.moe.moe_intermediate_size,
                           parallel.tensor_parallel_size)
    tokenizer = None if model.skip_tokenizer_init else load_tokenizer(model.tokenizer or model_path,
                                                                      trust_remote_code=model.trust_remote_code)
    eos_token_ids = resolve_eos_token_ids(model_path, tokenizer)
    structured = None if tokenizer is None else StructuredOutputManager(
        tokenizer, model_config.vocab_size, eos_token_ids, config.structured_outputs.backend)
    return ResolvedEngine(config, model_path, hf_config, model_config, pooling_params,
                          pooled_dim(model_config, pooling_params), kv_cache_dtype,
                          pinned_quantization(hf_config, quantization), tokenizer, eos_token_ids, structured)


def build_engine(config: EngineConfig) -> BuiltEngine:
    """Resolve `config`, load the model (in this process or in worker processes) and wire the engine."""
    from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
    from batchllm.engine.kv_cache_manager import KVCacheManager
    from batchllm.engine.prefill_decode_build import build_disaggregated
    from batchllm.engine.speculative.speculator import Speculator
    from batchllm.executor.build import build_executor

    resolved = resolve_engine(config)
    config = resolved.config
    runner_config = _runner_config(resolved)
    detokenizer = Detokenizer(resolved.tokenizer, resolved.eos_token_ids)
    scheduler_config = dataclasses.replace(config.scheduler)  # the engine sets max_model_len on its own copy
    layout = config.kv_transfer.disaggregated
    if layout is not None:
        engine, runner = build_disaggregated(layout, runner_config, scheduler_config, detokenizer, resolved.structured,
                                             config.async_scheduling, wire_core)
        return BuiltEngine(resolved, engine, runner)
    parallel = config.parallel
    runner = build_executor(runner_config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    scheduler_config.max_model_len = runner.max_model_len
    if runner.calibration is not None:  # the step sizes the runner chose by timing steps
        calibration = runner.calibration
        logger.info("%s", calibration.describe())
        scheduler_config.max_num_seqs = calibration.max_num_seqs or scheduler_config.max_num_seqs
        scheduler_config.max_num_batched_tokens = (calibration.max_num_batched_tokens
                                                   or scheduler_config.max_num_batched_tokens)
        chosen = dataclasses.replace(config.scheduler, max_num_seqs=scheduler_config.max_num_seqs,
                                     max_num_batched_tokens=scheduler_config.max_num_batched_tokens)
        resolved = dataclasses.replace(resolved, config=config.replace(scheduler=chosen))
    if runner_config.kv_layout is not None:
        kv_cache = HybridKVCacheManager(runner.num_blocks, config.cache.block_size, runner_config.kv_layout,
                                        config.cache.enable_prefix_caching, runner.num_host_blocks)
    else:
        kv_cache = KVCacheManager(runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                  runner.num_host_blocks)
    spec, device_type = config.speculative, runner_config.device.type
    speculator = None if spec is None else Speculator(
        spec, spec.overhead_for(device_type), runner.max_model_len, spec.verify_overhead_for(device_type),
        runner.max_verify_rows)
    engine = wire_core(scheduler_config, kv_cache, runner, detokenizer, resolved.structured, config.async_scheduling,
                       speculator, parallel.pipeline_parallel_size)
    return BuiltEngine(resolved, engine, runner)


def wire_core(scheduler_config: SchedulerConfig, kv_cache: Any, executor: Any, detokenizer: Detokenizer,
              structured: StructuredOutputManager | None, async_scheduling: bool, speculator: Any = None,
              num_micro_batches: int = 1) -> EngineCore:
    """KV cache manager → scheduler → executor → `EngineCore`: the one place an engine is put together."""
    from batchllm.engine.scheduler import Scheduler

    scheduler = Scheduler(scheduler_config, kv_cache, detokenizer.check_stop, speculator)
    return EngineCore(scheduler, executor, detokenizer, async_scheduling, structured, num_micro_batches)


def _runner_config(resolved: ResolvedEngine) -> Any:
    import torch

    from batchllm.executor.model_runner import RunnerConfig

    config, model = resolved.config, resolved.config.model
    return RunnerConfig(
        model_path=resolved.model_path, device=torch.device(model.device), dtype=getattr(torch, model.dtype),
        cache=config.cache, scheduler=config.scheduler, max_model_len=model.max_model_len, seed=model.seed,
        eos_token_ids=resolved.eos_token_ids, load_format=model.load_format, enforce_eager=model.enforce_eager,
        # Pipelined steps carry no placeholder tokens: a request's next step waits for its token (engine_core.py).
        async_scheduling=config.async_scheduling and config.parallel.pipeline_parallel_size == 1,
        max_loras=config.scheduler.max_loras, max_lora_rank=config.lora.max_lora_rank,
        quantization=config.quantization.quantization, kv_cache_dtype=resolved.kv_cache_dtype,
        speculative=config.speculative, kv_layout=hybrid_kv_layout(config, resolved.model_config),
        enable_expert_parallel=config.parallel.enable_expert_parallel, deterministic=config.deterministic,
        calibration=_calibration_plan(config))


def _calibration_plan(config: EngineConfig) -> Any:
    """What a GPU engine generating text sizes by timing its steps (executor/calibration.py): the sizes the user
    left unset. None elsewhere: the CPU, pooling tasks (no decode), disaggregated engines (their buffer between
    them is sized from the scheduler config before either starts)."""
    from batchllm.executor.calibration import BATCH_SIZES, STEP_BUDGETS, CalibrationPlan

    if (not config.model.device.startswith("cuda") or config.pooling.task != "generate"
            or config.kv_transfer.disaggregated is not None
            or (config.batch_size_given and config.step_budget_given)):
        return None
    return CalibrationPlan(batch_sizes=() if config.batch_size_given else BATCH_SIZES,
                           step_budgets=() if config.step_budget_given else STEP_BUDGETS)


def hybrid_kv_layout(config: EngineConfig, model_config: Any) -> KVGroupLayout | None:
    """The hybrid KV cache's groups (kv_groups.py) for a model with sliding-window layers; None, every block kept,
    where it is switched off. The host tier (swap space) and the P/D link work with it: each group swaps, spills and
    hands over only the blocks it holds (hybrid_kv_cache_manager.py, kv_handoff.py). A proposer with K/V of its own
    (a draft model, an EAGLE head) gets a full-attention group of its own; n-gram and Medusa have none."""
    windows = [model_config.layer_sliding_window(layer) for layer in range(model_config.num_layers)]
    if not config.cache.hybrid_kv_cache or all(window is None for window in windows):
        return None
    layout = plan_kv_groups(windows)
    spec = config.speculative
    return layout if spec is None or spec.method in (NGRAM, MEDUSA) else with_drafter_group(layout)
