"""Sizing a GPU engine's steps by measurement: `max_num_seqs` and `max_num_batched_tokens` when the user gives
neither (issue 43: "W5 on an H200 and on an H100 each run at their best without flags").

The best batch is not one number. It depends on the card, the model and its quantization: a decode step costs a
fixed part (the weights read once, the launches) and a part per row (its K/V, its share of the GEMMs), and rows
pay only while the fixed part dominates. On one H200, W5 ran FP8 + FP8 KV at 11,169 output tok/s with 512
sequences against 9,823 with 256, while bf16 lost at 1,024 (benchmarks/README.md). So the runner times a few
candidate steps once, before the engine starts, and takes for each size the smallest candidate whose throughput
(tokens a second) is within `tolerance` of the best candidate's (`smallest_near_best`): a larger step costs
every row's latency, CUDA graphs and activation memory, and is worth it only while it buys throughput.

- The step budget (the prefill chunk) first, before the KV pool is sized (profiling depends on it): a step of
  prompts of `prompt_len` tokens at each of `step_budgets`, eagerly (prefill steps run eagerly), on a throwaway
  cache. A candidate the card has no memory for ends the ladder (on one GPU; under model parallelism it is an
  error, as the first candidate's is).
- Then the batch, on the real pool: a decode step of rows attending to `context` keys each, for each of
  `batch_sizes` whose K/V the pool holds at that context (always the smallest), timed eagerly, logits and greedy
  sampling included. The pool size bounds the candidates; KV-aware admission (engine/admission.py) still bounds
  the rows that actually run by each row's own length.

Eager decode times include the host's launches, which the CUDA graphs later hide: for a small model, whose eager
step is launch-bound, every candidate costs about the same and the largest wins, which is also where graphs want
it (more rows per step of host work). Under tensor or pipeline parallelism every rank times its own part and the
ranks take the smallest choice. What was measured and chosen is a `Calibration`, which the engine logs at INFO
(`batchllm.engine.build`). The CPU does not calibrate: its defaults (256 rows, 8,192 tokens) stand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchllm.distributed.parallel_state import get_pp, get_tp
from batchllm.executor.kv_cache import allocate_kv_cache, release_kv_cache
from batchllm.executor.profiling import DummyStep
from batchllm.model.config import ModelConfig

logger = logging.getLogger(__name__)

BATCH_SIZES = (128, 256, 512, 1024)
STEP_BUDGETS = (8192, 16384, 32768)


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What to time; an empty ladder leaves that size as configured (the user's)."""

    batch_sizes: tuple[int, ...] = BATCH_SIZES
    step_budgets: tuple[int, ...] = STEP_BUDGETS
    context: int = 1024  # keys each timed decode row attends to: a row halfway through 512 in / 1,024 out
    prompt_len: int = 1024  # tokens of each prompt in a timed prefill step
    batch_tolerance: float = 0.1
    budget_tolerance: float = 0.05
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "step_budgets"):
            ladder = getattr(self, name)
            if list(ladder) != sorted(set(ladder)) or any(size < 1 for size in ladder):
                raise ValueError(f"CalibrationPlan.{name} must be distinct positive sizes in increasing order, "
                                 f"got {ladder!r}")


@dataclass(frozen=True, slots=True)
class Calibration:
    """The sizes chosen (None: not calibrated) and the step times (ms) they were chosen from."""

    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    decode_ms: dict[int, float]
    prefill_ms: dict[int, float]

    def describe(self) -> str:
        parts = []
        if self.max_num_batched_tokens is not None:
            parts.append(f"max_num_batched_tokens={self.max_num_batched_tokens} (prefill step ms by tokens: "
                         f"{_times(self.prefill_ms)})")
        if self.max_num_seqs is not None:
            parts.append(f"max_num_seqs={self.max_num_seqs} (decode step ms by rows: {_times(self.decode_ms)})")
        return "calibrated " + "; ".join(parts)


