"""The integer linear method: 4- or 8-bit weights with 16-bit activations, in the `PackedInt` layout.

The layer holds `qweight`, `scales`, `zeros` (and `g_idx` for act-order) as `int_packed.py` lays them out:
K-packed, so a column layer splits every part along its last (output) axis and a row layer splits qweight by
word rows, the groups by whole groups, and g_idx by input feature. GPTQ, AWQ and compressed-tensors checkpoints
become this layout (`int_checkpoint.py`). After loading, the GPU sorts act-order rows once; the CPU replaces the
packed parts by the dequantized weight and the layer becomes an unquantized one (`F.linear`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from functools import partial

import torch
from torch import nn

from batchllm import kernels
from batchllm.model.checkpoint_tensor import CheckpointSlice, copy_checked
from batchllm.model.quantization.int_checkpoint import int_weight
from batchllm.model.quantization.int_packed import (
    PACKED_PARTS,
    PackedInt,
    dense_weight,
    quantize_int_rtn,
    sort_act_order,
)
from batchllm.model.quantization.method import QuantMethod, Reader, loadable
from batchllm.model.quantization.unquantized import UnquantizedLinearMethod


class IntLinearMethod(QuantMethod):
    weight_tensors = ("qweight", "weight_packed", "weight")  # a plain `weight` is refused by `read_weight`
    companion_tensors = ("qzeros", "scales", "g_idx", "weight_scale", "weight_zero_point", "weight_shape",
                         "weight_g_idx")

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, full_input_size: int,
                       full_output_sizes: Mapping[Hashable, int]) -> None:
        quant = self.config
        if input_size % quant.pack:
            raise ValueError(f"{input_size} input features per rank do not pack into words of {quant.pack} "
                             f"{quant.bits}-bit codes")
        if quant.group_size == -1:
            groups = 1  # one scale row over all input features: whole on every rank
        elif quant.act_order:
            groups = -(-full_input_size // quant.group_size)  # a rank's input features may be in any group
        else:
            if input_size % quant.group_size and layer.tp.size > 1:
                raise ValueError(f"group_size={quant.group_size} does not divide the {input_size} input features "
                                 f"each of tensor_parallel_size={layer.tp.size} ranks holds")
            groups = -(-input_size // quant.group_size)  # the last group may be partial (GPTQ, compressed-tensors)
        full_groups = 1 if quant.group_size == -1 else -(-full_input_size // quant.group_size)
        layer.local_group_size = input_size if quant.group_size == -1 else quant.group_size
        layer.dense_dtype = torch.get_default_dtype()  # the model's: the CPU dequantizes to it
        layer.perm = None  # act-order: x's input features in qweight's row order (set after loading, GPU)
        layer.g_idx_loaded = False
        loader = partial(self._load_part, layer)

        def part(data: torch.Tensor, full_shape: Callable[[int], tuple[int, ...]]) -> nn.Parameter:
            return loadable(data, loader, {shard: full_shape(size) for shard, size in full_output_sizes.items()})

        layer.qweight = part(torch.empty(input_size // quant.pack, output_size, dtype=torch.int32),
                             lambda n: (full_input_size // quant.pack, n))
        layer.scales = part(torch.empty(groups, output_size, dtype=torch.float32), lambda n: (full_groups, n))
        layer.zeros = part(torch.empty(groups, output_size, dtype=torch.uint8), lambda n: (full_groups, n))
        layer.register_parameter("g_idx", part(torch.empty(input_size, dtype=torch.int32),
                                               lambda n: (full_input_size,)) if quant.act_order else None)

    def _load_part(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None
                   ) -> None:
        """Copy this rank's part of a full `PackedInt` part (`qweight [K / pack, N]`, `scales` / `zeros [G, N]`,
        `g_idx [K]`) of HF shard `shard_id`."""
        k_start, k_size = layer.input_part()
        rank_in_k = k_start // k_size
        if param is layer.g_idx:
            loaded = loaded.narrow(0, k_start, k_size)
            if layer.g_idx_loaded and not torch.equal(param.data.cpu(), loaded.cpu()):
                raise ValueError("has a g_idx unlike the other projections fused with it; batchllm fuses q/k/v and "
                                 "gate/up, which GPTQ's act-order gives one input-feature order (one input)")
            copy_checked(param.data, loaded)
            layer.g_idx_loaded = True
            return
        offset, size, start = layer.output_part(shard_id)
        loaded = loaded.narrow(1, start, size)
        if param is layer.qweight:
            loaded = loaded.narrow(0, k_start // self.config.pack, k_size // self.config.pack)
        elif param.shape[0] != loaded.shape[0]:  # groups split with the input features
            loaded = loaded.narrow(0, rank_in_k * param.shape[0], param.shape[0])
        copy_checked(param.data.narrow(1, offset, size), loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:
            rows = rows.index_select(1, layer.perm)
        out = kernels.int_matmul(rows, layer.qweight, layer.scales, layer.zeros, self.config.bits,
                                 layer.local_group_size, layer.g_idx)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], layer.output_size)

    def process_after_loading(self, layer: nn.Module) -> None:
        """Sort act-order rows once (GPU), or dequantize for the CPU's F.linear."""
        if layer.qweight.device.type != "cuda":
            dense = self.dequantized_weight(layer).to(layer.dense_dtype)
            for name in ("qweight", "scales", "zeros", "g_idx", "perm", "local_group_size", "dense_dtype",
                         "g_idx_loaded"):
                delattr(layer, name)
            layer.weight = nn.Parameter(dense, requires_grad=False)
            layer.quant_method = UnquantizedLinearMethod(None)
            return
        if layer.g_idx is not None:
            qweight, g_idx, layer.perm = sort_act_order(layer.qweight.data, layer.g_idx.data, self.config.bits,
                                                        layer.local_group_size)
            layer.qweight.data = qweight
            layer.g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return dense_weight(layer.qweight, layer.scales, layer.zeros, self.config.bits, layer.local_group_size,
                            layer.g_idx, layer.perm)

    def read_weight(self, name: str, tensor: CheckpointSlice, read: Reader, shape: tuple[int, int]
                    ) -> dict[str, torch.Tensor | CheckpointSlice]:
        if name.endswith(".weight"):
            raise ValueError(f"is stored unquantized in a {self.config.checkpoint_format} checkpoint; batchllm reads "
                             f"checkpoints whose decoder linear layers are all quantized (an ignore list other than "
                             f"lm_head is not supported)")
        return _parts(int_weight(name, read, self.config, shape))

    def quantize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Round to nearest; an act-order layer gets the trivial g_idx (its groups in input-feature order)."""
        quant = self.config
        packed = quantize_int_rtn(weight, quant.bits, quant.group_size)
        if quant.act_order:
            in_features = weight.shape[1]
            size = in_features if quant.group_size == -1 else quant.group_size
            g_idx = torch.arange(in_features, dtype=torch.int32, device=weight.device) // size
            packed = PackedInt(packed.qweight, packed.scales, packed.zeros, g_idx)
        return _parts(packed)


def _parts(weight: PackedInt) -> dict[str, torch.Tensor]:
    """The parts a layer holds: g_idx only for act-order weights."""
    return {part: getattr(weight, part) for part in PACKED_PARTS if getattr(weight, part) is not None}
