"""The engine loop: schedule a step, run it, apply the results. No torch here.

With asynchronous scheduling the loop keeps one step in flight: each `step()` schedules and launches step
N+1, then waits for step N and applies its results, so the host's scheduling, input preparation, stop
checks and detokenization for one step overlap the device's work on the other. The outputs are those of
the synchronous loop (see `scheduler.py` for how pending tokens are handled).

With speculative decoding the loop waits for the step in flight before it schedules one that drafts
(`_wait_for_tokens`): drafts are made from a row's newest tokens.

A step with grammar-constrained rows is launched in two parts: the forward pass first, then, once the
previous step's tokens have advanced the matchers, the bitmask that its sampling needs
(`structured/manager.py`).

Pipeline parallelism (`pipeline_depth` = P stages): the loop keeps up to P steps in flight, one in each stage,
each with requests of its own (the scheduler leaves out a request whose token is still in flight, and caps a
step at 1/P of `max_num_seqs`): the stages work on different micro-batches at once, as vLLM's virtual engines
do. Each step's tokens are known when it is scheduled, so its grammar bitmask goes with it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from batchllm.engine.detokenizer import Detokenizer
from batchllm.engine.interfaces import AwaitingGrammar, ModelRunnerOutput, PendingOutput, ReadyOutput, SchedulerOutput
from batchllm.engine.request import Request
from batchllm.engine.scheduler import Scheduler
from batchllm.engine.structured.manager import StructuredOutputManager
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams


class Executor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class AsyncExecutor(Executor, Protocol):
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput | AwaitingGrammar:
        """Launch the step and return at once; steps complete in the order they were launched. A step with
        `grammar_request_ids` but no `grammar` returns `AwaitingGrammar`."""
        ...


@dataclass(slots=True)
class FinishedRequest:
    request: Request
    text: str


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, detokenizer: Detokenizer,
                 async_scheduling: bool = False, structured: StructuredOutputManager | None = None,
                 pipeline_depth: int = 1) -> None:
        if (async_scheduling or pipeline_depth > 1) and not hasattr(executor, "execute_model_async"):
            raise ValueError(f"async_scheduling needs an executor that can launch steps ({type(executor).__name__} "
                             f"cannot)")
        self.scheduler = scheduler
        self.executor = executor
        self.detokenizer = detokenizer
        self.async_scheduling = async_scheduling or pipeline_depth > 1
        self.structured = structured
        self.pipelined = pipeline_depth > 1
        # Steps launched and not yet applied, oldest first; at most this many once a step returns.
        self._max_in_flight = pipeline_depth - 1 if self.pipelined else 1
        self._in_flight: deque[tuple[SchedulerOutput, PendingOutput]] = deque()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    fork_of: str | None = None, lora_request: LoRARequest | None = None,
                    pooling: PoolingParams | None = None, mm: MultiModalPrompt | None = None,
                    error: str | None = None) -> None:
        """Queue a request. `fork_of` names an earlier request with the same prompt whose prompt K/V this
        one may share (the samples of an n > 1 request); `lora_request` the adapter it runs under; `pooling`
        makes it a pooling request (an embedding: its prompt is pooled, nothing is generated); `mm` its images.
        `error`: the door already failed the row (an image that does not decode): it finishes with that error,
        unscheduled, and the others go on."""
        if lora_request is not None and not self.scheduler.config.max_loras:
            raise ValueError("a lora_request needs an LLM built with enable_lora=True")
        request = Request(request_id, list(prompt_token_ids), params, arrival_time=time.perf_counter(),
                          fork_of=fork_of, lora_request=lora_request, pooling=pooling, mm=mm)
        if error is None and params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured outputs need a tokenizer (the LLM was built with "
                                 "skip_tokenizer_init=True)")
            error = self.structured.init_request(request)
        self.scheduler.add_request(request, error)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request between steps (`Scheduler.abort_request`): its blocks, grammar matcher and incremental
        detokenizer state are released now. Returns it, or None when the engine no longer holds that id (it
        finished already: its result came, or comes, from `step`). Not thread-safe, like every method here: call
        it from the thread that steps the engine."""
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self._release(request)
            self.detokenizer.release([request_id])
        return request

    def in_flight_outputs(self) -> list[SchedulerOutput]:
        """The steps launched and not yet applied, oldest first."""
        return [so for so, _ in self._in_flight]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def step(self) -> list[FinishedRequest]:
        """Run one engine step; returns the requests that finished in it (rejected ones included).

        Asynchronous: the requests that finished in the previous step, whose results this step applied."""
        finished = [FinishedRequest(r, "") for r in self.scheduler.take_rejected()]
        for item in finished:
            self._release(item.request)
        in_flight = self._in_flight
        if in_flight and self._wait_for_tokens(in_flight[-1][0]):
            while in_flight:
                finished += self._apply(*in_flight.popleft())
        so = self.scheduler.schedule()
        if so.is_empty and not in_flight and (self.scheduler.running or self.scheduler.waiting):
            raise RuntimeError("scheduler made no progress with requests pending; this is a bug")
        if self.structured is not None and not so.is_empty:
            so.grammar_request_ids = self.structured.constrained_ids(so, self.scheduler.requests)
        if not self.async_scheduling:
            if not so.is_empty:
                if so.grammar_request_ids:
                    so.grammar = self.structured.bitmask(so.grammar_request_ids, self.scheduler.requests)
                finished += self._apply(so, ReadyOutput(self.executor.execute_model(so)))
            return finished

        if self.pipelined and so.grammar_request_ids:
            so.grammar = self.structured.bitmask(so.grammar_request_ids, self.scheduler.requests)
        launched = None if so.is_empty else self.executor.execute_model_async(so)  # type: ignore[attr-defined]
        if launched is None:  # nothing to launch: apply the oldest step, whose requests may then run again
            if in_flight:
                finished += self._apply(*in_flight.popleft())
            return finished
        in_flight.append((so, launched))
        while len(in_flight) > self._max_in_flight:
            finished += self._apply(*in_flight.popleft())
        if isinstance(launched, AwaitingGrammar):
            # The forward pass runs on the device meanwhile; the matchers have just taken step N's tokens.
            grammar = self.structured.bitmask(so.grammar_request_ids, self.scheduler.requests)
            in_flight[-1] = (so, launched.sample(grammar))
        return finished

    def _wait_for_tokens(self, in_flight: SchedulerOutput) -> bool:
        """Speculative decoding drafts from a row's tokens, so the step in flight must be applied before the next
        is scheduled: always after a speculative step, and while speculation pays (`Speculator`)."""
        speculator = self.scheduler.speculator
        return speculator is not None and (in_flight.speculative
                                           or speculator.needs_known_tokens(len(self.scheduler.running)))

    def _apply(self, scheduler_output: SchedulerOutput, pending: PendingOutput) -> list[FinishedRequest]:
        runner_output: ModelRunnerOutput = pending.result()
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        for request in finished:
            self._release(request)
        return [FinishedRequest(request, self.detokenizer.finish(request)) for request in finished]

    def _release(self, request: Request) -> None:
        if self.structured is not None:
            self.structured.finish_request(request)
