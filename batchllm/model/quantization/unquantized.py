"""The unquantized linear method: a `weight [out, in]` in the model's dtype and `F.linear`."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from batchllm.model.checkpoint_tensor import CheckpointSlice
from batchllm.model.quantization.method import QuantMethod, Reader, loadable


def check_shape(tensor: CheckpointSlice, expected: tuple[int, ...]) -> None:
    """The full HF shape, checked before loading: a tensor-parallel loader only sees its slice."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def check_plain_tensor(tensor: CheckpointSlice, expected: tuple[int, ...]) -> None:
    """A checkpoint tensor copied as it is into a parameter: of the full shape `expected`, and not FP8, whose
    values mean nothing without its scales."""
    check_shape(tensor, expected)
    if tensor.is_fp8:
        raise ValueError("is an FP8 tensor, but the model keeps this layer unquantized: config.json has no "
                         "quantization_config saying how it is scaled, or the layer is one held in the model dtype "
                         "whatever the checkpoint (a MoE router, a norm, the embeddings)")


class UnquantizedLinearMethod(QuantMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, full_input_size: int,
                       full_output_sizes: Mapping[Hashable, int]) -> None:
        shapes = {shard: (size, full_input_size) for shard, size in full_output_sizes.items()}
        layer.weight = loadable(torch.empty(output_size, input_size), layer.weight_loader, shapes)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()

    def read_weight(self, name: str, tensor: CheckpointSlice, read: Reader, shape: tuple[int, int]
                    ) -> dict[str, torch.Tensor | CheckpointSlice]:
        check_plain_tensor(tensor, shape)
        return {"weight": tensor}  # lazily read: a tensor-parallel rank reads only its slice

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": weight}
