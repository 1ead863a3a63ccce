"""Tensor-parallel linear layers whose parameters know how to load themselves from HF checkpoint tensors.

Megatron-style sharding over the group of `batchllm.distributed.parallel_state`: a column layer holds its
rank's slice of the output features (no communication), a row layer its slice of the input features and
sums the partial outputs with one all-reduce. A column layer followed by a row layer (q/k/v → o, gate/up →
down) thus costs one all-reduce. With one rank every layer is a plain linear.

The layers own the sharding: which part of each HF tensor this rank holds (`output_part(shard_id)`,
`input_part()`), the dense `weight_loader(param, loaded_weight, shard_id=None)` that copies this rank's slice of a
*full* HF tensor (or of a lazily read `CheckpointSlice`), `[out, in]` or `[out]` split like the weight's rows,
and the bias. Fused layers (QKV, gate/up) are filled from several HF tensors, one `shard_id` each;
`checkpoint_shapes` maps each shard id to its full HF weight shape `(out, in)`.

How the weight is stored and multiplied is the layer's `quant_method` (`batchllm.model.quantization.method`),
chosen when the layer is built from the `quant_config` the model passes in: it registers the weight's
parameters, runs the matmul, and finishes after loading. The layers never branch on a format.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from batchllm.distributed.parallel_state import all_reduce, get_tp, kv_heads_per_rank
from batchllm.model.checkpoint_tensor import copy_checked
from batchllm.model.layers.lora import LoRASlots
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.quantization.fp8 import Fp8Rows
from batchllm.model.quantization.method import loadable
from batchllm.model.quantization.registry import linear_method


class _Linear(nn.Module):
    """What the linear layers share. A subclass says where this rank's part of each HF shard lies
    (`output_part`, `input_part`), copies it (`weight_loader`) and splits LoRA deltas the same way (`lora_shard`)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantConfig | None,
                 full_input_size: int, full_output_sizes: dict[Hashable, int]) -> None:
        super().__init__()
        self.tp = get_tp()
        self.input_size, self.output_size = input_size, output_size  # this rank's sizes
        self.checkpoint_shapes = {shard: (size, full_input_size) for shard, size in full_output_sizes.items()}
        self.quant_method = linear_method(quant_config)
        self.quant_method.create_weights(self, input_size, output_size, full_input_size, full_output_sizes)
        # torch.empty: the checkpoint (or the dummy initialiser) fills the values, so random init is wasted work.
        self.bias = loadable(torch.empty(output_size), self.weight_loader,
                             {shard: (size,) for shard, size in full_output_sizes.items()}) if bias else None
        self.lora: LoRASlots | None = None  # set when the engine runs adapters (`executor/lora_slots.py`)

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether `forward` may be given FP8 rows (`Fp8Rows`) for `x`: the method takes them and no adapter's
        delta reads the 16-bit input."""
        return self.quant_method.takes_fp8_rows and self.lora is None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """`x`: FP8 rows where `takes_fp8_rows` (the norm or activation before may write them)."""
        out = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, out)
        return out

    def output_part(self, shard_id: Hashable) -> tuple[int, int, int]:
        """(offset in this rank's output features, size, start in the full HF tensor) of HF shard `shard_id`."""
        return 0, self.output_size, 0

    def input_part(self) -> tuple[int, int]:
        """(start in the full HF input features, size) of this rank's input features."""
        return 0, self.input_size

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 `[out, in]` of this rank, in the checkpoint's input-feature order (tests, debugging)."""
        return self.quant_method.dequantized_weight(self)

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA delta `x A^T B^T` on the weight's HF shard `shard_id`: B `[out, r]` is split
        like the weight's output features, A `[r, in]` like its input features."""
        return a, b


class RowLinear(_Linear):
    """`y = x W^T + b`, sharded along the input features; the partial products are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, *, quant_config: QuantConfig | None) -> None:
        super().__init__(_divide(input_size, get_tp().size, "input features"), output_size, bias, quant_config,
                         input_size, {None: output_size})

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """`x`: FP8 rows where `takes_fp8_rows`."""
        partial = self.quant_method.apply(self, x, None)
        if self.lora is not None:
            self.lora.add_delta(x, partial)  # a partial sum too: it joins the all-reduce
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.narrow(1, self.tp.rank * self.input_size, self.input_size), b

    def input_part(self) -> tuple[int, int]:
        return self.tp.rank * self.input_size, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        if param.dim() == 2:
            loaded_weight = loaded_weight.narrow(1, self.tp.rank * self.input_size, self.input_size)
        copy_checked(param.data, loaded_weight)


class MergedColumnLinear(_Linear):
    """Several column layers on the same input, fused into one matmul; HF shard i fills output slice i."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, *,
                 quant_config: QuantConfig | None) -> None:
        tp_size = get_tp().size
        self.output_sizes = [_divide(size, tp_size, "output features") for size in output_sizes]
        self.output_offsets = [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]
        super().__init__(input_size, sum(self.output_sizes), bias, quant_config, input_size,
                         dict(enumerate(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size = self.output_offsets[shard_id], self.output_sizes[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp.rank * size, size))

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.output_sizes[shard_id]
        return a, b.narrow(0, self.tp.rank * size, size)

    def output_part(self, shard_id: Hashable) -> tuple[int, int, int]:
        size = self.output_sizes[shard_id]
        return self.output_offsets[shard_id], size, self.tp.rank * size


class QKVLinear(_Linear):
    """The q, k and v projections fused into one matmul; this rank's output is `[q | k | v]` of its heads.

    Query heads are split evenly. KV heads are split too; with more ranks than KV heads, each KV head is
    replicated on `tp_size / num_kv_heads` consecutive ranks, which are exactly the ranks whose query heads
    read it.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, *,
                 quant_config: QuantConfig | None) -> None:
        tp = get_tp()
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Which KV head slice this rank holds: rank r's query heads read KV head (r * heads_per_rank) // group.
        self.kv_shard = tp.rank * self.num_heads // (num_heads // num_kv_heads) // self.num_kv_heads
        full_kv = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, quant_config, hidden_size,
                         {"q": num_heads * head_dim, "k": full_kv, "v": full_kv})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size, start = self.output_part(shard_id)
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size))

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, size, start = self.output_part(shard_id)
        return a, b.narrow(0, start, size)

    def output_part(self, shard_id: Hashable) -> tuple[int, int, int]:
        """(offset in this rank's output, size, start in the full HF tensor) of shard "q", "k" or "v"."""
        if shard_id == "q":
            return 0, self.q_size, self.tp.rank * self.q_size
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, self.kv_shard * self.kv_size


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{size} {what} cannot be split over tensor_parallel_size={parts}")
    return size // parts
