"""GPU memory profiling: how much of the card the KV pool may take.

One forward pass at the full token budget (plus logits and sampling for the largest batch) measures the
activation peak; the pool gets `gpu_memory_utilization` of the card minus that peak and everything else
already resident (weights, the CUDA context, other processes).
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.config import SchedulerConfig
from batchllm.executor.input_batch import InputBatch
from batchllm.executor.kv_cache import allocate_kv_cache
from batchllm.forward_context import set_forward_context
from batchllm.model.config import ModelConfig


def profile_peak_memory(model: torch.nn.Module, model_config: ModelConfig, config: SchedulerConfig, block_size: int,
                        device: torch.device, dtype: torch.dtype, utilization: float) -> int:
    num_tokens = min(config.max_num_batched_tokens, model_config.max_model_len)
    num_seqs = min(config.max_num_seqs, num_tokens)
    num_blocks = -(-num_tokens // block_size) + num_seqs
    cache = allocate_kv_cache(model, model_config, num_blocks, block_size, device, dtype)
    inputs = InputBatch(num_tokens, num_seqs, num_blocks, block_size, device)

    # One long sequence carries the token budget; the other sequences are single tokens asking for logits,
    # so the profile sees both the largest activation and the largest logits tensor.
    lengths = np.ones(num_seqs, dtype=np.int64)
    lengths[0] = num_tokens - (num_seqs - 1)
    tables = np.zeros((num_seqs, num_blocks), dtype=np.int32)
    next_block = 0
    for row, length in enumerate(lengths):
        count = -(-int(length) // block_size)
        tables[row, :count] = np.arange(next_block, next_block + count, dtype=np.int32)
        next_block += count
    # Memory an earlier engine of this process freed is still reserved by the caching allocator, in segments
    # the one large KV allocation cannot reuse: hand it back first.
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    input_ids, positions, metadata, logits_indices = inputs.prepare(
        [0] * num_tokens, lengths, np.zeros(num_seqs, dtype=np.int64), tables, np.arange(num_seqs), np.arange(num_seqs))
    with set_forward_context(metadata):
        hidden = model(input_ids, positions)
    logits = model.compute_logits(hidden[logits_indices])  # None on tensor-parallel ranks other than 0
    if logits is not None:
        torch.softmax(logits, dim=-1).argmax(-1)  # the sampler's largest temporaries are of this size
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del cache, inputs, hidden, logits
    torch.cuda.empty_cache()

    free, total = torch.cuda.mem_get_info()
    used_by_others = total - free - torch.cuda.memory_reserved()  # CUDA context, other processes
    return max(0, int(total * utilization) - peak - used_by_others)
