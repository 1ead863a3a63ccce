"""4- and 8-bit integer MoE experts (GPTQ, AWQ, compressed-tensors pack-quantized): how one expert's projection
becomes the parts `IntExpertMethod` stores (quantization/experts.py).

The stored layout is the kernels' (kernels/moe_reference.py, `dequantize_int_experts`): per output row, the codes
packed along the input features, `weight [rows, cols / pack]` int32, with `weight_scale [rows, G]` float32 and
`weight_zero [rows, G]` uint8 per group of input features. It is `PackedInt` (int_packed.py) transposed, so that
the MoE layer's tensor-parallel cuts (gate / up by output rows, down by input columns) are cuts of the last or
first dimension of every part, as for MXFP4. Each checkpoint format is read by `int_checkpoint.int_weight`, as the
integer linear method reads it; random weights (`load_format="dummy"`) are quantized to nearest, symmetric.
"""

from __future__ import annotations

import torch

from batchllm.model.checkpoint_tensor import CheckpointSlice
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.quantization.int_checkpoint import int_weight
from batchllm.model.quantization.int_method import IntLinearMethod
from batchllm.model.quantization.int_packed import PackedInt, quantize_int_rtn
from batchllm.model.quantization.method import Reader


class IntExpertWeights:
    """One expert's projection → integer parts (`weight`, `weight_scale`, `weight_zero`): the `linear` of
    `IntExpertMethod`."""

    weight_tensors = IntLinearMethod.weight_tensors
    companion_tensors = IntLinearMethod.companion_tensors

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def read_weight(self, name: str, tensor: CheckpointSlice, read: Reader, shape: tuple[int, int]
                    ) -> dict[str, torch.Tensor]:
        if name.endswith(".weight"):
            raise ValueError(f"is stored unquantized in a {self.config.checkpoint_format} checkpoint, whose MoE "
                             f"experts batchllm reads only quantized (every expert's projections)")
        return _expert_parts(int_weight(name, read, self.config, shape))

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return _expert_parts(quantize_int_rtn(weight, self.config.bits, self.config.group_size))


def _expert_parts(packed: PackedInt) -> dict[str, torch.Tensor]:
    """`PackedInt` (K-packed `qweight [K / pack, N]`, `[G, N]` groups) transposed into the experts' layout; its
    g_idx is None (act-order experts are refused before any tensor is read)."""
    return {"weight": packed.qweight.T.contiguous(), "weight_scale": packed.scales.T.contiguous(),
            "weight_zero": packed.zeros.T.contiguous()}
