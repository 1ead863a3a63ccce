"""`EngineClient`: what the doors (pandas / Arrow / datasets, jobs, Ray, the Batch API) use of an engine.

`LLM` implements it; so do `connectors.replicas.ReplicaPool` (data-parallel replicas, each its own `LLM`) and
`entrypoints.server.batch_engine.BatchEngine` (a job on a server's engine). The doors read only these names, never the
engine inside (`llm.engine.scheduler...`), so any of the three runs any door.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from batchllm.lora.request import LoRARequest
from batchllm.pooling_params import PoolingParams
from batchllm.structured_outputs import StructuredOutputsParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # a transformers tokenizer, or None (token ids only)
    model_path: Path
    task: str  # "generate", "embed", "classify" or "score"
    pooling_params: PoolingParams | None  # a pooling task's; None when generating
    embedding_dim: int  # a pooled vector's length (0 when generating)
    quantization: str | None  # what a job manifest pins of the weights' quantization
    kv_cache_dtype: str

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """Requests one engine runs at once: the doors size their in-flight windows by it."""

    def stream(self, requests: Iterable[tuple | None], *, max_in_flight: int | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[tuple[Any, Any]]:
        """`(key, output)` per `(key, prompt, params[, lora_request])` item, in completion order (`LLM.stream`)."""

    def check_lora(self, lora_request: LoRARequest) -> None: ...

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None: ...

    def admission_order(self, token_lists: Sequence[Any], loras: Sequence[LoRARequest | None] | None = None
                        ) -> list[int]: ...

    def has_unfinished(self) -> bool: ...
