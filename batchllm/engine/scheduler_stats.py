"""The scheduler's counters (`Scheduler.stats`), which `LLM.stats` reports (batchllm/stats.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0  # prompt tokens computed, recomputation after preemption included
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # Tokens computed again because a preemption by recompute threw their K/V away (prefill work done twice).
    num_recomputed_tokens: int = 0
    num_chunked_prefills: int = 0  # scheduled prompt chunks that stopped short of the prompt's end
    max_step_tokens: int = 0
    max_running: int = 0
    peak_used_blocks: int = 0
    num_blocks: int = 0
    num_errors: int = 0
    num_speculative_steps: int = 0  # steps that verified drafts or drafted on the device
    num_decode_bursts: int = 0  # steps that ran several decode passes (decode_burst.py)
