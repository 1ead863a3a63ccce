"""Tensor-parallel linear layers whose parameters know how to load themselves from HF checkpoint tensors.

Megatron-style sharding over the group of `batchllm.distributed.parallel_state`: a column layer holds its
rank's slice of the output features (no communication), a row layer its slice of the input features and
sums the partial outputs with one all-reduce. A column layer followed by a row layer (q/k/v → o, gate/up →
down) thus costs one all-reduce. With one rank every layer is a plain linear.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the *full* HF
tensor (or a lazily read `CheckpointSlice` of it) and copies this rank's slice of it, and
`checkpoint_shapes` (shard id → full HF shape), which the random initialiser uses to build
rank-independent weights. Fused layers (QKV, gate/up) are filled from several HF tensors, one `shard_id`
each.

Under FP8 quantization (`batchllm.model.quantization`, read while the model is built) `weight` is E4M3 and a
`weight_scale [out]` float32 parameter holds its per-output-channel scales; the scales shard like a bias
(with the output features of a column layer, whole on every rank of a row layer). The loader hands the
weight loader FP8 tensors and their per-channel scales, whatever the checkpoint's own format.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchllm.distributed.parallel_state import all_reduce, get_tp, kv_heads_per_rank
from batchllm.model.checkpoint_tensor import copy_checked
from batchllm.model.layers.lora import LoRASlots
from batchllm.model.quantization import current_quantization
from batchllm.model.quantization.fp8 import FP8_DTYPE, fp8_linear


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp = get_tp()
        self.input_size, self.output_size = input_size, output_size  # this rank's sizes
        fp8 = current_quantization() is not None
        # torch.empty: the checkpoint (or the dummy initialiser) fills the values, so random init is wasted work.
        weight = torch.empty(output_size, input_size, dtype=FP8_DTYPE if fp8 else None)
        self.weight = _loadable(weight, self.weight_loader)
        self.weight_scale = (_loadable(torch.empty(output_size, dtype=torch.float32), self.weight_loader)
                             if fp8 else None)
        self.bias = _loadable(torch.empty(output_size), self.weight_loader) if bias else None
        self.lora: LoRASlots | None = None  # set when the engine runs adapters (`executor/lora_slots.py`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, out)
        return out

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        return F.linear(x, self.weight, bias)

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA delta `x A^T B^T` on the weight's HF shard `shard_id`: B `[out, r]` is split
        like the weight's output features, A `[r, in]` like its input features."""
        return a, b


class RowLinear(_Linear):
    """`y = x W^T + b`, sharded along the input features; the partial products are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__(_divide(input_size, get_tp().size, "input features"), output_size, bias)
        self.weight.checkpoint_shapes = {None: (output_size, input_size)}
        for vector in (self.bias, self.weight_scale):
            if vector is not None:
                vector.checkpoint_shapes = {None: (output_size,)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self._matmul(x, None)
        if self.lora is not None:
            self.lora.add_delta(x, partial)  # a partial sum too: it joins the all-reduce
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.narrow(1, self.tp.rank * self.input_size, self.input_size), b

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        if param.dim() == 2:
            loaded_weight = loaded_weight.narrow(1, self.tp.rank * self.input_size, self.input_size)
        copy_checked(param.data, loaded_weight)


class MergedColumnLinear(_Linear):
    """Several column layers on the same input, fused into one matmul; HF shard i fills output slice i."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool) -> None:
        tp_size = get_tp().size
        self.output_sizes = [_divide(size, tp_size, "output features") for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias)
        self.output_offsets = [sum(self.output_sizes[:i]) for i in range(len(output_sizes))]
        _set_checkpoint_shapes(self, dict(enumerate(output_sizes)), input_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size = self.output_offsets[shard_id], self.output_sizes[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp.rank * size, size))

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.output_sizes[shard_id]
        return a, b.narrow(0, self.tp.rank * size, size)


class QKVLinear(_Linear):
    """The q, k and v projections fused into one matmul; this rank's output is `[q | k | v]` of its heads.

    Query heads are split evenly. KV heads are split too; with more ranks than KV heads, each KV head is
    replicated on `tp_size / num_kv_heads` consecutive ranks, which are exactly the ranks whose query heads
    read it.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp()
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Which KV head slice this rank holds: rank r's query heads read KV head (r * heads_per_rank) // group.
        self.kv_shard = tp.rank * self.num_heads // (num_heads // num_kv_heads) // self.num_kv_heads
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        full_kv = num_kv_heads * head_dim
        _set_checkpoint_shapes(self, {"q": num_heads * head_dim, "k": full_kv, "v": full_kv}, hidden_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size, start = self._shard(shard_id)
        copy_checked(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size))

    def lora_shard(self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, size, start = self._shard(shard_id)
        return a, b.narrow(0, start, size)

    def _shard(self, shard_id: Hashable) -> tuple[int, int, int]:
        """(offset in this rank's output, size, start in the full HF tensor) of shard "q", "k" or "v"."""
        if shard_id == "q":
            return 0, self.q_size, self.tp.rank * self.q_size
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_size, self.kv_shard * self.kv_size


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{size} {what} cannot be split over tensor_parallel_size={parts}")
    return size // parts


def _loadable(data: torch.Tensor, weight_loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    return param


def _set_checkpoint_shapes(layer: _Linear, output_sizes: dict[Hashable, int], input_size: int) -> None:
    """Record the full HF tensor shapes behind a column layer's weight (and bias), one per shard id."""
    layer.weight.checkpoint_shapes = {shard: (size, input_size) for shard, size in output_sizes.items()}
    for vector in (layer.bias, layer.weight_scale):
        if vector is not None:
            vector.checkpoint_shapes = {shard: (size,) for shard, size in output_sizes.items()}
