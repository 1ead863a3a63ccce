"""Engine statistics readable after a run (`LLM.stats`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.scheduler import SchedulerStats
from batchllm.engine.spec.policy import SpecStats


@dataclass(slots=True)
class EngineStats:
    num_steps: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_chunked_prefills: int
    num_errors: int
    max_step_tokens: int
    max_running: int
    peak_used_blocks: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from cached blocks
    shared_blocks: int  # block references shared between the samples of n > 1 requests
    cow_copies: int  # shared blocks copied because a sample wrote into them
    evicted_blocks: int  # cached blocks reused for other contents
    elapsed_seconds: float
    num_speculative_steps: int = 0  # steps that verified drafts (or drafted on the device)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    # Per draft position j (0 = the first draft after a row's last token): accepted / drafted there.
    draft_acceptance_per_position: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def collect(cls, scheduler_stats: SchedulerStats, kv_cache: KVCacheManager, runner: Any,
                elapsed_seconds: float, spec: SpecStats | None = None) -> EngineStats:
        fields = dataclasses.asdict(scheduler_stats)
        fields["num_kv_blocks"] = fields.pop("num_blocks")
        if spec is not None:
            fields.update(num_draft_tokens=spec.num_draft_tokens, num_accepted_tokens=spec.num_accepted_tokens,
                          draft_acceptance_per_position=spec.per_position_acceptance)
        cache = kv_cache.stats
        return cls(**fields, block_size=runner.block_size, max_model_len=runner.max_model_len,
                   prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits,
                   shared_blocks=cache.shared_blocks, cow_copies=cache.cow_copies,
                   evicted_blocks=kv_cache.pool.num_evictions, elapsed_seconds=elapsed_seconds)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
