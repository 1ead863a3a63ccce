"""The token-budget scheduler: one code path for prefill, chunked prefill and decode.

Each step every request is given `num_tokens - num_computed_tokens` new tokens, capped by what is left of
the step's token budget: a fresh prompt, the next chunk of a long prompt, a recompute after preemption and
a one-token decode are the same operation. Running requests are served first, oldest first, then waiting
requests in FIFO order. When the KV pool runs dry the newest running request is preempted (its blocks are
freed and it is re-queued at the front of the waiting queue to be recomputed, or, with
`preemption_mode="swap"`, its K/V is swapped out to the host tier, a KV connector, and back in), which always lets the
oldest request progress: no deadlock, since a single request never exceeds `max_model_len` and
`max_model_len` never exceeds the pool.

Pipeline parallelism (`num_micro_batches` = P > 1): P steps are in flight, each with requests of its own. A
request whose token is still in flight is left out (no placeholder), and a step takes at most
`max_num_seqs / P` requests, so that the next steps have requests to run.

Decode bursts (decode_burst.py): a step of plain decode rows may give each row several tokens, computed by as many
forward passes on the device; they count as pending as the asynchronous loop's single token does.

Asynchronous scheduling: step N+1 is scheduled while step N runs, before its sampled tokens are known.
A request that step N samples counts that token as pending (`num_pending_tokens`); the next step
schedules it as a placeholder, which the runner fills in on the device. Step N's results are applied
afterwards: a request that step N finished has its step-N+1 token discarded, and a request preempted
while its token was in flight still receives it (it is recomputed with it when it runs again).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from batchllm.config import SchedulerConfig
from batchllm.engine.admission import Admission
from batchllm.engine.decode_burst import burst_length
from batchllm.engine.image_chunks import encoder_work, whole_images
from batchllm.engine.interfaces import NewRequestData, ScheduledRequest, SchedulerOutput
from batchllm.engine.kv_cache_manager import BlockAllocation, KVCacheManager
from batchllm.engine.kv_connector import connector_metadata
from batchllm.engine.output_length import OutputLengthEstimator
from batchllm.engine.preemption import Preemption
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.scheduler_stats import SchedulerStats
from batchllm.engine.speculative.speculator import Speculator
from batchllm.engine.step_results import StepResults

# Returns True when the request must stop after its newest token; sets status and stop_reason.
StopCheck = Callable[[Request], bool]


class Scheduler(Admission, Preemption, StepResults):
    """Schedules each step (this module); admits waiting requests (admission.py), preempts running ones when the pool
    runs dry (preemption.py) and applies a step's results (step_results.py)."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, check_stop: StopCheck,
                 speculator: Speculator | None = None) -> None:
        if config.max_model_len < 1 or config.max_model_len > kv_cache.capacity_tokens:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) must be in [1, KV pool capacity = "
                f"{kv_cache.capacity_tokens} tokens]"
            )
        self.config = config
        self.kv_cache = kv_cache
        self.connectors = kv_cache.connectors  # kv_connector.py: the KV manager calls the block-level hooks
        self.check_stop = check_stop
        self.speculator = speculator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats(num_blocks=kv_cache.pool.num_blocks)
        self._finished_ids: list[str] = []  # reported to the runner with the next step
        self._rejected: list[Request] = []
        self._preempted_this_step = False
        self._scheduled_now: dict[str, int] = {}  # request id → tokens scheduled in the step being built
        self.output_lengths = OutputLengthEstimator()  # learns from the finished rows (step_results.py)
        self._reserved_blocks: int | None = None  # admission.py: recounted in each step that admits
        # The head of `waiting` found no room in the pool, and no blocks came back since: a decode burst may run
        # (decode_burst.py), since nobody could be admitted before a request ends.
        self._waiting_for_room = False
        self._admit_lacked_room = False

    def add_request(self, request: Request, error: str | None = None) -> None:
        """Queue `request`, or reject it (with `error`, or when it cannot run) to be reported by the next step."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        error = error or self._admission_error(request)
        if error is not None:
            request.status, request.error = RequestStatus.FINISHED_ERROR, error
            request.finished_time = time.perf_counter()
            self.stats.num_errors += 1
            self._rejected.append(request)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reset_stats(self) -> None:
        self.stats = SchedulerStats(num_blocks=self.kv_cache.pool.num_blocks)
        self.kv_cache.reset_stats()
        self.output_lengths.reset()  # a new run's rows: their lengths are learned afresh
        if self.speculator is not None:
            self.speculator.reset_stats()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    def abort_request(self, request_id: str) -> Request | None:
        """End a request now, wherever it is: waiting (preempted ones too), running, or rejected but not yet
        reported. Its blocks are freed at once and the runner is told with the next step. Returns it (status
        FINISHED_ABORTED, or FINISHED_ERROR for a rejected one), or None for an id the scheduler does not hold
        (finished or never added).

        Safe while a step that holds the request is in flight (asynchronous scheduling): `update_from_output`
        drops the tokens of ids no longer in `requests`, and the runner writes the freed blocks before any
        later step, whose requests may reuse them, runs. A forked sample whose parent is aborted runs on its
        own (`_fork_parent` no longer finds the parent); one that already shares the parent's blocks keeps
        them, since sharing holds a reference per owner."""
        request = self.requests.pop(request_id, None)
        if request is None:
            for position, rejected in enumerate(self._rejected):
                if rejected.request_id == request_id:
                    return self._rejected.pop(position)
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:  # WAITING, or PREEMPTED: back in the waiting queue
            self.waiting.remove(request)
        self._free(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.finished_time = time.perf_counter()
        request.draft_token_ids = []
        # Also when the runner has not seen it (still waiting): it drops ids it does not hold.
        self._finished_ids.append(request_id)
        return request

    def take_rejected(self) -> list[Request]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def schedule(self) -> SchedulerOutput:
        self.kv_cache.begin_step()
        for connector in self.connectors:
            connector.begin_step()
        budget = self.config.max_num_batched_tokens
        # The images whose encoder runs in this step take their share of the budget (their output rows).
        encoder_tokens = 0
        scheduled: list[ScheduledRequest] = []
        self._preempted_this_step = False
        speculative = False
        if self.speculator is not None:
            self.speculator.plan(self.running)

        i = 0
        running, max_model_len, allocate = self.running, self.config.max_model_len, self.kv_cache.allocate_slots
        pipelined = self.config.num_micro_batches > 1
        max_rows = -(-self.config.max_num_seqs // self.config.num_micro_batches)
        burst = burst_length(running, len(self.waiting), self.config, self._waiting_for_room)
        extra = burst - 1  # each row's tokens after its first: slots to allocate, pending tokens to count
        while i < len(running) and budget > 0 and len(scheduled) < max_rows:
            request = running[i]
            with_pending = len(request.token_ids) + request.num_pending_tokens
            # At max_model_len a generation has ended (or ends with its pending token); a pooling prompt may fill it.
            if ((with_pending >= max_model_len and request.pooling is None)
                    or (request.num_pending_tokens and (request.surely_finishes or pipelined))):
                i += 1
                continue
            num_new = with_pending - request.num_computed_tokens
            drafts = request.draft_token_ids
            if drafts or request.num_lookahead:
                speculative = True
                del drafts[max(0, budget - num_new):]  # the drafts that fit the budget
                num_new += len(drafts)
            num_new = min(num_new, budget)
            # Rows with images past their last image (decode) skip the image bookkeeping: it runs every step.
            mm = request.mm if request.mm is not None and request.num_computed_tokens < request.mm.last_image_end \
                else None
            if mm is not None and mm.bidirectional:
                num_new = whole_images(mm, request.num_computed_tokens, num_new, budget)
                if not num_new:  # its next image does not fit what is left of this step
                    i += 1
                    continue
            allocation = allocate(request, num_new + request.num_lookahead + extra)  # it fits: no call to preempt
            if allocation is None:
                allocation = self._allocate_or_preempt(request, num_new, request.num_lookahead + extra)
            if allocation is None:
                break  # the request preempted itself: it was the newest, nothing after it is running
            if mm is not None:
                work = encoder_work(request, num_new)
                encoder_tokens, budget = encoder_tokens + work, budget - work
            scheduled.append(self._schedule_request(request, num_new, allocation))
            if extra:
                request.num_computed_tokens += extra
                request.num_pending_tokens += extra
            budget -= num_new
            i += 1

        # A step that had to preempt admits nobody new: the pool is already too tight.
        max_seqs = self.config.max_num_seqs
        adapters = None  # the adapters of the running requests, gathered when an adapter's request waits
        # Requests whose K/V this step loads from a connector join `running` but compute from the next step on
        # (kv_cache_manager.py), at most a step's budget of them, so the copies run while this step computes.
        num_loading_tokens = 0
        self._reserved_blocks = None
        # A burst admits nobody either: its passes are decode rows only.
        while (not extra and not self._preempted_this_step and self.waiting and budget > 0
               and len(self.running) < max_seqs and num_loading_tokens < self.config.max_num_batched_tokens
               and len(scheduled) < max_rows):
            request = self.waiting[0]
            lora = request.lora_request
            if lora is not None:
                if adapters is None:
                    adapters = {r.lora_request.cache_key for r in self.running if r.lora_request is not None}
                if lora.cache_key not in adapters and len(adapters) >= self.config.max_loras:
                    break  # no device slot for another adapter until a running one's requests finish
            admitted = self._admit(request, budget)
            if admitted is None:
                self._waiting_for_room = self._admit_lacked_room
                break  # strict FIFO: a later, smaller request may not overtake the head of the queue
            self._waiting_for_room = False
            num_new, allocation = admitted
            if lora is not None:
                adapters.add(lora.cache_key)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._reserve_for(request)
            self.running.append(request)
            if self.kv_cache.is_loading(request):
                num_loading_tokens += num_new
                continue
            if request.mm is not None:
                work = encoder_work(request, num_new)
                encoder_tokens, budget = encoder_tokens + work, budget - work
            scheduled.append(self._schedule_request(request, num_new, allocation))
            budget -= num_new

        num_tokens = self.config.max_num_batched_tokens - budget - encoder_tokens
        self._record_step(num_tokens)
        finished_ids, self._finished_ids = self._finished_ids, []
        self._scheduled_now.clear()
        if speculative:
            self.stats.num_speculative_steps += 1
        if extra and scheduled:
            self.stats.num_decode_bursts += 1
            self.stats.num_decode_tokens += extra * len(scheduled)
            self.stats.num_scheduled_tokens += extra * num_tokens
        observe = self.speculator is not None and (speculative or self.speculator.wants_observation)
        output = SchedulerOutput(scheduled, num_tokens, finished_ids, self.kv_cache.take_pending_copies(),
                                 speculative=speculative, observe_drafts=observe, num_steps=burst if scheduled else 1)
        output.kv_connector_metadata = connector_metadata(self.connectors, output)
        return output

    def _schedule_request(self, request: Request, num_new: int, allocation: BlockAllocation) -> ScheduledRequest:
        # Runs for every scheduled request of every step: kept to plain attribute reads.
        start = request.num_computed_tokens
        drafts = request.draft_token_ids
        end = start + num_new - len(drafts)  # the drafts come after the request's own tokens
        num_tokens = len(request.token_ids)
        placeholder = end > num_tokens  # only the newest, still pending, token can be unknown
        new_data = None
        if not request.known_to_runner:
            new_data = NewRequestData(request.request_id, list(request.token_ids), request.num_prompt_tokens,
                                      request.sampling_params, request.lora_request, request.pooling, request.mm)
            request.known_to_runner = True
        full_table = new_data is not None or allocation.copied
        block_ids = self.kv_cache.block_ids(request) if full_table else allocation.new_block_ids
        stats = self.stats
        if start < request.num_recompute_until:
            stats.num_recomputed_tokens += min(start + num_new, request.num_recompute_until) - start
        if new_data is None and end - start == 1 and start >= request.num_prompt_tokens:
            stats.num_decode_tokens += num_new
        else:
            stats.num_prefill_tokens += num_new
        sample = end == num_tokens + request.num_pending_tokens
        if sample:
            request.num_pending_tokens += 1
        else:
            stats.num_chunked_prefills += 1
        request.num_computed_tokens = start + num_new  # rolled back past the rejected drafts
        self._scheduled_now[request.request_id] = num_new
        token_ids = request.token_ids[start:end] if start < num_tokens else []
        if not drafts and not request.num_lookahead:
            return ScheduledRequest(request.request_id, token_ids, start, block_ids, sample, new_data, full_table,
                                    placeholder)
        request.draft_token_ids = []
        return ScheduledRequest(request.request_id, token_ids, start, block_ids, sample, new_data, full_table,
                                placeholder, drafts, request.num_lookahead)

    def _free(self, request: Request) -> None:
        """Free an ended request's blocks, unless a connector keeps them (a prefill engine's, until its K/V is sent:
        that connector frees them)."""
        self._waiting_for_room = False  # its blocks come back (or a connector's, later)
        block_ids = self.kv_cache.block_ids(request) if self.connectors else []
        if not [connector for connector in self.connectors if connector.request_finished(request, block_ids)]:
            self.kv_cache.free(request)

    def _record_step(self, num_tokens: int) -> None:
        stats = self.stats
        if num_tokens:
            stats.num_steps += 1
        stats.num_scheduled_tokens += num_tokens
        stats.max_step_tokens = max(stats.max_step_tokens, num_tokens)
        stats.max_running = max(stats.max_running, len(self.running))
        stats.peak_used_blocks = self.kv_cache.peak_used_blocks
