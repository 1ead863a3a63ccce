"""The engine loop: schedule a step, run it, apply the results. No torch here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from batchllm.engine.detokenizer import Detokenizer
from batchllm.engine.interfaces import ModelRunnerOutput, SchedulerOutput
from batchllm.engine.request import Request
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class FinishedRequest:
    request: Request
    text: str


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, detokenizer: Detokenizer) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.detokenizer = detokenizer

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    fork_of: str | None = None) -> None:
        """Queue a request. `fork_of` names an earlier request with the same prompt whose prompt K/V this
        one may share (the samples of an n > 1 request)."""
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=time.perf_counter(),
                          fork_of=fork_of)
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[FinishedRequest]:
        """Run one engine step; returns the requests that finished in it (rejected ones included)."""
        finished = [FinishedRequest(r, "") for r in self.scheduler.take_rejected()]
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests pending; this is a bug")
            return finished
        runner_output = self.executor.execute_model(scheduler_output)
        for request in self.scheduler.update_from_output(scheduler_output, runner_output):
            finished.append(FinishedRequest(request, self.detokenizer.finish(request)))
        return finished
