"""`QuantMethod`: how a linear layer holds its weight, multiplies by it, and reads it from a checkpoint.

A linear layer (`batchllm/model/layers/linear.py`) owns the tensor-parallel geometry: its rank's sizes, which part
of each HF tensor it holds (`output_part(shard_id)`, `input_part()`), its dense loader (`weight_loader`, for
`[out, in]` and `[out]` tensors split like the weight's rows) and its bias. Its method owns everything that
depends on how the weight is stored: the parameters, the matmul, the work after loading, and the conversion of
a checkpoint's tensors into those parameters. The layer never branches on a format, and neither does the loader.

The loader's side of the contract, per HF weight (shard) of a layer:
- a checkpoint tensor whose last name is in `companion_tensors` (scales, zero points, ...) is skipped when met:
  `read_weight` reads it with its weight;
- one whose last name is in `weight_tensors` is handed to `read_weight`, which returns the method's parts
  of the *full* HF weight (not a rank's slice) by parameter name; the loader gives each to its parameter's
  `weight_loader` with the shard id, which copies this rank's slice;
- `load_format="dummy"` hands `quantize_weight` a random full-precision weight instead;
- after every tensor is in, `process_after_loading(layer)` runs once.
Every parameter a method registers carries `weight_loader(param, full_tensor, shard_id)` and
`checkpoint_shapes` (shard id → full HF shape): the loader's missing-tensor check and the dummy initialiser
read them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from batchllm.model.quantization.config import QuantConfig

if TYPE_CHECKING:
    from batchllm.model.checkpoint_tensor import CheckpointSlice


class Reader(Protocol):
    """Another tensor of the checkpoint by name; ValueError naming it if absent, or None when not required."""

    def __call__(self, name: str, required: bool = True) -> torch.Tensor | None: ...


class QuantMethod(ABC):
    """One way of storing and multiplying a linear layer's weight. Stateless but for its config: per-layer state
    (parameters, an act-order permutation) lives on the layer, so one method may serve many layers."""

    # Last names of the checkpoint tensor that stands for a layer's whole weight, and of those read with it.
    weight_tensors: ClassVar[tuple[str, ...]] = ("weight",)
    companion_tensors: ClassVar[tuple[str, ...]] = ()
    # `apply` also takes activations already quantized per token (`fp8.Fp8Rows`), which the layer before may write.
    takes_fp8_rows: ClassVar[bool] = False

    def __init__(self, config: QuantConfig | None) -> None:
        self.config = config

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, full_input_size: int,
                       full_output_sizes: Mapping[Hashable, int]) -> None:
        """Register on `layer` the parameters of this rank's `[output_size, input_size]` part of a weight whose HF
        tensors are `[full_output_sizes[shard_id], full_input_size]`, each with a `weight_loader` and
        `checkpoint_shapes`. Allocated uninitialised: the checkpoint or the dummy initialiser fills them."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + bias` with this rank's weight, in x's dtype."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Once, after every part is loaded (repacking, sorting, dequantizing for the CPU)."""

    @abstractmethod
    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """Float32 `[out, in]` of this rank, in the checkpoint's input-feature order (tests, debugging)."""

    @abstractmethod
    def read_weight(self, name: str, tensor: CheckpointSlice, read: Reader, shape: tuple[int, int]
                    ) -> dict[str, torch.Tensor | CheckpointSlice]:
        """The parts, by parameter name, of the full HF weight `[out, in] = shape` whose checkpoint tensor `name`
        (one of `weight_tensors`, not read yet) the loader met; `read` returns its other tensors. ValueError on a
        tensor that does not fit."""

    @abstractmethod
    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts of a full-precision HF weight `[out, in]` (the random weights of `load_format="dummy"`)."""


def loadable(data: torch.Tensor, weight_loader: Callable[..., None],
             checkpoint_shapes: Mapping[Hashable, tuple[int, ...]]) -> nn.Parameter:
    """A frozen parameter that the loader fills through `weight_loader`, from full HF tensors of these shapes."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    param.checkpoint_shapes = dict(checkpoint_shapes)
    return param
