"""Engine statistics readable after a run (`LLM.stats`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.scheduler_stats import SchedulerStats
from batchllm.engine.speculative.policy import SpecStats


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
    # The host tier (swap_space): its size, the blocks moved each way and why, and what the copies cost.
    num_host_kv_blocks: int = 0
    swapped_out_blocks: int = 0  # preempted requests' blocks copied out ...
    swapped_in_blocks: int = 0  # ... and back in when they resumed
    swap_preemptions: int = 0  # of num_preemptions, those that swapped instead of recomputing
    spilled_blocks: int = 0  # cached blocks copied out as the device pool evicted them
    host_tier_loaded_blocks: int = 0  # cached blocks copied back in for prompts with their prefix
    host_prefix_hits: int = 0  # of prefix_cache_hits, the tokens served from the host tier
    kv_transfer_bytes: int = 0  # bytes copied between the pools (one rank's share under tensor parallelism)
    kv_transfer_seconds: float = 0.0  # time the copies took (0 under tensor parallelism: the ranks keep it)
    # Disaggregated prefill / decode (the decode engine's figures above; these count what crossed over).
    kv_handoffs: int = 0  # requests admitted with their prompt's K/V from the prefill engine
    kv_handoff_blocks: int = 0
    kv_handoffs_recomputed: int = 0  # handed over without K/V (the buffer was full), computed by the decode engine
    # Prefill done twice: tokens whose K/V a preemption by recompute threw away, computed again (of num_prefill_tokens).
    num_recomputed_tokens: int = 0
    num_decode_bursts: int = 0  # steps that ran several decode passes (num_decode_steps > 1)

    @classmethod
    def collect(cls, scheduler_stats: SchedulerStats, kv_cache: KVCacheManager, runner: Any,
                elapsed_seconds: float, spec: SpecStats | None = None, transfer_seconds: float = 0.0) -> EngineStats:
        fields = dataclasses.asdict(scheduler_stats)
        fields["num_kv_blocks"] = fields.pop("num_blocks")
        if spec is not None:
            fields.update(num_draft_tokens=spec.num_draft_tokens, num_accepted_tokens=spec.num_accepted_tokens,
                          draft_acceptance_per_position=spec.per_position_acceptance)
        if kv_cache.host is not None:
            tier = kv_cache.host.stats
            fields.update(num_host_kv_blocks=kv_cache.host.pool.num_blocks, swapped_out_blocks=tier.swapped_out_blocks,
                          swapped_in_blocks=tier.swapped_in_blocks, swap_preemptions=tier.swap_preemptions,
                          spilled_blocks=tier.spilled_blocks, host_tier_loaded_blocks=tier.loaded_blocks,
                          host_prefix_hits=tier.host_prefix_hits, kv_transfer_seconds=transfer_seconds,
                          kv_transfer_bytes=tier.copied_blocks * runner.host_block_bytes)
        handoff = getattr(kv_cache, "handoff", None)
        if handoff is not None:
            fields.update(kv_handoffs=handoff.requests, kv_handoff_blocks=handoff.blocks,
                          kv_handoffs_recomputed=handoff.recomputed)
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
