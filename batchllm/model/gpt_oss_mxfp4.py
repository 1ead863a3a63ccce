"""gpt-oss's MXFP4 checkpoints (the released ones): the experts' stacked `*_blocks` / `*_scales` tensors into
`GptOssExperts`' MXFP4 parts (quantization/experts.py, `Mxfp4ExpertMethod`).

As transformers reads them (integrations/mxfp4.py, `convert_moe_packed_tensors`): `gate_up_proj_blocks
[E, 2I, H / 32, 16]` uint8 and `gate_up_proj_scales [E, 2I, H / 32]` uint8 E8M0, one row per output feature, gate
and up interleaved (row 2j: gate's feature j, row 2j + 1: up's, as the bf16 `gate_up_proj`'s columns are); each
row's 16 bytes a block hold its 32 input features two to a byte, the even one in the low nibble; `down_proj_blocks
[E, H, I / 32, 16]`, `down_proj_scales [E, H, I / 32]`. That is the layout the kernels read per row (`[rows,
cols / 2]` codes, `[rows, cols / 32]` scales), so each expert's rows are only de-interleaved and its blocks
flattened, then placed by `FusedMoE.weight_loader`, which keeps this rank's slice of the intermediate features
(whole blocks: `Mxfp4ExpertMethod.parts` refuses a split that cuts one). The biases stay bf16 (gpt_oss.py).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from batchllm.kernels.moe_reference import MXFP4_BLOCK
from batchllm.model.checkpoint_tensor import CheckpointSlice
from batchllm.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE

# Checkpoint name → ours; before gpt_oss.py's renames of the bf16 tensors, whose names prefix these.
MXFP4_RENAMES = {
    ".experts.gate_up_proj_blocks": ".experts.w13_weight",
    ".experts.gate_up_proj_scales": ".experts.w13_weight_scale",
    ".experts.down_proj_blocks": ".experts.w2_weight",
    ".experts.down_proj_scales": ".experts.w2_weight_scale",
}
_BLOCK_BYTES = MXFP4_BLOCK // 2
# load_format="dummy" hands random normal(0, 0.02) values of these shapes: they stand for uniformly random codes
# (an RMS of 2.93) under the scale 2 ** -7, which gives the weights an RMS of 0.023, near the dummy weights' 0.02.
_DUMMY_SCALE = 127 - 7


def use_mxfp4_checkpoint(experts: FusedMoE, num_experts: int, hidden: int, intermediate: int) -> None:
    """Make `experts`' weight and scale parameters load from the stacked MXFP4 tensors (`load_mxfp4_stacked`),
    each checked for its whole-layer shape and reported missing on its own."""
    shapes = {"w13_weight": (num_experts, 2 * intermediate, hidden // MXFP4_BLOCK, _BLOCK_BYTES),
              "w13_weight_scale": (num_experts, 2 * intermediate, hidden // MXFP4_BLOCK),
              "w2_weight": (num_experts, hidden, intermediate // MXFP4_BLOCK, _BLOCK_BYTES),
              "w2_weight_scale": (num_experts, hidden, intermediate // MXFP4_BLOCK)}
    for name, shape in shapes.items():
        param = getattr(experts, name)
        param.weight_loader, param.checkpoint_shapes = partial(load_mxfp4_stacked, experts), {None: shape}
        param.filled_with_weight = False  # the scales are tensors of their own in these checkpoints


def load_mxfp4_stacked(experts: FusedMoE, param: nn.Parameter, loaded: CheckpointSlice | torch.Tensor,
                       shard_id: None = None) -> None:
    """One stacked `*_blocks` / `*_scales` tensor into `param`, one expert at a time: gate rows are the even rows
    of `gate_up_proj_*`, up rows the odd ones; a block's 16 bytes become 16 of the row's codes."""
    is_down = param is experts.w2_weight or param is experts.w2_weight_scale
    for expert in experts.local_experts:
        tensor = loaded.narrow(0, expert, 1)[0]  # read: a lazy slice's narrow reads
        if not isinstance(loaded, CheckpointSlice):  # load_format="dummy": random values, not codes
            tensor = _dummy_codes(tensor, param is experts.w13_weight or param is experts.w2_weight)
        elif tensor.dtype != torch.uint8:
            raise ValueError(f"is {tensor.dtype}, but MXFP4 blocks and scales are uint8")
        if tensor.dim() == 3:
            tensor = tensor.flatten(-2)  # [rows, blocks, 16] → [rows, cols / 2]
        if is_down:
            experts.weight_loader(param, tensor, (expert, DOWN))
            continue
        experts.weight_loader(param, tensor[0::2], (expert, GATE))
        experts.weight_loader(param, tensor[1::2], (expert, UP))


def _dummy_codes(values: torch.Tensor, codes: bool) -> torch.Tensor:
    if codes:
        return (values.float() * 2 ** 24).long().bitwise_and(0xFF).to(torch.uint8)
    return torch.full(values.shape, _DUMMY_SCALE, dtype=torch.uint8, device=values.device)
