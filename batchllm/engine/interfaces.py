"""Typed objects that cross the engine ↔ model-runner boundary.

The engine (pure Python) produces a `SchedulerOutput` per step; the runner (torch) turns it into flat
batch tensors, runs the model and returns a `ModelRunnerOutput`. Nothing else crosses the boundary, so
the runner can live in another process (tensor parallelism) and the engine stays testable without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from batchllm.lora.request import LoRARequest
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Everything the runner must know about a request it has not seen, or sees again after preemption.

    `all_token_ids` holds prompt + output tokens so far; the first `num_prompt_tokens` are the prompt
    (penalties treat the two parts differently).
    """

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    pooling: PoolingParams | None = None  # a pooling request: its last chunk is pooled, not sampled
    mm: MultiModalPrompt | None = None  # the prompt's images, for the runner's encoder step


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Invariants: `token_ids` are the tokens at positions
    `[num_computed_tokens, num_computed_tokens + len(token_ids))`; `block_ids` is the full block table
    when `full_block_table` is set (a new request, or a block replaced by its copy-on-write copy), else
    only the blocks appended since the runner last saw the request.
    `sample` is true when this step computes the request's last token, so its logits yield a new token.
    `placeholder` (asynchronous scheduling): one more token follows `token_ids`, the one the runner
    sampled for this request in the previous step, which the engine does not know yet; the runner reads
    it from its own copy on the device. It is always the request's last scheduled token.
    Speculative decoding: `draft_token_ids` follow `token_ids` (positions after them); the runner verifies
    them and returns the accepted ones and one more token. `num_lookahead`: a device proposer drafts that
    many tokens after this step's result, into KV slots the scheduler allocated beyond `num_tokens`.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    new: NewRequestData | None = None
    full_block_table: bool = False
    placeholder: bool = False
    draft_token_ids: list[int] = field(default_factory=list)
    num_lookahead: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.placeholder + len(self.draft_token_ids)


@dataclass(slots=True)
class GrammarBitmask:
    """The tokens each constrained row may sample this step: bit `t % 32` of word `t // 32` of a row is set
    when token `t` is allowed. Row `i` belongs to `request_ids[i]`. The array is the engine's buffer, valid
    until the next step's bitmask: the runner copies it before it returns."""

    request_ids: list[str]
    bitmask: np.ndarray  # int32 [len(request_ids), ceil(vocab_size / 32)]


@dataclass(slots=True)
class BlockTransfers:
    """A step's copies between the device pool and another pool (the host tier's, engine/host_tier.py, or the P/D
    link's buffer, engine/kv_handoff.py), as block-id pairs: both connectors' metadata. The runner runs every
    offload, then every load, then the step's copy-on-write copies and forward pass."""

    offloads: list[tuple[int, int]]  # (device block, host block)
    loads: list[tuple[int, int]]  # (host block, device block)


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests that ended since the previous step: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Copy-on-write: copy KV block src to dst (all layers) before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The KV connectors' work for the step (engine/kv_connector.py), each connector's under its name, opaque to all
    # but its worker side (executor/kv_connector.py), which runs it before the copy-on-write copies. None: no work.
    kv_connector_metadata: dict[str, object] | None = None
    # Sampled requests whose tokens a grammar constrains. With `grammar` None the runner runs the forward pass
    # and waits for the bitmask (`AwaitingGrammar`): the engine computes it once the previous step is applied.
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar: GrammarBitmask | None = None
    # Some row verifies drafts or asks for lookahead: its result changes how the next step is scheduled.
    speculative: bool = False
    # Device proposers with K/V of their own (a draft model, EAGLE) run over the step only while speculation
    # pays: otherwise their pass would cost every step for nothing.
    observe_drafts: bool = True
    # A decode burst (engine/decode_burst.py): every row is one decode token that runs this many forward passes,
    # each sampling the next one's input; its results hold that many tokens a row (`ModelRunnerOutput.accepted`).
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do: no request and no K/V copy (a swap-out can empty a step of requests)."""
        return not self.requests and self.kv_connector_metadata is None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    # Log-probability of the sampled token and the top-k alternatives (token id → logprob), when asked for.
    logprob: float | None = None
    rank: int | None = None  # 1 = the most likely token
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    # One entry per scheduled request with `sample=True`, keyed by request id: its last new token.
    sampled: dict[str, SampledToken]
    # Rows that verified drafts: the accepted drafts, which come before their `sampled` token. A decode burst's rows:
    # the tokens of its passes before the last.
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # Device proposers: each lookahead row's drafts for its next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests whose prompt this step finished: the pooled vector (float32 numpy), by request id.
    pooled: dict[str, Any] = field(default_factory=dict)


class PendingOutput(Protocol):
    """A step launched on the executor; `result()` waits for it (once; later calls return the same)."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class AwaitingGrammar:
    """A launched step whose forward pass runs while the engine computes its grammar bitmask; `sample`
    hands the bitmask over and returns the step's pending output."""

    sample: Callable[[GrammarBitmask], PendingOutput]


@dataclass(slots=True)
class ReadyOutput:
    """A step that already finished (a synchronous executor)."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output
