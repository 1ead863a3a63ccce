"""Expert methods: how a `FusedMoE` layer stores its experts' weights, by quantization.

A MoE layer holds every expert's projections stacked, `w13 [E, 2 * I, H]` and `w2 [E, H, I]` (layers/fused_moe.py),
so its storage is not a linear layer's; but one expert's projection in a checkpoint is an ordinary `[out, in]`
weight with the usual companions (scales), read and quantized exactly as a linear layer's would be. An
`ExpertMethod` therefore says only two things:

- `parts(rows, cols)`: the parameters that stand for a stacked `[rows, cols]` weight (without the experts'
  dimension): name suffix → (shape, dtype or None for the model's, `input_pack`: input features per stored
  column, None for a part with no input dimension). The layer allocates them for `w13` and `w2` and slices them
  for tensor parallelism by that description.
- `linear`: the linear method whose `read_weight` (a checkpoint tensor and its companions → parts) and
  `quantize_weight` (a full-precision weight → parts: random weights, quantization on load) convert one
  expert's projection.

The multiply is the same for every method (`kernels.fused_moe` reads the formats from the parts' dtypes): FP8
experts are E4M3 with one float32 scale per row, MXFP4 experts packed E2M1 codes with one E8M0 scale per block of
32 input features, integer (GPTQ / AWQ) experts 4- or 8-bit codes packed along the input features with a scale and
a zero point per group.

Recipe: experts in a new format. A `parts` description here and one line in `EXPERT_METHODS` (the key is
`QuantConfig.method`), the linear method that reads its checkpoint tensors (quantization/registry.py), and the
kernel's reading of the format (kernels/moe.py and its reference, moe_reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.kernels.moe_reference import MXFP4_BLOCK
from batchllm.model.quantization.config import FP8, INT, MXFP4, QuantConfig
from batchllm.model.quantization.fp8 import FP8_DTYPE
from batchllm.model.quantization.int_experts import IntExpertWeights
from batchllm.model.quantization.method import QuantMethod
from batchllm.model.quantization.mxfp4 import Mxfp4ExpertWeights
from batchllm.model.quantization.registry import linear_method


@dataclass(frozen=True, slots=True)
class PartSpec:
    shape: tuple[int, ...]  # without the experts' dimension
    dtype: torch.dtype | None  # None: the model's dtype
    input_pack: int | None  # input features per stored column (the last dimension); None: no input dimension


class ExpertMethod:
    """Unquantized experts: one `weight` part in the model's dtype."""

    def __init__(self, config: QuantConfig | None) -> None:
        self.config = config
        # What converts one expert's projection: `read_weight`, `quantize_weight`, `companion_tensors`.
        self.linear: QuantMethod | Mxfp4ExpertWeights | IntExpertWeights = linear_method(config)

    def parts(self, rows: int, cols: int) -> dict[str, PartSpec]:
        return {"weight": PartSpec((rows, cols), None, 1)}


class Fp8ExpertMethod(ExpertMethod):
    """E4M3 experts with one float32 scale per output row, from any FP8 checkpoint layout the FP8 linear method
    reads (per tensor, per channel, 128 × 128 blocks requantized per row) or quantized on load."""

    def parts(self, rows: int, cols: int) -> dict[str, PartSpec]:
        return {"weight": PartSpec((rows, cols), FP8_DTYPE, 1), "weight_scale": PartSpec((rows,), torch.float32, None)}


class Mxfp4ExpertMethod(ExpertMethod):
    """MXFP4 experts (quantization/mxfp4.py): `weight [rows, cols / 2]` uint8, two E2M1 codes a byte, and
    `weight_scale [rows, cols / 32]` uint8 E8M0, one per block of 32 input features. From gpt-oss's checkpoints
    or quantized on load; the model's linear layers stay unquantized (the registry's MXFP4 linear method)."""

    def __init__(self, config: QuantConfig) -> None:
        super().__init__(config)
        self.linear = Mxfp4ExpertWeights(config)

    def parts(self, rows: int, cols: int) -> dict[str, PartSpec]:
        if cols % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 experts hold their input features in blocks of {MXFP4_BLOCK}: a rank's "
                             f"[{rows}, {cols}] expert weight does not divide into them (hidden_size and the "
                             f"experts' intermediate_size / tensor_parallel_size must be multiples of {MXFP4_BLOCK})")
        return {"weight": PartSpec((rows, cols // 2), torch.uint8, 2),
                "weight_scale": PartSpec((rows, cols // MXFP4_BLOCK), torch.uint8, MXFP4_BLOCK)}


class IntExpertMethod(ExpertMethod):
    """4- or 8-bit integer experts (quantization/int_experts.py): `weight [rows, cols / pack]` int32, codes packed
    along the input features, `weight_scale [rows, G]` float32 and `weight_zero [rows, G]` uint8 per group of
    input features. From GPTQ, AWQ and compressed-tensors checkpoints, or random weights quantized on load.
    Groups must be whole on every tensor-parallel rank; act-order experts (GPTQ desc_act) are refused."""

    def __init__(self, config: QuantConfig) -> None:
        if config.act_order:
            raise ValueError(f"MoE experts quantized with act-order ({config.checkpoint_format} desc_act / actorder: "
                             f"input features in groups given by a g_idx) are not supported; experts quantized "
                             f"without it are")
        super().__init__(config)
        self.linear = IntExpertWeights(config)

    def parts(self, rows: int, cols: int) -> dict[str, PartSpec]:
        quant = self.config
        group = cols if quant.group_size == -1 else quant.group_size
        if cols % quant.pack or cols % group:
            raise ValueError(f"{quant.bits}-bit experts in groups of {quant.group_size} hold whole groups of whole "
                             f"int32 words on each rank: a rank's [{rows}, {cols}] expert weight does not divide into "
                             f"them (hidden_size and the experts' intermediate_size / tensor_parallel_size must be "
                             f"multiples of {max(group, quant.pack)})")
        # One group over all input features (group_size -1) is whole on every rank: not cut.
        group_pack = None if quant.group_size == -1 else group
        return {"weight": PartSpec((rows, cols // quant.pack), torch.int32, quant.pack),
                "weight_scale": PartSpec((rows, cols // group), torch.float32, group_pack),
                "weight_zero": PartSpec((rows, cols // group), torch.uint8, group_pack)}


EXPERT_METHODS: dict[str | None, type[ExpertMethod]] = {None: ExpertMethod, FP8: Fp8ExpertMethod,
                                                        MXFP4: Mxfp4ExpertMethod, INT: IntExpertMethod}


def expert_method(quant_config: QuantConfig | None) -> ExpertMethod:
    """The method of a MoE layer built with `quant_config` (None: unquantized); a format whose experts the layer
    cannot hold is refused by name."""
    method = None if quant_config is None else quant_config.method
    method_class = EXPERT_METHODS.get(method)
    if method_class is None:
        known = ", ".join("unquantized" if name is None else repr(name) for name in EXPERT_METHODS)
        raise ValueError(f"MoE experts quantized as {quant_config.checkpoint_format or method!r} ({method}) are not "
                         f"supported; supported expert formats: {known}")
    return method_class(quant_config)
