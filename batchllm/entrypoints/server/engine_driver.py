"""The engine's side of the server: it takes the client's messages (`engine_protocol.py`) between steps, adds
the requests to the engine, steps it, and reports what each step produced as token ids, raw logprobs and pooled
vectors. Used by the engine process's main loop (`engine_worker.py`) and by the in-process `EngineLoop`; only the
thread that steps the engine calls it.

A prompt's `n` samples are forked engine requests, as in `LLM._stream` (ids "{prompt_id}.{sample}", samples
1..n-1 sharing sample 0's prompt K/V); a pooling submission is one request, "{prompt_id}.0". Live submissions are
admitted at once; batch ones (the Batch API's rows) only while the scheduler's waiting queue is shorter than
`batch_waiting_limit`, so a big batch never queues ahead of live traffic by more than that. An abort ends the
request at the next step boundary; its last results (the tokens it made, finish reason "abort") are reported.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from batchllm.engine.engine_core import FinishedRequest
from batchllm.entrypoints.output_assembly import sample_params
from batchllm.entrypoints.pooling import NO_SAMPLING, pooling_output
from batchllm.entrypoints.server.engine_protocol import (
    LIVE,
    Abort,
    Compile,
    EngineSnapshot,
    SampleDelta,
    SampleFinish,
    StepResults,
    Submit,
)
from batchllm.outputs import PoolingRequestOutput, RequestMetrics
from batchllm.pooling_params import PoolingParams

ABORTED = "aborted"  # the error of a pooling request's output when it was aborted


@dataclass(slots=True, eq=False)
class _Sample:
    request_id: str
    index: int
    num_seen: int = 0  # output tokens counted for the metrics
    num_sent: int = 0  # output tokens reported to the client
    last_token_time: float | None = None
    done: bool = False


@dataclass(slots=True, eq=False)
class _Admitted:
    submit: Submit
    samples: list[_Sample] = field(default_factory=list)


class EngineDriver:
    def __init__(self, llm: Any, batch_waiting_limit: int | None = None) -> None:
        self.llm = llm
        self._engine = llm.engine
        max_num_seqs = self._engine.scheduler.config.max_num_seqs
        self.batch_waiting_limit = batch_waiting_limit or max(1, max_num_seqs // 4)
        self._live: deque[Submit] = deque()
        self._batch: deque[Submit] = deque()
        self._admitted: dict[str, _Admitted] = {}  # prompt id → a generation's samples
        self._pooled: dict[str, Submit] = {}  # prompt id → a pooling submission in the engine
        self._results = StepResults()

    def take(self, message: Any) -> None:
        """Handle one client message (Submit, Abort, Compile)."""
        if isinstance(message, Submit):
            (self._live if message.priority == LIVE else self._batch).append(message)
        elif isinstance(message, Abort):
            self._abort(message.prompt_id)
        elif isinstance(message, Compile):
            try:
                self.llm.check_structured_outputs(message.params)
                self._results.compiled.append((message.token, None))
            except ValueError as exc:  # GrammarError, or an engine without a tokenizer
                self._results.compiled.append((message.token, str(exc)))
        else:
            raise TypeError(f"the engine got an unknown message {type(message).__name__}")

    @property
    def has_work(self) -> bool:
        """Whether `admit` or `step` would do something."""
        return bool(self._live or self._batch) or self._engine.has_unfinished()

    def admit(self) -> bool:
        """Add the live submissions, and the batch ones there is room for, to the engine; True if any."""
        admitted = list(self._live)
        self._live.clear()
        room = self.batch_waiting_limit - len(self._engine.scheduler.waiting) - sum(map(_num_requests, admitted))
        while self._batch and room > 0:
            admitted.append(self._batch.popleft())
            room -= _num_requests(admitted[-1])
        for submit in admitted:
            self._admit(submit)
        return bool(admitted)

    def step(self) -> None:
        """One engine step, if the engine has work; its results join those `take_results` returns."""
        if self._engine.has_unfinished():
            self._publish(self._engine.step())

    def take_results(self) -> StepResults:
        """What changed since the last call, with the engine's load now."""
        results, self._results = self._results, StepResults()
        scheduler = self._engine.scheduler
        pool = scheduler.kv_cache.pool
        results.snapshot = EngineSnapshot(len(scheduler.running), len(scheduler.waiting) + len(self._live)
                                          + len(self._batch), pool.num_used_blocks, pool.num_blocks)
        return results

    def abort_all(self) -> None:
        """Abort every request, queued or in the engine, and let a step still in flight land."""
        for prompt_id in [s.prompt_id for s in (*self._live, *self._batch)] + [*self._admitted, *self._pooled]:
            self._abort(prompt_id)
        while self._engine.has_unfinished():
            self._engine.step()

    # -- admission ---------------------------------------------------------------------------------------------
    def _admit(self, submit: Submit) -> None:
        if isinstance(submit.params, PoolingParams):
            try:
                self._engine.add_request(f"{submit.prompt_id}.0", submit.token_ids, NO_SAMPLING,
                                         lora_request=submit.lora, pooling=submit.params, mm=submit.mm,
                                         error=submit.error)
            except ValueError as exc:
                self._results.refused.append((submit.prompt_id, str(exc)))
                return
            self._pooled[submit.prompt_id] = submit
        else:
            admitted = _Admitted(submit)
            try:
                for index in range(submit.params.n):
                    request_id = f"{submit.prompt_id}.{index}"
                    fork_of = f"{submit.prompt_id}.0" if index else None  # the samples share the prompt's K/V
                    self._engine.add_request(request_id, submit.token_ids, sample_params(submit.params, index),
                                             fork_of=fork_of, lora_request=submit.lora, mm=submit.mm,
                                             error=submit.error)
                    admitted.samples.append(_Sample(request_id, index))
            except ValueError as exc:  # e.g. an adapter this engine cannot apply
                for sample in admitted.samples:
                    self._engine.abort(sample.request_id)
                self._results.refused.append((submit.prompt_id, str(exc)))
                return
            self._admitted[submit.prompt_id] = admitted
        self._results.observations.admitted.append(len(submit.token_ids))

    # -- results -----------------------------------------------------------------------------------------------
    def _publish(self, finished: list[FinishedRequest]) -> None:
        now = time.perf_counter()
        if self._pooled:  # a pooling request has nothing to report before it ends
            for item in finished:
                prompt_id = item.request.request_id.rpartition(".")[0]
                submit = self._pooled.pop(prompt_id, None)
                if submit is not None:
                    self._results.pooled.append((prompt_id, pooling_output(item.request, None, [])))
                    self._results.observations.finished.append(now - submit.submitted_at)
        if not self._admitted:
            return
        by_id = {item.request.request_id: item for item in finished}
        requests = self._engine.scheduler.requests
        for prompt_id, admitted in list(self._admitted.items()):
            for sample in admitted.samples:
                if sample.done:
                    continue
                ended = by_id.get(sample.request_id)
                request = ended.request if ended is not None else requests.get(sample.request_id)
                if request is None:
                    continue
                num_new = request.num_output_tokens - sample.num_seen
                if num_new:
                    self._observe(admitted.submit, sample, num_new, now)
                if ended is not None or (num_new and admitted.submit.incremental):
                    self._report(prompt_id, sample, request, final=ended is not None)
            if all(sample.done for sample in admitted.samples):
                del self._admitted[prompt_id]
                self._results.observations.finished.append(now - admitted.submit.submitted_at)

    def _report(self, prompt_id: str, sample: _Sample, request: Any, final: bool) -> None:
        start = request.num_prompt_tokens + sample.num_sent
        token_ids = request.token_ids[start:]
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = request.output_logprobs[sample.num_sent:]
        sample.num_sent += len(token_ids)
        finish = None
        if final:
            sample.done = True
            finish = SampleFinish(request.finish_reason, request.stop_reason, request.error,
                                  RequestMetrics(request.arrival_time, request.first_token_time,
                                                 request.finished_time))
        self._results.deltas.append(SampleDelta(prompt_id, sample.index, token_ids, logprobs, finish))

    def _observe(self, submit: Submit, sample: _Sample, num_new: int, now: float) -> None:
        first = inter = None
        if sample.last_token_time is None:
            first = now - submit.submitted_at
        else:
            inter = (now - sample.last_token_time) / num_new
        sample.last_token_time = now
        sample.num_seen += num_new
        self._results.observations.tokens.append((num_new, first, inter))

    # -- aborts ------------------------------------------------------------------------------------------------
    def _abort(self, prompt_id: str) -> None:
        for queue in (self._live, self._batch):
            for submit in queue:
                if submit.prompt_id == prompt_id:  # never admitted: nothing in the engine to release
                    queue.remove(submit)
                    self._report_unrun(submit)
                    return
        submit = self._pooled.pop(prompt_id, None)
        if submit is not None:
            self._engine.abort(f"{prompt_id}.0")
            self._report_unrun(submit)
            self._results.observations.finished.append(time.perf_counter() - submit.submitted_at)
            return
        admitted = self._admitted.pop(prompt_id, None)
        if admitted is None:
            return  # finished before the abort came: its results are already on their way
        for sample in admitted.samples:
            request = None if sample.done else self._engine.abort(sample.request_id)
            if request is not None:
                self._report(prompt_id, sample, request, final=True)
            elif not sample.done:
                self._results.deltas.append(SampleDelta(prompt_id, sample.index, [], None, SampleFinish("abort")))
        self._results.observations.finished.append(time.perf_counter() - admitted.submit.submitted_at)

    def _report_unrun(self, submit: Submit) -> None:
        """The last results of a request aborted before it produced anything."""
        if isinstance(submit.params, PoolingParams):
            output = PoolingRequestOutput(f"{submit.prompt_id}.0", None, [], None, error=ABORTED)
            self._results.pooled.append((submit.prompt_id, output))
            return
        for index in range(submit.params.n):
            self._results.deltas.append(SampleDelta(submit.prompt_id, index, [], None, SampleFinish("abort")))


def _num_requests(submit: Submit) -> int:
    """The engine requests a submission becomes: its samples, or one pooling request."""
    return 1 if isinstance(submit.params, PoolingParams) else submit.params.n
