"""The FP8 linear method: an E4M3 `weight [out, in]` and a float32 `weight_scale [out]`, one scale per output row.

Activations are quantized per token on the fly (`fp8.fp8_linear`). The scales shard like a bias: with the output
features of a column layer, whole on every rank of a row layer (the layer's `weight_loader` does both). Every
FP8 checkpoint layout, and a bf16/fp16/fp32 weight quantized on load, becomes this one (`checkpoint.fp8_weight`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from torch import nn

from batchllm.model.checkpoint_tensor import CheckpointSlice
from batchllm.model.quantization.checkpoint import fp8_weight
from batchllm.model.quantization.fp8 import FP8_DTYPE, fp8_linear, quantize_fp8_per_channel
from batchllm.model.quantization.method import QuantMethod, Reader, loadable
from batchllm.model.quantization.unquantized import check_shape


class Fp8LinearMethod(QuantMethod):
    # Scales are consumed by `fp8_weight`; a static `input_scale` is not used (activations are scaled per token).
    companion_tensors = ("weight_scale", "weight_scale_inv", "input_scale")
    takes_fp8_rows = True

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, full_input_size: int,
                       full_output_sizes: Mapping[Hashable, int]) -> None:
        layer.weight = loadable(torch.empty(output_size, input_size, dtype=FP8_DTYPE), layer.weight_loader,
                                {shard: (size, full_input_size) for shard, size in full_output_sizes.items()})
        layer.weight_scale = loadable(torch.empty(output_size, dtype=torch.float32), layer.weight_loader,
                                      {shard: (size,) for shard, size in full_output_sizes.items()})

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale[:, None]

    def read_weight(self, name: str, tensor: CheckpointSlice, read: Reader, shape: tuple[int, int]
                    ) -> dict[str, torch.Tensor | CheckpointSlice]:
        check_shape(tensor, shape)
        # Whole, not this rank's slice: a row's scale needs the full row, and a fused layer's shards are
        # converted one HF tensor at a time.
        weight, scale = fp8_weight(name, tensor.read(), read, self.config)
        return {"weight": weight, "weight_scale": scale}

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize_fp8_per_channel(weight)
        return {"weight": q, "weight_scale": scale}
