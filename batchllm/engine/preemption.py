"""Preemption: when the KV pool runs dry, the newest running requests give their blocks back, recomputed later or
swapped out to a KV connector (the host tier) and back. Mixed into `Scheduler` (scheduler.py), whose state it
updates.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from batchllm.engine.kv_cache_manager import BlockAllocation, KVCacheManager
from batchllm.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchllm.config import SchedulerConfig
    from batchllm.engine.scheduler_stats import SchedulerStats


class Preemption:
    config: SchedulerConfig
    kv_cache: KVCacheManager
    stats: SchedulerStats
    running: list[Request]
    waiting: deque[Request]
    _preempted_this_step: bool
    _waiting_for_room: bool

    def _allocate_or_preempt(self, request: Request, num_new: int, num_lookahead: int = 0) -> BlockAllocation | None:
        """Allocate blocks for `request` (and its lookahead slots), preempting the newest running requests until
        they fit. Returns None when `request` itself had to be preempted.
        """
        while True:
            allocation = self.kv_cache.allocate_slots(request, num_new + num_lookahead)
            if allocation is not None:
                return allocation
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        # Swapping costs two copies of the request's K/V; recomputing a short one rides in a later step's budget.
        swap = (self.config.preemption_mode == "swap" and request.num_computed_tokens >= self.config.swap_min_tokens
                and self.kv_cache.swap_out(request))
        if not swap:
            self.kv_cache.free(request)
            request.num_recompute_until = max(request.num_recompute_until, request.num_computed_tokens)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._waiting_for_room = False  # its blocks came back
        request.known_to_runner = False
        request.draft_token_ids = []
        request.num_lookahead = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._preempted_this_step = True
        self.waiting.appendleft(request)
