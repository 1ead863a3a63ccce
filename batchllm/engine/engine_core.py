"""The engine loop: schedule a step, run it, apply the results. No torch here.

With asynchronous scheduling the loop keeps one step in flight: each `step()` schedules and launches step
N+1, then waits for step N and applies its results, so the host's scheduling, input preparation, stop
checks and detokenization for one step overlap the device's work on the other. The outputs are those of
the synchronous loop (see `scheduler.py` for how pending tokens are handled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from batchllm.engine.detokenizer import Detokenizer
from batchllm.engine.interfaces import ModelRunnerOutput, PendingOutput, ReadyOutput, SchedulerOutput
from batchllm.engine.request import Request
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class AsyncExecutor(Executor, Protocol):
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Launch the step and return at once; steps complete in the order they were launched."""
        ...


@dataclass(slots=True)
class FinishedRequest:
    request: Request
    text: str


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, detokenizer: Detokenizer,
                 async_scheduling: bool = False) -> None:
        if async_scheduling and not hasattr(executor, "execute_model_async"):
            raise ValueError(f"async_scheduling needs an executor that can launch steps ({type(executor).__name__} "
                             f"cannot)")
        self.scheduler = scheduler
        self.executor = executor
        self.detokenizer = detokenizer
        self.async_scheduling = async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    fork_of: str | None = None) -> None:
        """Queue a request. `fork_of` names an earlier request with the same prompt whose prompt K/V this
        one may share (the samples of an n > 1 request)."""
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=time.perf_counter(),
                          fork_of=fork_of)
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[FinishedRequest]:
        """Run one engine step; returns the requests that finished in it (rejected ones included).

        Asynchronous: the requests that finished in the previous step, whose results this step applied."""
        finished = [FinishedRequest(r, "") for r in self.scheduler.take_rejected()]
        scheduler_output = self.scheduler.schedule()
        launched = None
        if not scheduler_output.is_empty:
            launched = (scheduler_output, self._launch(scheduler_output))
        elif self._in_flight is None and (self.scheduler.running or self.scheduler.waiting):
            raise RuntimeError("scheduler made no progress with requests pending; this is a bug")
        previous, self._in_flight = self._in_flight, launched
        if not self.async_scheduling and launched is not None:
            previous, self._in_flight = launched, None
        if previous is not None:
            finished += self._apply(*previous)
        return finished

    def _launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        if self.async_scheduling:
            return self.executor.execute_model_async(scheduler_output)  # type: ignore[attr-defined]
        return ReadyOutput(self.executor.execute_model(scheduler_output))

    def _apply(self, scheduler_output: SchedulerOutput, pending: PendingOutput) -> list[FinishedRequest]:
        runner_output: ModelRunnerOutput = pending.result()
        return [FinishedRequest(request, self.detokenizer.finish(request))
                for request in self.scheduler.update_from_output(scheduler_output, runner_output)]
