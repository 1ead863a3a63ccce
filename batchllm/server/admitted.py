"""The engine thread's book of admitted requests: it adds a prompt's samples to the engine (forked like
`LLM._stream`: request ids "{prompt_id}.{sample}", samples 1..n-1 sharing sample 0's prompt K/V) and turns each
step's results into the events of their streams. Only the engine thread uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from batchllm.engine.engine_core import FinishedRequest
from batchllm.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.outputs import CompletionOutput, RequestOutput
from batchllm.request_outputs import complete, completion_output, logprob_entries, sample_params
from batchllm.sampling_params import SamplingParams
from batchllm.server.request_stream import RequestStream, SampleUpdate, StreamEvent
from batchllm.server.sample_progress import SampleProgress


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
    params: SamplingParams
    lora_request: LoRARequest | None
    incremental: bool
    submitted_at: float


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
        self.observer: LoopObserver | None = None

    def __bool__(self) -> bool:
        return bool(self._admitted)

    def admit(self, submission: Submission) -> None:
        stream, params = submission.stream, submission.params
        if stream.cancelled:  # aborted while it was being taken from the queue
            stream.deliver(StreamEvent(output=aborted_output(submission)))
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

    def publish(self, finished: list[FinishedRequest]) -> None:
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
        if self.observer is not None:
            self.observer.request_finished(time.perf_counter() - submission.submitted_at)
        submission.stream.deliver(StreamEvent(updates if submission.incremental else [], output))

    def abort(self, stream: RequestStream) -> None:
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
        for admitted in list(self._admitted.values()):
            self.abort(admitted.submission.stream)

    def fail_all(self, error: BaseException) -> None:
        """The engine can no longer be used: every admitted stream ends with `error`."""
        for admitted in self._admitted.values():
            admitted.submission.stream.deliver(StreamEvent(error=error))
        self._admitted.clear()


def _fill_aborted(completions: list[CompletionOutput | None]) -> None:
    for index, completion in enumerate(completions):
        if completion is None:
            completions[index] = CompletionOutput(index, "", [], finish_reason="abort")


def aborted_output(submission: Submission) -> RequestOutput:
    """The last event's output of a request aborted before it ran: no tokens, finish_reason "abort"."""
    completions: list[CompletionOutput | None] = [None] * submission.params.n
    _fill_aborted(completions)
    output = RequestOutput(submission.stream.prompt_id, submission.prompt_text, submission.prompt_token_ids,
                           finished=False)
    complete(output, completions)
    return output
