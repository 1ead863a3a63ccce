"""The HTTP side's book of the requests it submitted: it turns the engine's `StepResults` (token ids, raw logprobs,
pooled vectors) into each stream's events. Detokenisation happens here, off the engine: streamed text through
`SampleProgress`, logprobs' tokens decoded, and the final `RequestOutput` built as `LLM.generate` builds it (its
text decoded whole and cut at the stop string that ended it, `final_text`). With a reasoning parser, each sample's
streamed text goes through its `ReasoningStream` (updates carry reasoning and answer apart) and the final output is
split as `LLM.generate` splits it.

A pooling submission's stream gets one event, whose output is a `PoolingRequestOutput` (as `LLM.embed` returns it;
aborted: outputs None and error `ABORTED`). Thread-safe: streams are added by the HTTP threads and the results
applied by the thread that reads the engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchllm.engine.detokenizer import final_text
from batchllm.entrypoints.output_assembly import complete, decoding_params, logprob_entries, prompt_tail
from batchllm.entrypoints.server.engine_driver import ABORTED
from batchllm.entrypoints.server.engine_protocol import Observations, SampleDelta, SampleFinish, StepResults
from batchllm.entrypoints.server.request_stream import RequestStream, SampleUpdate, StreamEvent
from batchllm.entrypoints.server.sample_progress import SampleProgress
from batchllm.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from batchllm.pooling_params import PoolingParams
from batchllm.reasoning import ReasoningParser, ReasoningStream
from batchllm.sampling_params import SamplingParams

__all__ = ["ABORTED", "AdmittedRequests", "LoopObserver", "was_aborted"]


class LoopObserver(Protocol):
    """Per-request measurements (`metrics.ServerMetrics` implements it), replayed from the engine's observations."""

    def request_admitted(self, num_prompt_tokens: int) -> None: ...
    def tokens_generated(self, num_tokens: int, first_token_seconds: float | None,
                         inter_token_seconds: float | None) -> None: ...
    def request_finished(self, seconds: float) -> None: ...


def replay(observations: Observations, observer: LoopObserver | None) -> None:
    if observer is None:
        return
    for num_prompt_tokens in observations.admitted:
        observer.request_admitted(num_prompt_tokens)
    for num_tokens, first, inter in observations.tokens:
        observer.tokens_generated(num_tokens, first, inter)
    for seconds in observations.finished:
        observer.request_finished(seconds)


@dataclass(slots=True, eq=False)
class _Sample:
    progress: SampleProgress
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # the engine's SampledTokens
    entries: list[dict[int, Logprob]] = field(default_factory=list)  # decoded, as far as they were needed
    completion: CompletionOutput | None = None
    reasoning: ReasoningStream | None = None  # splits the streamed text, with a reasoning parser


@dataclass(slots=True, eq=False)
class _Prompt:
    stream: RequestStream
    prompt_text: str | None
    token_ids: list[int]
    params: SamplingParams | PoolingParams
    incremental: bool
    samples: list[_Sample]  # empty for a pooling request
    prompt_tail: str = ""  # where the prompt leaves a reasoning section open, with a reasoning parser


