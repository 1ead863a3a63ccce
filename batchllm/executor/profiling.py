"""Memory profiling: how many blocks the KV pool may take.

One forward pass at the full token budget (plus logits and sampling for the largest batch) measures the
activation peak; the pool gets `gpu_memory_utilization` of the card minus that peak and everything else
already resident (weights, the CUDA context, other processes).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from batchllm.config import CacheConfig, SchedulerConfig
from batchllm.distributed.parallel_state import get_pp
from batchllm.engine.kv_groups import KVGroupLayout
from batchllm.executor.input_batch import InputBatch
from batchllm.executor.kv_cache import allocate_kv_cache, kv_bytes_per_block
from batchllm.forward_context import set_forward_context
from batchllm.model.config import ModelConfig


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> np.ndarray:
    """The profiled step's sequence lengths: long sequences (each at most `max_model_len`) carry the token budget,
    the other sequences are single tokens asking for logits, so the profile sees both the largest activation and
    the largest logits tensor. They sum to the budget, unless no step can fill it."""
    lengths = np.ones(min(max_num_seqs, max_num_batched_tokens), dtype=np.int64)
    remaining = max_num_batched_tokens - len(lengths)
    for row in range(len(lengths)):
        if remaining <= 0:
            break
        lengths[row] += min(remaining, max_model_len - 1)
        remaining -= lengths[row] - 1
    return lengths


def profile_peak_memory(model: torch.nn.Module, model_config: ModelConfig, config: SchedulerConfig, block_size: int,
                        device: torch.device, dtype: torch.dtype, utilization: float) -> int:
    lengths = profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, model_config.max_model_len)
    num_blocks = int(sum(-(-int(length) // block_size) for length in lengths))
    cache = allocate_kv_cache(model, model_config, num_blocks, block_size, device, dtype)
    # Memory an earlier engine of this process freed is still reserved by the caching allocator, in segments
    # the one large KV allocation cannot reuse: hand it back first.
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step = DummyStep(model, model_config, lengths, np.zeros(len(lengths), dtype=np.int64), num_blocks, block_size,
                     device)
    step.run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del cache, step
    torch.cuda.empty_cache()

    free, total = torch.cuda.mem_get_info()
    used_by_others = total - free - torch.cuda.memory_reserved()  # CUDA context, other processes
    return max(0, int(total * utilization) - peak - used_by_others)


class DummyStep:
    """A step of placeholder tokens, staged once and run as often as asked: row i computes `lengths[i]` tokens
    after `computed[i]` cached ones, in blocks of its own (consecutive ids, wrapping past `num_blocks`), and
    yields logits for its last token, which are then sampled greedily. Profiling measures its memory,
    calibration (calibration.py) its time. A hybrid KV cache's `num_groups` groups share each row's table."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, lengths: np.ndarray, computed: np.ndarray,
                 num_blocks: int, block_size: int, device: torch.device, num_groups: int = 1) -> None:
        self.model, self.hidden_size, self.device = model, model_config.hidden_size, device
        # A later pipeline stage's input: hidden states in the activations' dtype, that of the norms' weights.
        self.dtype = next(p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16,
                                                                              torch.float32))
        num_seqs, num_tokens = len(lengths), int(lengths.sum())
        blocks = -(-(lengths + computed) // block_size)
        max_blocks = int(blocks.max())
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        first = np.concatenate(([0], np.cumsum(blocks)[:-1]))
        for row in range(num_seqs):
            tables[row, :blocks[row]] = (first[row] + np.arange(blocks[row])) % num_blocks
        self.inputs = InputBatch(num_tokens, num_seqs, max_blocks, block_size, device, num_groups)
        self.input_ids, self.positions, self.metadata, self.logits_indices = self.inputs.prepare(
            [0] * num_tokens, lengths, computed, np.tile(tables, (1, num_groups)), np.arange(num_seqs),
            np.arange(num_seqs))
        self.num_tokens = num_tokens

    def run(self) -> None:
        pp = get_pp()
        with set_forward_context(self.metadata):
            if pp.is_first:
                hidden = self.model(self.input_ids, self.positions)
            else:  # a later pipeline stage continues from the previous stage's hidden states and residual
                hidden = self.model(self.input_ids, self.positions, tuple(
                    torch.zeros(self.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                    for _ in range(2)))
        logits = None
        if pp.is_last and getattr(self.model, "score", None) is None:  # a classifier has no LM head: tiny
            logits = self.model.compute_logits(hidden[self.logits_indices])  # None on TP ranks other than 0
        if logits is not None:
            torch.softmax(logits, dim=-1).argmax(-1)  # the sampler's largest temporaries are of this size


@torch.inference_mode()
def kv_pool_blocks(model: torch.nn.Module, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                   cache_config: CacheConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   extra_bytes_per_block: int = 0, layout: KVGroupLayout | None = None) -> int:
    """How many KV blocks fit: on a GPU what profiling leaves of `gpu_memory_utilization`, on the CPU
    `kv_cache_memory_bytes` or a default share of memory. `extra_bytes_per_block`: a proposer's own K/V.
    `layout`: a hybrid KV cache's, whose block holds one group's layers."""
    per_block = kv_bytes_per_block(model_config, block_size, dtype, layout) + extra_bytes_per_block
    if device.type != "cuda":
        groups = 1 if layout is None else layout.num_groups
        return cpu_pool_blocks(cache_config, per_block, scheduler_config.max_num_seqs, model_config.max_model_len,
                               block_size, groups)
    budget = profile_peak_memory(model, model_config, scheduler_config, block_size, device, dtype,
                                 cache_config.gpu_memory_utilization)
    return _blocks_within(budget, per_block)


def cpu_pool_blocks(cache_config: CacheConfig, per_block: int, max_num_seqs: int, max_model_len: int,
                    block_size: int, groups: int = 1) -> int:
    """The CPU pool: `kv_cache_memory_bytes` as given, or the default budget (`_default_cpu_kv_bytes`) capped at
    every running sequence at full length, twice over (room for the prefix cache), in each of `groups` (a hybrid
    KV cache's): all the scheduler can use. Uncapped, a small model would get millions of blocks (seconds of pool
    bookkeeping at start). The dry run (connectors/jobs/engine_preview.py) reports the same number."""
    if cache_config.kv_cache_memory_bytes:
        return _blocks_within(cache_config.kv_cache_memory_bytes, per_block)
    useful = 2 * max_num_seqs * groups * -(-max_model_len // block_size)
    return min(_blocks_within(_default_cpu_kv_bytes(), per_block), useful)


def _blocks_within(budget: int, per_block: int) -> int:
    if budget < per_block:
        raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes, {per_block} per block)")
    return int(budget // per_block)


CPU_KV_BYTES_ENV = "BATCHLLM_CPU_KV_CACHE_BYTES"


def _default_cpu_kv_bytes() -> int:
    """`$BATCHLLM_CPU_KV_CACHE_BYTES` where set (as vLLM's CPU backend takes its KV space from the environment: a
    process that starts engines it does not configure, such as a test suite or a replica pool, can bound them all);
    otherwise a quarter of physical memory, at most 4 GiB: room for the weights and the rest of the process. The
    pool is allocated untouched, but a system that does not overcommit memory charges all of it at once."""
    value = os.environ.get(CPU_KV_BYTES_ENV)
    if value is not None:
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"{CPU_KV_BYTES_ENV}={value!r}: expected a number of bytes, an int >= 1")
        return int(value)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return min(4 << 30, total // 4)
