"""Engine results → `RequestOutput`s: shared by `LLM`'s calls and the server's engine loop, so a request's
answer is built the same way through every door.

A prompt's `n` samples run as independent engine requests ("{prompt_id}.{sample}"); each becomes one
`CompletionOutput`, and the prompt's output is complete once all of them are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchllm.engine.detokenizer import final_text
from batchllm.engine.engine_core import FinishedRequest
from batchllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from batchllm.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser
from batchllm.sampling_params import SamplingParams


def sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The parameters of sample `sample` of a prompt: n = 1, and a seeded request's sample j uses seed + j."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + sample
    return dataclasses.replace(params, n=1, seed=seed)


def logprob_entries(token_id: int, sampled: Any, tokenizer: Any) -> dict[int, Logprob]:
    """One position's logprobs: the sampled token's (with its rank) and the top-k, ranked 1..k, decoded when
    there is a tokenizer."""
    entries = {tid: Logprob(lp) for tid, lp in (sampled.top_logprobs or {}).items()}
    entries[token_id] = Logprob(sampled.logprob, sampled.rank)
    for rank, tid in enumerate(sampled.top_logprobs or {}, start=1):
        entries[tid].rank = rank
    if tokenizer is not None:
        for tid, entry in entries.items():
            entry.decoded_token = tokenizer.decode([tid])
    return entries


def completion_output(index: int, finished: FinishedRequest, tokenizer: Any,
                      reasoning_parser: ReasoningParser | None = None) -> CompletionOutput:
    request = finished.request
    logprobs = cumulative = None
    if request.sampling_params.logprobs is not None:
        logprobs = [logprob_entries(token_id, s, tokenizer)
                    for token_id, s in zip(request.output_token_ids, request.output_logprobs)]
        cumulative = sum(s.logprob for s in request.output_logprobs if s.logprob is not None)
    metrics = RequestMetrics(request.arrival_time, request.first_token_time, request.finished_time)
    text, reasoning = finished.text, None
    if reasoning_parser is not None and tokenizer is not None:
        params = request.sampling_params
        if decoding_params(reasoning_parser, params) is not params:
            text = final_text(tokenizer, request.output_token_ids, decoding_params(reasoning_parser, params),
                              request.stop_reason)
        reasoning, text = reasoning_parser.split_output(prompt_tail(tokenizer, request.prompt_token_ids), text)
    return CompletionOutput(index, text, request.output_token_ids, cumulative, logprobs, request.finish_reason,
                            request.stop_reason, request.error, metrics, reasoning)


def decoding_params(reasoning_parser: ReasoningParser, params: SamplingParams) -> SamplingParams:
    """The parameters to decode an output with for `reasoning_parser`: special tokens kept where its markers are
    special tokens (gpt-oss's harmony), so that it sees them; the parts it returns hold no marker."""
    if reasoning_parser.keeps_special_tokens and params.skip_special_tokens:
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def prompt_tail(tokenizer: Any, prompt_token_ids: list[int]) -> str:
    """The end of a prompt as text, where a chat template leaves a reasoning section open."""
    return tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)


def complete(output: RequestOutput, completions: list[CompletionOutput | None]) -> None:
    """Fill `output` with its samples' completions (in sample order) and mark it finished."""
    output.outputs = [c for c in completions if c is not None]
    output.finished = True
    output.error = next((c.error for c in output.outputs if c.error), None)
