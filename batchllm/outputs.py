"""Public result types (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: token id → Logprob, holding the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps on the `time.perf_counter()` clock of the generating process."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_tokens: int) -> float | None:
        """Mean decode time per token after the first (None with fewer than two tokens)."""
        if self.first_token_time is None or self.finished_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "error"
    stop_reason: int | str | None = None  # the stop token id or string that ended generation
    error: str | None = None
    metrics: RequestMetrics | None = None
    # With a reasoning parser (`LLM(reasoning_parser=...)`): the thinking, while `text` is the answer alone; None
    # when the output has no reasoning section or no parser is set.
    reasoning: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # Set when the request failed as a whole (e.g. its prompt exceeds max_model_len); outputs then carry
    # finish_reason="error" and no tokens. Other requests of the same call are not affected.
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """`data`: the pooled vector (float32 numpy); `embedding` the same as a list, as vLLM spells it."""

    data: Any

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass(slots=True)
class ClassificationOutput:
    """`logits`: the classification head's outputs (float32 numpy, one per label)."""

    logits: Any

    @property
    def data(self) -> Any:
        """The pooled vector, as `EmbeddingOutput.data` (here the logits)."""
        return self.logits

    @property
    def probs(self) -> list[float]:
        shifted = np.exp(self.logits - self.logits.max())
        return (shifted / shifted.sum()).tolist()

    @property
    def num_classes(self) -> int:
        return len(self.logits)


@dataclass(slots=True)
class ScoringOutput:
    score: float  # cosine similarity of two embeddings, or a one-label cross-encoder's sigmoid


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's result from `LLM.embed` / `classify` / `score`; `outputs` is None when it failed (`error`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput | None
    finished: bool = True
    error: str | None = None