def _times(step_ms: dict[int, float]) -> str:
    return ", ".join(f"{size}: {ms:.2f}" for size, ms in step_ms.items())


def smallest_near_best(step_ms: dict[int, float], tolerance: float) -> int:
    """The smallest size whose throughput (size / time) is at least (1 - tolerance) x the best size's."""
    if not step_ms:
        raise ValueError("no step was timed")
    throughput = {size: size / ms for size, ms in step_ms.items()}
    best = max(throughput.values())
    return min(size for size, rate in throughput.items() if rate >= (1 - tolerance) * best)


def sizes_the_pool_holds(batch_sizes: tuple[int, ...], pool_tokens: int, context: int) -> tuple[int, ...]:
    """The candidate batches whose rows' K/V at `context` tokens each fit in `pool_tokens`; the smallest always."""
    fitting = tuple(size for size in batch_sizes if size * context <= pool_tokens)
    return fitting or batch_sizes[:1]


def time_step(step: DummyStep, repeats: int, synchronize: Callable[[], None]) -> float:
    """Milliseconds a step takes, the median of `repeats` after two untimed runs (compilation, autotuning)."""
    for _ in range(2):
        step.run()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step.run()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def _synchronizer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


@torch.inference_mode()
def calibrate_step_budget(model: torch.nn.Module, model_config: ModelConfig, plan: CalibrationPlan, block_size: int,
                          max_model_len: int, device: torch.device, kv_dtype: torch.dtype
                          ) -> tuple[int, dict[int, float]]:
    """The prefill chunk: each budget of `plan.step_budgets` as one step of `plan.prompt_len`-token prompts, on a
    cache of its own size (freed after)."""
    prompt_len = max(1, min(plan.prompt_len, max_model_len))
    step_ms: dict[int, float] = {}
    for budget in plan.step_budgets:
        lengths = np.full(budget // prompt_len, prompt_len, dtype=np.int64)
        if budget % prompt_len:
            lengths = np.append(lengths, budget % prompt_len)
        num_blocks = int((-(-lengths // block_size)).sum())
        try:
            allocate_kv_cache(model, model_config, num_blocks, block_size, device, kv_dtype)  # the layers hold it
            step = DummyStep(model, model_config, lengths, np.zeros(len(lengths), dtype=np.int64), num_blocks,
                             block_size, device)
            step_ms[budget] = time_step(step, plan.repeats, _synchronizer(device))
            del step
        except torch.OutOfMemoryError:
            # Under model parallelism a rank that gives up alone would leave the others in a collective.
            if not step_ms or get_tp().size > 1 or get_pp().size > 1:
                raise
            logger.info("calibration: no memory for a %d-token step; the ladder ends at %d", budget, max(step_ms))
            break
        finally:
            release_kv_cache(model)  # freed before the next, larger step's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return smallest_near_best(step_ms, plan.budget_tolerance), step_ms


@torch.inference_mode()
def calibrate_batch_size(model: torch.nn.Module, model_config: ModelConfig, plan: CalibrationPlan, num_blocks: int,
                         block_size: int, num_groups: int, max_model_len: int, step_budget: int, device: torch.device
                         ) -> tuple[int, dict[int, float]]:
    """The decode batch, on the allocated pool (`num_blocks` shared by `num_groups` groups); no more rows than
    `step_budget` tokens (a decode row is a token of the step)."""
    context = max(1, min(plan.context, max_model_len - 1))
    pool_tokens = num_blocks // num_groups * block_size
    candidates = tuple(rows for rows in plan.batch_sizes if rows <= step_budget) or (step_budget,)
    step_ms: dict[int, float] = {}
    for rows in sizes_the_pool_holds(candidates, pool_tokens, context + 1):
        step = DummyStep(model, model_config, np.ones(rows, dtype=np.int64), np.full(rows, context, dtype=np.int64),
                         num_blocks, block_size, device, num_groups)
        step_ms[rows] = time_step(step, plan.repeats, _synchronizer(device))
    return smallest_near_best(step_ms, plan.batch_tolerance), step_ms
