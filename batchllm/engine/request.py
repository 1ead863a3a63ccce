"""A generation request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from batchllm.engine.interfaces import SampledToken
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV blocks freed (recomputed) or swapped out to the host tier
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_ABORTED = enum.auto()  # cancelled by its caller (`Scheduler.abort_request`)

    @property
    def finished(self) -> bool:
        # Identity checks: hashing an enum member runs Python code, and this is asked per request per step.
        return (self is RequestStatus.FINISHED_STOPPED or self is RequestStatus.FINISHED_LENGTH
                or self is RequestStatus.FINISHED_ERROR or self is RequestStatus.FINISHED_ABORTED)

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """Invariant: `token_ids == prompt_token_ids + output_token_ids`, and the first `num_computed_tokens`
    of them have their K/V in the cache (0 after a preemption, unless it swapped them out to the host tier)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # time.perf_counter() clock, like the two below
    first_token_time: float | None = None
    finished_time: float | None = None
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # The runner already holds this request's state (block table, generator); cleared on preemption.
    known_to_runner: bool = False
    num_preemptions: int = 0
    # The tokens before this position had their K/V computed, then thrown away by a preemption: computing them
    # again is recomputation (`SchedulerStats.num_recomputed_tokens`).
    num_recompute_until: int = 0
    output_logprobs: list[SampledToken] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request
    error: str | None = None
    # Set for samples 2..n of a prompt: they share the first sample's prompt blocks once it has computed them.
    fork_of: str | None = None
    # Chained hashes of the full blocks of token_ids computed so far (prefix caching), extended lazily.
    block_hashes: list[bytes] = field(default_factory=list)
    # Tokens sampled by steps still in flight (asynchronous scheduling), not yet in token_ids.
    num_pending_tokens: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    # Structured outputs: the grammar matcher (engine/structured/), fed every output token as it is appended.
    matcher: Any = None
    # Speculative decoding: the drafts to verify in the next step, and (device proposers) how many to make.
    draft_token_ids: list[int] = field(default_factory=list)
    num_lookahead: int = 0
    # A pooling request (an embedding, a classification): its prompt is computed, then pooled; nothing is sampled.
    pooling: PoolingParams | None = None
    pooled: Any = None  # the result: a float32 vector (numpy), set when it finishes
    mm: MultiModalPrompt | None = None  # the prompt's images (multimodal/inputs.py); None: text only
    burstable: bool = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # It may decode in bursts (decode_burst.py): nothing about it needs the host between two of its tokens.
        self.burstable = (self.lora_request is None and self.pooling is None and self.mm is None
                          and self.sampling_params.reads_only_logits)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def surely_finishes(self) -> bool:
        """Its pending tokens reach max_tokens: it ends whatever they turn out to be, so scheduling it again
        would only compute a token to throw away (the scheduler checks max_model_len the same way)."""
        if not self.num_pending_tokens:
            return False
        if self.pooling is not None:
            return True  # its prompt's last chunk is in flight: it ends with it
        max_tokens = self.sampling_params.max_tokens
        return max_tokens is not None and self.num_output_tokens + self.num_pending_tokens >= max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token: SampledToken) -> bool:
        """Append a sampled token; False when the request's grammar rejects it (it is appended all the same)."""
        self.token_ids.append(token.token_id)
        if self.sampling_params.logprobs is not None:
            self.output_logprobs.append(token)
        return self.matcher is None or self.matcher.accept_token(token.token_id)
