"""A launched step's sampled tokens on their way to the host.

The sampler's results stay on the device, where the next step's inputs read them; a copy to pinned host
memory is queued behind the step with an event, so the host can schedule and prepare the next step before
waiting for this one. Two host buffers alternate: step N+1's copy is queued before step N's tokens are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchllm.engine.interfaces import ModelRunnerOutput, SampledToken
from batchllm.model.layers.sampler import SamplerOutput


class HostTokenBuffers:
    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._buffers = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._next = 0

    def take(self) -> torch.Tensor:
        buffer = self._buffers[self._next]
        self._next ^= 1
        return buffer


class StepOutput:
    """`result()` waits for the step's copy and returns the `ModelRunnerOutput` (once; then cached).
    `on_result(output)` runs once, when the tokens are first read. `drafts`: a speculative step's drafts per
    request, whose sampled rows are its verification rows (`rejection_sampler.py`)."""

    def __init__(self, request_ids: list[str], sampled: SamplerOutput | None, host_ids: torch.Tensor,
                 on_result: Callable[[ModelRunnerOutput], None], drafts: list[list[int]] | None = None,
                 proposals: dict[str, list[int]] | None = None,
                 pooled: tuple[list[str], torch.Tensor] | None = None, num_steps: int = 1) -> None:
        """`pooled`: the pooling requests whose prompts ended this step, and their vectors (on the device).
        `num_steps` > 1: a decode burst's, whose `sampled` holds its passes' tokens one pass after another."""
        self._request_ids = request_ids
        self._num_steps = num_steps
        self._proposals = proposals
        self._on_result = on_result
        self._drafts = drafts
        self._output: ModelRunnerOutput | None = None
        self._event = None
        self._host: SamplerOutput | None = None
        self._num_accepted: torch.Tensor | None = None
        self._pooled = None if pooled is None else (pooled[0], _to_host(pooled[1]))
        if sampled is None:  # nothing sampled: a prefill chunk, pooled prompts, a tensor-parallel rank other than 0
            if pooled is None:
                self._output = ModelRunnerOutput({})
            elif pooled[1].is_cuda:
                self._event = torch.cuda.Event()
                self._event.record()
            return
        n = len(sampled.token_ids)
        ids = host_ids[:n] if n <= len(host_ids) else torch.empty(n, dtype=torch.int64, pin_memory=host_ids.is_pinned())
        ids.copy_(sampled.token_ids, non_blocking=True)
        if sampled.num_accepted is not None:
            self._num_accepted = _to_host(sampled.num_accepted)
        lp = None
        if sampled.logprobs is not None:  # rare: fresh pinned tensors are fine here
            lp = [_to_host(t) for t in (sampled.logprobs, sampled.ranks, sampled.top_ids, sampled.top_logprobs)]
        self._host = SamplerOutput(ids, *(lp or (None,) * 4), sampled.num_logprobs)
        if sampled.token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> ModelRunnerOutput:
        if self._output is None and self._pooled is not None:  # pooled vectors, nothing sampled
            if self._event is not None:
                self._event.synchronize()
            request_ids, vectors = self._pooled
            self._output = ModelRunnerOutput({}, pooled=dict(zip(request_ids, vectors.numpy())))
            self._pooled = None
            self._on_result(self._output)
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            tokens = self._host.to_sampled_tokens()
            if self._num_steps > 1:
                self._output = _burst_output(self._request_ids, tokens, self._num_steps)
            elif self._drafts is None:
                self._output = ModelRunnerOutput(dict(zip(self._request_ids, tokens)))
            else:
                self._output = _speculative_output(self._request_ids, tokens, self._drafts,
                                                   self._num_accepted.tolist())
            if self._proposals:
                self._output.draft_token_ids = self._proposals
            self._on_result(self._output)
            self._host = None
        return self._output


def ignore_result(result: ModelRunnerOutput) -> None:
    """`on_result` of a step whose rows keep no token history on the runner."""


def _speculative_output(request_ids: list[str], tokens: list[SampledToken], drafts: list[list[int]],
                        num_accepted: list[int]) -> ModelRunnerOutput:
    sampled, accepted = {}, {}
    start = 0
    for request_id, row_drafts, n in zip(request_ids, drafts, num_accepted):
        sampled[request_id] = tokens[start + n]
        if row_drafts:
            accepted[request_id] = tokens[start:start + n]
        start += len(row_drafts) + 1
    return ModelRunnerOutput(sampled, accepted)


def _burst_output(request_ids: list[str], tokens: list[SampledToken], num_steps: int) -> ModelRunnerOutput:
    """Row i's tokens are `tokens[i::num_rows]`: its last is `sampled`, the ones before it `accepted`."""
    num_rows = len(request_ids)
    last = (num_steps - 1) * num_rows
    return ModelRunnerOutput(dict(zip(request_ids, tokens[last:])),
                             {request_id: tokens[row:last:num_rows] for row, request_id in enumerate(request_ids)})


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
