"""What the server's HTTP side and its engine say to each other: small picklable messages, the same whether the engine
runs in a process of its own (`engine_process.py`, over a pipe) or in a thread beside the HTTP server
(`engine_loop.py`, through a queue).

Client → engine: `Submit` (one prompt: its n samples, or one pooling request; its images, prepared on the HTTP side,
too), `Abort`, `Compile` (a structured-output constraint, compiled now), `Stop` (abort what is left and end). Engine →
client: `Ready` or `BuildFailed` once (a process only), then a `StepResults` after every step that changed something,
and `Crashed` before an unexpected exit. Only token ids, raw logprobs and pooled vectors travel back: texts are
decoded on the HTTP side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchllm.config import SchedulerConfig
from batchllm.engine.interfaces import SampledToken
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.outputs import PoolingRequestOutput, RequestMetrics
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams

LIVE, BATCH = 0, 1  # a Submit's priority: live HTTP requests are admitted at once, batch rows behind them


@dataclass(slots=True)
class Submit:
    prompt_id: str
    token_ids: list[int]
    params: SamplingParams | PoolingParams
    lora: LoRARequest | None
    priority: int
    incremental: bool  # tokens after every step; False: only when the request ends
    submitted_at: float  # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process of the machine)
    mm: MultiModalPrompt | None = None  # the prompt's images, prepared on the HTTP side (numpy arrays: they pickle)
    error: str | None = None  # the HTTP side already failed the prompt (an image that does not load): it ends with this


@dataclass(slots=True)
class Abort:
    prompt_id: str


@dataclass(slots=True)
class Compile:
    token: int  # echoed in `StepResults.compiled`
    params: StructuredOutputsParams


@dataclass(slots=True)
class Stop:
    """Abort every request (their last results are sent) and end."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's load after its latest step (pooling requests included)."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue, or submitted and not yet admitted
    num_used_blocks: int = 0
    num_blocks: int = 1

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


@dataclass(slots=True)
class SampleFinish:
    reason: str  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class SampleDelta:
    """One sample's tokens since its previous delta (all of them, at the end, for a non-incremental request)."""

    prompt_id: str
    index: int
    token_ids: list[int]
    logprobs: list[SampledToken] | None  # one per new token, when the request asked for logprobs
    finish: SampleFinish | None = None


@dataclass(slots=True)
class Observations:
    """Per-request measurements of one or more steps, for the server's metrics (`LoopObserver`'s calls)."""

    admitted: list[int] = field(default_factory=list)  # prompt tokens of each admitted request
    tokens: list[tuple[int, float | None, float | None]] = field(default_factory=list)  # (n, first, inter)
    finished: list[float] = field(default_factory=list)  # seconds from submission

    def __bool__(self) -> bool:
        return bool(self.admitted or self.tokens or self.finished)


@dataclass(slots=True)
class StepResults:
    deltas: list[SampleDelta] = field(default_factory=list)
    pooled: list[tuple[str, PoolingRequestOutput]] = field(default_factory=list)  # (prompt id, output without
    # its prompt: the HTTP side has it)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (prompt id, why the engine refused it)
    compiled: list[tuple[int, str | None]] = field(default_factory=list)  # (Compile token, error or None)
    observations: Observations = field(default_factory=Observations)
    snapshot: EngineSnapshot | None = None

    def __bool__(self) -> bool:
        return bool(self.deltas or self.pooled or self.refused or self.compiled or self.observations)


@dataclass(slots=True)
class EngineInfo:
    """What the HTTP side needs to know of an engine it does not hold (sent in `Ready`)."""

    model_path: Path
    task: str
    max_model_len: int
    scheduler_config: SchedulerConfig
    num_blocks: int
    pooling_params: PoolingParams | None
    embedding_dim: int
    quantization: Any
    kv_cache_dtype: str
    allow_remote_media: bool = False  # image inputs may be http(s) URLs (the HTTP side fetches them)
    image_refusal: str | None = None  # why the engine's options rule images out (`LLM.image_refusal`)


@dataclass(slots=True)
class Ready:
    pid: int
    info: EngineInfo


@dataclass(slots=True)
class BuildFailed:
    error: BaseException | None  # the engine's own exception when it pickles
    traceback: str


@dataclass(slots=True)
class Crashed:
    traceback: str
