"""The engine thread's book of admitted requests: it adds a prompt's samples to the engine (forked like
`LLM._stream`: request ids "{prompt_id}.{sample}", samples 1..n-1 sharing sample 0's prompt K/V) and turns each
step's results into the events of their streams. Only the engine thread uses it.

A pooling submission (params: the LLM's `PoolingParams`, on an embed server) is one engine request, "{prompt_id}.0",
with no per-step updates: its stream gets one event, whose output is a `PoolingRequestOutput` (as `LLM.embed`
returns it; aborted: outputs None and error `ABORTED`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from batchllm.engine.engine_core import FinishedRequest
from batchllm.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from batchllm.pooling_api import NO_SAMPLING, pooling_output
from batchllm.pooling_params import PoolingParams
from batchllm.request_outputs import complete, completion_output, logprob_entries, sample_params
from batchllm.sampling_params import SamplingParams
from batchllm.server.request_stream import RequestStream, SampleUpdate, StreamEvent
from batchllm.server.sample_progress import SampleProgress

ABORTED = "aborted"  # the error of a pooling request's output when it was aborted


class LoopObserver(Protocol):
    """Per-request measurements, called on the engine thread (`metrics.ServerMetrics` implements it)."""

    def request_admitted(self, num_prompt_tokens: int) -> None: ...
    def tokens_generated(self, num_tokens: int, first_token_seconds: float | None,
                         inter_token_seconds: float | None) -> None: ...
    def request_finished(self, seconds: float) -> None: ...


@dataclass(slots=True, eq=False)
class Submission:
    stream: RequestStream
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams | PoolingParams
    lora_request: LoRARequest | None
    incremental: bool
    submitted_at: float

    @property
    def num_requests(self) -> int:
        """The engine requests it becomes: its samples, or one pooling request."""
        return self.params.n if isinstance(self.params, SamplingParams) else 1


@dataclass(slots=True, eq=False)
class _Admitted:
    submission: Submission
    samples: list[SampleProgress]
    completions: list[CompletionOutput | None]


class AdmittedRequests:
    def __init__(self, llm: LLM) -> None:
        self._engine = llm.engine
        self._tokenizer = llm.tokenizer
        self._backend = None if llm.tokenizer is None else llm.tokenizer.backend_tokenizer
        self._admitted: dict[str, _Admitted] = {}
        self._pooled: dict[str, Submission] = {}  # engine request id → a pooling submission
        self.observer: LoopObserver | None = None

    def __bool__(self) -> bool:
        return bool(self._admitted) or bool(self._pooled)

    def admit(self, submission: Submission) -> None:
        stream, params = submission.stream, submission.params
        if stream.cancelled:  # aborted while it was being taken from the queue
            stream.deliver(StreamEvent(output=aborted_output(submission)))
            return
        if isinstance(params, PoolingParams):
            self._admit_pooling(submission, params)
            return
        samples = []
        try:
            for index in range(params.n):
                request_id = f"{stream.prompt_id}.{index}"
                fork_of = f"{stream.prompt_id}.0" if index else None  # the samples share the prompt's K/V
                self._engine.add_request(request_id, submission.prompt_token_ids, sample_params(params, index),
                                         fork_of=fork_of, lora_request=submission.lora_request)
                samples.append(SampleProgress(request_id, index, params, self._backend, submission.incremental))
        except ValueError as exc:
            for sample in samples:
                self._engine.abort(sample.request_id)
            stream.deliver(StreamEvent(error=exc))
            return
        self._admitted[stream.prompt_id] = _Admitted(submission, samples, [None] * params.n)
        if self.observer is not None:
            self.observer.request_admitted(len(submission.prompt_token_ids))

    def _admit_pooling(self, submission: Submission, params: PoolingParams) -> None:
        request_id = f"{submission.stream.prompt_id}.0"
        try:
            self._engine.add_request(request_id, submission.prompt_token_ids, NO_SAMPLING,
                                     lora_request=submission.lora_request, pooling=params)
        except ValueError as exc:
            submission.stream.deliver(StreamEvent(error=exc))
            return
        self._pooled[request_id] = submission
        if self.observer is not None:
            self.observer.request_admitted(len(submission.prompt_token_ids))

    def publish(self, finished: list[FinishedRequest]) -> None:
        if self._pooled:  # only the finished ones are looked at: a pooling request has nothing to report before
            for item in finished:
                submission = self._pooled.pop(item.request.request_id, None)
                if submission is not None:
                    self._finish(submission, StreamEvent(output=pooling_output(
                        item.request, submission.prompt_text, submission.prompt_token_ids)))
        if not self._admitted:
            return
        by_id = {item.request.request_id: item for item in finished}
        requests, now = self._engine.scheduler.requests, time.perf_counter()
        for prompt_id, admitted in list(self._admitted.items()):
            updates = []
            for sample in admitted.samples:
                if sample.done:
                    continue
                ended = by_id.get(sample.request_id)
                request = ended.request if ended is not None else requests.get(sample.request_id)
                num_new = 0 if request is None else request.num_output_tokens - sample.num_tokens
                if num_new:
                    self._observe_tokens(admitted.submission, sample, num_new, now)
                if num_new or ended is not None:
                    update = self._update(admitted, sample, request, ended)
                    if update is not None:
                        updates.append(update)
            if all(sample.done for sample in admitted.samples):
                del self._admitted[prompt_id]
                self._deliver_final(admitted, updates)
            elif updates and admitted.submission.incremental:
                admitted.submission.stream.deliver(StreamEvent(updates))

    def _update(self, admitted: _Admitted, sample: SampleProgress, request, ended: FinishedRequest | None
                ) -> SampleUpdate | None:
        """The sample's update since the last one (None: a one-shot stream's sample that has not ended)."""
        start = sample.num_tokens
        new_ids = request.token_ids[request.num_prompt_tokens + start:]
        sample.num_tokens += len(new_ids)
        if ended is not None:
            completion = admitted.completions[sample.index] = completion_output(sample.index, ended, self._tokenizer)
            sample.done = True
            logprobs = None if completion.logprobs is None else completion.logprobs[start:]
            return SampleUpdate(sample.index, new_ids, sample.rest_of(completion.text), logprobs,
                                completion.finish_reason, completion.stop_reason)
        if not admitted.submission.incremental:
            return None
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = [logprob_entries(token_id, sampled, self._tokenizer)
                        for token_id, sampled in zip(new_ids, request.output_logprobs[start:])]
        return SampleUpdate(sample.index, new_ids, sample.text_of(new_ids), logprobs)

    def _observe_tokens(self, submission: Submission, sample: SampleProgress, num_new: int, now: float) -> None:
        first = inter = None
        if sample.last_token_time is None:
            first = now - submission.submitted_at
        else:
            inter = (now - sample.last_token_time) / num_new
        sample.last_token_time = now
        if self.observer is not None:
            self.observer.tokens_generated(num_new, first, inter)

    def _deliver_final(self, admitted: _Admitted, updates: list[SampleUpdate]) -> None:
        submission = admitted.submission
        output = RequestOutput(submission.stream.prompt_id, submission.prompt_text, submission.prompt_token_ids,
                               finished=False)
        complete(output, admitted.completions)
        self._finish(submission, StreamEvent(updates if submission.incremental else [], output))

    def _finish(self, submission: Submission, event: StreamEvent) -> None:
        if self.observer is not None:
            self.observer.request_finished(time.perf_counter() - submission.submitted_at)
        submission.stream.deliver(event)

    def abort(self, stream: RequestStream) -> None:
        pooled = self._pooled.pop(f"{stream.prompt_id}.0", None)
        if pooled is not None:
            self._engine.abort(f"{stream.prompt_id}.0")  # None when it finished already: that result is dropped
            self._finish(pooled, StreamEvent(output=aborted_output(pooled)))
            return
        admitted = self._admitted.pop(stream.prompt_id, None)
        if admitted is None:
            return  # finished before the abort reached the engine: its last event is on its way
        updates = []
        for sample in admitted.samples:
            request = None if sample.done else self._engine.abort(sample.request_id)
            if request is not None:
                ended = FinishedRequest(request, self._engine.detokenizer.finish(request))
                updates.append(self._update(admitted, sample, request, ended))
        _fill_aborted(admitted.completions)
        self._deliver_final(admitted, updates)

    def abort_all(self) -> None:
        streams = [a.submission.stream for a in self._admitted.values()] + [s.stream for s in self._pooled.values()]
        for stream in streams:
            self.abort(stream)

    def fail_all(self, error: BaseException) -> None:
        """The engine can no longer be used: every admitted stream ends with `error`."""
        for submission in [a.submission for a in self._admitted.values()] + list(self._pooled.values()):
            submission.stream.deliver(StreamEvent(error=error))
        self._admitted.clear()
        self._pooled.clear()


def _fill_aborted(completions: list[CompletionOutput | None]) -> None:
    for index, completion in enumerate(completions):
        if completion is None:
            completions[index] = CompletionOutput(index, "", [], finish_reason="abort")


def aborted_output(submission: Submission) -> RequestOutput | PoolingRequestOutput:
    """The last event's output of a request aborted before it ran: no tokens, finish_reason "abort" (a pooling
    request: no outputs, error `ABORTED`)."""
    if isinstance(submission.params, PoolingParams):
        return PoolingRequestOutput(submission.stream.prompt_id, submission.prompt_text, submission.prompt_token_ids,
                                    None, error=ABORTED)
    completions: list[CompletionOutput | None] = [None] * submission.params.n
    _fill_aborted(completions)
    output = RequestOutput(submission.stream.prompt_id, submission.prompt_text, submission.prompt_token_ids,
                           finished=False)
    complete(output, completions)
    return output


def was_aborted(output: RequestOutput | PoolingRequestOutput) -> bool:
    """Whether a stream's final output is an abort's (the loop's shutdown, or the consumer's own abort)."""
    if isinstance(output, PoolingRequestOutput):
        return output.error == ABORTED
    return any(c.finish_reason == "abort" for c in output.outputs)