class AdmittedRequests:
    def __init__(self, tokenizer: Any, reasoning_parser: ReasoningParser | None = None) -> None:
        self._tokenizer = tokenizer
        # Splits outputs where there is text to split.
        self._parser = reasoning_parser if tokenizer is not None else None
        self._backend = None if tokenizer is None else tokenizer.backend_tokenizer
        self._lock = threading.Lock()
        self._prompts: dict[str, _Prompt] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def add(self, stream: RequestStream, token_ids: list[int], params: SamplingParams | PoolingParams,
            prompt_text: str | None, incremental: bool) -> None:
        samples, tail = [], ""
        if isinstance(params, SamplingParams):
            decoding = params if self._parser is None else decoding_params(self._parser, params)
            samples = [_Sample(SampleProgress(f"{stream.prompt_id}.{i}", i, decoding, self._backend, incremental))
                       for i in range(params.n)]
            if self._parser is not None:
                tail = prompt_tail(self._tokenizer, token_ids)
                if incremental:
                    for sample in samples:
                        sample.reasoning = self._parser.stream(self._parser.prompt_prefix(tail))
        with self._lock:
            self._prompts[stream.prompt_id] = _Prompt(stream, prompt_text, token_ids, params, incremental, samples,
                                                      tail)

    def apply(self, results: StepResults) -> None:
        """Deliver the events `results` make: per-step updates, last events, refusals."""
        with self._lock:
            updates: dict[str, list[SampleUpdate]] = {}
            for delta in results.deltas:
                prompt = self._prompts.get(delta.prompt_id)
                if prompt is not None:
                    update = self._update(prompt, prompt.samples[delta.index], delta)
                    updates.setdefault(delta.prompt_id, []).append(update)
            for prompt_id, prompt_updates in updates.items():
                prompt = self._prompts[prompt_id]
                if all(sample.completion is not None for sample in prompt.samples):
                    del self._prompts[prompt_id]
                    output = RequestOutput(prompt_id, prompt.prompt_text, prompt.token_ids, finished=False)
                    complete(output, [sample.completion for sample in prompt.samples])
                    prompt.stream.deliver(StreamEvent(prompt_updates if prompt.incremental else [], output))
                elif prompt.incremental:
                    prompt.stream.deliver(StreamEvent(prompt_updates))
            for prompt_id, output in results.pooled:
                prompt = self._prompts.pop(prompt_id, None)
                if prompt is not None:
                    output.prompt, output.prompt_token_ids = prompt.prompt_text, prompt.token_ids
                    prompt.stream.deliver(StreamEvent(output=output))
            for prompt_id, message in results.refused:
                prompt = self._prompts.pop(prompt_id, None)
                if prompt is not None:
                    prompt.stream.deliver(StreamEvent(error=ValueError(message)))

    def abort_all(self) -> None:
        """The engine stopped without reporting these: each stream ends as aborted, with the tokens it got."""
        results = StepResults()
        with self._lock:
            for prompt_id, prompt in self._prompts.items():
                if isinstance(prompt.params, PoolingParams):
                    results.pooled.append((prompt_id, PoolingRequestOutput(f"{prompt_id}.0", None, [], None,
                                                                           error=ABORTED)))
                for index, sample in enumerate(prompt.samples):
                    if sample.completion is None:
                        results.deltas.append(SampleDelta(prompt_id, index, [], None, SampleFinish("abort")))
        self.apply(results)

    def fail_all(self, error: BaseException) -> None:
        """The engine can no longer be used: every stream ends with `error`."""
        with self._lock:
            prompts, self._prompts = list(self._prompts.values()), {}
        for prompt in prompts:
            prompt.stream.deliver(StreamEvent(error=error))

    def _update(self, prompt: _Prompt, sample: _Sample, delta: SampleDelta) -> SampleUpdate:
        start = len(sample.token_ids)
        sample.token_ids += delta.token_ids
        if delta.logprobs is not None:
            sample.logprobs += delta.logprobs
        finish = delta.finish
        if finish is None:
            reasoning, text = self._split(sample, sample.progress.text_of(delta.token_ids), False)
            return SampleUpdate(delta.index, delta.token_ids, text, self._entries(prompt, sample, start),
                                reasoning=reasoning)
        raw_text = final_text(self._tokenizer, sample.token_ids, self._decoding(prompt), finish.stop_reason)
        sample.completion = self._completion(prompt, sample, finish, raw_text)
        reasoning, text = self._split(sample, sample.progress.rest_of(raw_text), True)
        return SampleUpdate(delta.index, delta.token_ids, text, self._entries(prompt, sample, start), finish.reason,
                            finish.stop_reason, reasoning)

    def _decoding(self, prompt: _Prompt) -> SamplingParams:
        return prompt.params if self._parser is None else decoding_params(self._parser, prompt.params)

    @staticmethod
    def _split(sample: _Sample, text: str, last: bool) -> tuple[str, str]:
        """(new reasoning, new answer) of a streamed sample's new text."""
        if sample.reasoning is None:
            return "", text
        return sample.reasoning.finish(text) if last else sample.reasoning.feed(text)

    def _entries(self, prompt: _Prompt, sample: _Sample, start: int) -> list[dict[int, Logprob]] | None:
        """The decoded logprobs of the sample's tokens from `start` on (None: the request asked for none)."""
        if prompt.params.logprobs is None:
            return None
        for token_id, sampled in zip(sample.token_ids[len(sample.entries):], sample.logprobs[len(sample.entries):]):
            sample.entries.append(logprob_entries(token_id, sampled, self._tokenizer))
        return sample.entries[start:]

    def _completion(self, prompt: _Prompt, sample: _Sample, finish: SampleFinish, text: str) -> CompletionOutput:
        params = prompt.params
        logprobs = cumulative = None
        if params.logprobs is not None:
            logprobs = self._entries(prompt, sample, 0)
            cumulative = sum(s.logprob for s in sample.logprobs if s.logprob is not None)
        reasoning = None
        if self._parser is not None:
            reasoning, text = self._parser.split_output(prompt.prompt_tail, text)
        return CompletionOutput(sample.progress.index, text, sample.token_ids, cumulative, logprobs, finish.reason,
                                finish.stop_reason, finish.error, finish.metrics, reasoning)


def was_aborted(output: RequestOutput | PoolingRequestOutput) -> bool:
    """Whether a stream's final output is an abort's (the engine's shutdown, or the consumer's own abort)."""
    if isinstance(output, PoolingRequestOutput):
        return output.error == ABORTED
    return any(c.finish_reason == "abort" for c in output.outputs)
