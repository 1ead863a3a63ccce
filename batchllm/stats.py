"""Engine statistics readable after a run (`LLM.stats`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchllm.engine.scheduler import SchedulerStats


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
    elapsed_seconds: float

    @classmethod
    def collect(cls, scheduler_stats: SchedulerStats, runner: Any, elapsed_seconds: float) -> EngineStats:
        fields = dataclasses.asdict(scheduler_stats)
        fields["num_kv_blocks"] = fields.pop("num_blocks")
        return cls(**fields, block_size=runner.block_size, max_model_len=runner.max_model_len,
                   elapsed_seconds=elapsed_seconds)

    @property
    def generated_tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.elapsed_seconds if self.elapsed_seconds else 0.0
