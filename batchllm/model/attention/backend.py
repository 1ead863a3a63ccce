"""The attention backend seam: what an implementation of paged attention provides, and which one runs.

A backend writes a step's K/V into an attention layer's cache and attends over it, reading the paging
metadata that the executor's `AttentionMetadataBuilder` made and the per-layer `AttentionParams` that the
layer carries. Model code never calls a kernel directly: an `Attention` layer hands itself to the backend
that `batchllm.model.attention.attention_backend` picks, the one place that chooses between implementations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from batchllm.forward_context import AttentionMetadata

if TYPE_CHECKING:
    from batchllm.model.layers.attention import Attention


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One attention layer's parameters. Everything but `scale` is off by default.

    `sliding_window`: a query sees only the `sliding_window` newest positions, its own included (keys at
    positions `q - sliding_window < k <= q`). `logit_soft_cap`: scores (after `scale`) become
    `cap * tanh(score / cap)`. `sinks`: the layer holds a learned logit per query head (`Attention.sinks`) that
    joins each softmax's denominator without a value, so a query may attend to "nothing".
    """

    scale: float
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be a positive number of positions")
        if self.logit_soft_cap is not None and not self.logit_soft_cap > 0:
            raise ValueError(f"logit_soft_cap={self.logit_soft_cap} must be positive")


class AttentionBackend(ABC):
    """An implementation of paged attention over a flat mixed batch (decode rows, prefill chunks)."""

    name: ClassVar[str]
    # Whether `forward` reads the metadata's host copies (`query_start_loc_cpu`, `seq_lens_cpu`): the metadata
    # builder makes them only for a backend that does.
    needs_host_metadata: ClassVar[bool]

    @abstractmethod
    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Write `key`/`value [T, Hkv, D]` into the layer's cache at `metadata.slot_mapping`, then return the
        causal attention of `query [T, Hq, D]` over the cache, `[T, Hq, D]`, under `layer.params`."""

