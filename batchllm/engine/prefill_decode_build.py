"""Building a disaggregated prefill / decode engine (`LLM(model, disaggregated={"prefill": 1, "decode": 1})`).

Two engines of the same model, each in a worker process of its own: on two GPUs, the first for prefill and the
second for decode; on one GPU, both on it (the prefill engine takes half of `gpu_memory_utilization`, the decode
engine what is left of it); on the CPU, two processes sharing the cores. They share a buffer of K/V blocks in
shared memory (pinned on a GPU), through which each prompt's K/V goes from one to the other
(engine/kv_handoff.py). The engine loop is engine/prefill_decode_core.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from batchllm.config import SchedulerConfig
from batchllm.engine.block_pool import BlockPool
from batchllm.engine.detokenizer import Detokenizer
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.kv_handoff import (
    DecodeKVCacheManager,
    HybridDecodeKVCacheManager,
    HybridPrefillKVCacheManager,
    PrefillKVCacheManager,
)
from batchllm.engine.prefill_decode_core import DisaggregatedEngineCore
from batchllm.engine.structured.manager import StructuredOutputManager


@dataclass(frozen=True, slots=True)
class Layout:
    prefill: int = 1  # GPUs (processes) of the prefill engine
    decode: int = 1
    buffer_blocks: int | None = None  # K/V blocks of the shared buffer; None: a step's budget plus a block a row


def parse_layout(value: Any) -> Layout | None:
    name = "LLM argument disaggregated"
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"prefill", "decode", "buffer_blocks"}:
        raise ValueError(f"{name} must be a dict with the keys 'prefill', 'decode' (and 'buffer_blocks'), "
                         f"got {value!r}")
    layout = Layout(**value)
    if (layout.prefill, layout.decode) != (1, 1):
        raise ValueError(f'{name} supports {{"prefill": 1, "decode": 1}} (one engine each), got {value!r}')
    blocks = layout.buffer_blocks
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1):
        raise ValueError(f"{name}['buffer_blocks'] must be an int >= 1, got {blocks!r}")
    return layout


class EnginePair:
    """The two executors, seen by `LLM` as its runner: the decode engine's figures, both engines' processes."""

    def __init__(self, prefill: Any, decode: Any) -> None:
        self.prefill, self.decode = prefill, decode
        self.block_size, self.max_model_len = decode.block_size, min(prefill.max_model_len, decode.max_model_len)
        self.num_blocks, self.host_block_bytes = decode.num_blocks, decode.host_block_bytes

    @property
    def worker_pids(self) -> list[int]:
        return self.prefill.worker_pids + self.decode.worker_pids

    def shutdown(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def build_disaggregated(layout: Layout, runner_config: Any, scheduler_config: SchedulerConfig,
                        detokenizer: Detokenizer, structured: StructuredOutputManager | None,
                        async_scheduling: bool, wire_core: Callable[..., EngineCore]
                        ) -> tuple[DisaggregatedEngineCore, EnginePair]:
    """Both executors, each engine wired by `wire_core` (batchllm/engine/build.py) with its side's KV manager."""
    import torch

    from batchllm.distributed.shm_queue import create_shared_file
    from batchllm.executor.kv_cache import kv_bytes_per_block
    from batchllm.executor.multiproc_executor import MultiprocExecutor
    from batchllm.model.config import ModelConfig, read_hf_config
    from batchllm.model.quantization.fp8 import FP8_DTYPE

    config = runner_config
    model = ModelConfig.from_hf_dict(read_hf_config(config.model_path))
    kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else config.dtype
    block_size = config.cache.block_size
    num_slots = layout.buffer_blocks or (-(-scheduler_config.max_num_batched_tokens // block_size)
                                         + scheduler_config.max_num_seqs)
    # A hybrid KV cache's block is one group's layers (engine/kv_groups.py): so is a slot of the buffer.
    layout = config.kv_layout
    buffer = Path(create_shared_file(num_slots * kv_bytes_per_block(model, block_size, kv_dtype, layout),
                                     "batchllm-kv-link-"))
    try:
        devices = [config.device, config.device]
        utilization = config.cache.gpu_memory_utilization
        prefill_cache = config.cache
        if config.device.type == "cuda":
            if torch.cuda.device_count() >= 2:
                devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
            else:  # one GPU: the prefill engine starts first and takes half; the decode engine what is left
                devices = [torch.device("cuda", 0)] * 2
                prefill_cache = dataclasses.replace(config.cache, gpu_memory_utilization=utilization / 2)
        threads = max(1, torch.get_num_threads() // 2)
        prefill = MultiprocExecutor(dataclasses.replace(config, device=devices[0], cache=prefill_cache,
                                                        kv_link=(buffer, num_slots)), 1, threads,
                                    label="prefill engine")
        decode = MultiprocExecutor(dataclasses.replace(config, device=devices[1], kv_link=(buffer, num_slots)), 1,
                                   threads, label="decode engine")
    finally:
        buffer.unlink()  # mapped by both workers by now (or never to be)
    pair = EnginePair(prefill, decode)
    scheduler_config.max_model_len = pair.max_model_len
    link = BlockPool(num_slots)
    caching = config.cache.enable_prefix_caching
    if layout is None:
        prefill_kv = PrefillKVCacheManager(prefill.num_blocks, block_size, caching, link, prefill.num_host_blocks)
        decode_kv = DecodeKVCacheManager(decode.num_blocks, block_size, caching, link, decode.num_host_blocks)
    else:
        prefill_kv = HybridPrefillKVCacheManager(prefill.num_blocks, block_size, layout, caching, link,
                                                 prefill.num_host_blocks)
        decode_kv = HybridDecodeKVCacheManager(decode.num_blocks, block_size, layout, caching, link,
                                               decode.num_host_blocks)
    no_text = Detokenizer(None, frozenset())  # the prefill engine's one sample per prompt is thrown away
    prefill_core = wire_core(dataclasses.replace(scheduler_config), prefill_kv, prefill, no_text, None, True)
    decode_core = wire_core(scheduler_config, decode_kv, decode, detokenizer, structured, async_scheduling)
    return DisaggregatedEngineCore(prefill_core, decode_core), pair
