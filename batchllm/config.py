"""Engine-wide configuration, validated once when an `LLM` is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory (GPU: profiled; CPU: kv_cache_memory_bytes)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU budget for the KV pool; None picks a default
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        _require(isinstance(self.block_size, int) and self.block_size > 0 and self.block_size % 8 == 0,
                 "block_size", self.block_size, "a positive multiple of 8")
        _require(self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 1),
                 "num_kv_blocks", self.num_blocks, "an int >= 1 or None")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
                 "in (0, 1]")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # resolved from the model config and the KV pool size
    max_loras: int = 0  # distinct adapters among the running requests (device slots); 0: no LoRA

    def validate(self) -> None:
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs",
                 self.max_num_seqs, "an int >= 1")
        _require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", self.max_num_batched_tokens, "an int >= 1")


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"LLM argument {name} must be {expected}, got {value!r}")
