"""Linear layers whose parameters know how to load themselves from HF checkpoint tensors.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`. Fused layers (QKV, gate/up)
are filled from several HF tensors, one `shard_id` each, and list the shards they expect in
`param.shard_ids` so the loader can tell when one is missing.

The layers are tensor-parallel unaware, but split by how tensor parallelism would shard them: column
layers own a slice of the output features, row layers a slice of the input features. A TP version only
needs to narrow `loaded_weight` to its rank's slice inside these loaders.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        # torch.empty: the checkpoint (or the dummy initialiser) fills the values, so random init is wasted work.
        self.weight = _loadable(torch.empty(output_size, input_size), self.weight_loader)
        self.bias = _loadable(torch.empty(output_size), self.weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        copy_checked(param.data, loaded_weight)


class ColumnLinear(_Linear):
    """`y = x W^T + b`, sharded (under TP) along the output features."""


class RowLinear(_Linear):
    """`y = x W^T + b`, sharded (under TP) along the input features; its output would be all-reduced."""


class MergedColumnLinear(ColumnLinear):
    """Several column layers on the same input, fused into one matmul; HF shard i fills output slice i."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.output_sizes = list(output_sizes)
        _expect_shards(self, list(range(len(output_sizes))))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size = self.output_offsets[shard_id], self.output_sizes[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(ColumnLinear):
    """The q, k and v projections fused into one matmul; output is `[q | k | v]` along the features."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        _expect_shards(self, ["q", "k", "v"])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        offset, size = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight)


def copy_checked(target: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (slice), refusing silent broadcasting of a wrong shape."""
    if target.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded_weight)


def _loadable(data: torch.Tensor, weight_loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader
    return param


def _expect_shards(layer: _Linear, shard_ids: list[Hashable]) -> None:
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.shard_ids = shard_ids
