"""Applying a step's results: sampled tokens (and accepted drafts) are appended, stops are checked, and the requests
that ended leave the scheduler, their blocks freed (`Scheduler._free`). Mixed into `Scheduler` (scheduler.py), whose
state it updates.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from batchllm.engine.interfaces import ModelRunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from batchllm.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from batchllm.config import SchedulerConfig
    from batchllm.engine.output_length import OutputLengthEstimator
    from batchllm.engine.scheduler_stats import SchedulerStats
    from batchllm.engine.speculative.speculator import Speculator


class StepResults:
    config: SchedulerConfig
    stats: SchedulerStats
    speculator: Speculator | None
    check_stop: Callable[[Request], bool]
    requests: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    _finished_ids: list[str]
    output_lengths: OutputLengthEstimator

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, stop what must stop, and free the finished requests' blocks."""
        finished: list[Request] = []
        now = time.perf_counter()
        requests, sampled = self.requests, runner_output.sampled
        num_generated = 0
        finished_while_waiting = False  # preempted while its last token was in flight: it is in `waiting`
        for scheduled in output.requests:
            if not scheduled.sample:
                continue
            request = requests.get(scheduled.request_id)
            if request is None:
                continue  # finished by the step before this one: this token was computed in vain
            request.num_pending_tokens -= 1
            was_preempted = request.status is RequestStatus.PREEMPTED
            if request.first_token_time is None:
                request.first_token_time = now
            if request.pooling is not None:  # its prompt is done: the pooled vector is its whole answer
                request.pooled = runner_output.pooled[scheduled.request_id]
                request.status = RequestStatus.FINISHED_STOPPED
                finished.append(request)
                finished_while_waiting |= was_preempted
                continue
            if output.speculative:
                ended, appended = self._apply_speculative(request, scheduled, runner_output)
            elif output.num_steps > 1:
                request.num_pending_tokens -= output.num_steps - 1
                ended, appended = self._append_all(request, (*runner_output.accepted[scheduled.request_id],
                                                             sampled[scheduled.request_id]))
            else:
                ended, appended = self._append(request, sampled[scheduled.request_id]), 1
            num_generated += appended
            if ended:
                finished.append(request)
                finished_while_waiting |= was_preempted
        self.stats.num_generated_tokens += num_generated
        if finished:
            for request in finished:
                request.finished_time = now
                self.output_lengths.observe(request)
                self._free(request)
                if self.speculator is not None:
                    self.speculator.forget(request)
                del self.requests[request.request_id]
                self._finished_ids.append(request.request_id)
            self.running = [r for r in self.running if not r.status.finished]
            if finished_while_waiting:
                self.waiting = deque(r for r in self.waiting if not r.status.finished)
        return finished

    def _append(self, request: Request, token: SampledToken) -> bool:
        """Append one new token; True when the request must stop after it."""
        if not request.append_token(token):
            request.status = RequestStatus.FINISHED_ERROR
            request.error = f"the structured-output grammar rejected the sampled token {token.token_id}"
            self.stats.num_errors += 1
        elif len(request.token_ids) >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
        return bool(request.status.finished or self.check_stop(request)
                    or (request.matcher is not None and _grammar_ended(request)))

    def _apply_speculative(self, request: Request, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput
                           ) -> tuple[bool, int]:
        """Append a row's accepted drafts and its next token, stopping at the first that ends it; forget the K/V of
        the rejected drafts. Returns (ended, tokens appended)."""
        request_id = scheduled.request_id
        num_drafted = len(scheduled.draft_token_ids)
        accepted = runner_output.accepted.get(request_id, []) if num_drafted else []
        if num_drafted:
            self.speculator.record(request, num_drafted, len(accepted))
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens -= num_drafted - len(accepted)
        ended, appended = self._append_all(request, (*accepted, runner_output.sampled[request_id]))
        if not ended and scheduled.num_lookahead and request.status is RequestStatus.RUNNING:
            request.draft_token_ids = runner_output.draft_token_ids.get(request_id, [])
        return ended, appended

    def _append_all(self, request: Request, tokens: tuple[SampledToken, ...]) -> tuple[bool, int]:
        """Append `tokens` in order, stopping at the first that ends the request. Returns (ended, tokens appended)."""
        for appended, token in enumerate(tokens, 1):
            if self._append(request, token):
                return True, appended
        return False, len(tokens)


def _grammar_ended(request: Request) -> bool:
    """The grammar allows nothing more (it ended without an EOS token, which `check_stop` would have seen)."""
    if request.matcher is None or not request.matcher.is_terminated:
        return False
    request.status = RequestStatus.FINISHED_STOPPED
    return True
