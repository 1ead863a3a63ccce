"""Allocation of the paged KV cache and its hand-out to the attention layers."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from batchllm.distributed.parallel_state import get_pp, get_tp, kv_heads_per_rank
from batchllm.engine.kv_groups import KVGroupLayout
from batchllm.model.config import ModelConfig
from batchllm.model.layers.attention import Attention
from batchllm.model.stages import StagePlan


@dataclass(slots=True)
class KVCache:
    # [2 (K, V), num_slots, num_blocks, block_size, num_kv_heads, head_dim], one allocation for the pool: a slot
    # per layer, or with a hybrid layout (engine/kv_groups.py) one per layer of a group.
    tensor: torch.Tensor

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src → block dst in every slot, K and V, in one indexed copy (of the bytes:
        torch has no index_copy_ for FP8 caches). A block belongs to one group at a time, so that is every layer
        whose K/V it holds."""
        src = torch.tensor([s for s, _ in copies], device=self.tensor.device)
        dst = torch.tensor([d for _, d in copies], device=self.tensor.device)
        data = self.tensor.view(torch.uint8)
        data.index_copy_(2, dst, data.index_select(2, src))


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       layout: KVGroupLayout | None = None) -> int:
    """Bytes one block takes on this rank, which holds only its tensor-parallel share of the KV heads, of its
    pipeline stage's layers (with a hybrid `layout`: of one group's layers)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    num_kv_heads = kv_heads_per_rank(config.num_kv_heads, get_tp().size)
    num_slots = num_stage_layers(config) if layout is None else len(stage_slots(config, layout))
    return 2 * num_slots * block_size * num_kv_heads * config.head_dim * element_size


def num_stage_layers(config: ModelConfig) -> int:
    pp = get_pp()
    return config.num_layers if pp.size == 1 else StagePlan(config, pp.rank, pp.size).num_layers


def stage_layer_indices(config: ModelConfig) -> range:
    pp = get_pp()
    if pp.size == 1:
        return range(config.num_layers)
    plan = StagePlan(config, pp.rank, pp.size)
    return range(plan.start, plan.end)


def stage_slots(config: ModelConfig, layout: KVGroupLayout) -> dict[int, int]:
    """The storage slots this pipeline stage's layers use, each to its index in the stage's pool: a stage holds
    only those (all of them without pipeline parallelism)."""
    used = sorted({layout.layer_slot[layer] for layer in stage_layer_indices(config)})
    return {slot: index for index, slot in enumerate(used)}


def allocate_kv_cache(model: torch.nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                      device: torch.device, dtype: torch.dtype, layout: KVGroupLayout | None = None,
                      group: int = 0) -> KVCache:
    """The pool, and each attention layer's view of it: its slot, read at its group's block ids (`kv_group`).
    Without `layout`, every layer its own slot, in group `group` (a proposer's group of a hybrid KV cache)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != num_stage_layers(config):
        raise RuntimeError(f"found {len(layers)} attention layers, the config says {num_stage_layers(config)}")
    if layout is None:
        slots, groups = list(range(len(layers))), [group] * len(layers)
    else:
        compact, indices = stage_slots(config, layout), stage_layer_indices(config)
        slots = [compact[layout.layer_slot[layer]] for layer in indices]
        groups = [layout.layer_group[layer] for layer in indices]
    tensor = zeroed_pool((2, max(slots) + 1, num_blocks, block_size, layers[0].num_kv_heads, config.head_dim),
                         dtype, device)
    for layer, slot, group in zip(layers, slots, groups, strict=True):
        layer.k_cache, layer.v_cache, layer.kv_group = tensor[0, slot], tensor[1, slot], group
    return KVCache(tensor)


def release_kv_cache(model: torch.nn.Module) -> None:
    """Unbind the attention layers from their pool, so that dropping the pool frees it (a throwaway one)."""
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache = layer.v_cache = torch.empty(0)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A pool of zeros. Slots no token has written are still read: a key masked out of a query's softmax enters
    `p @ V` as 0 x its value, NaN where recycled memory held a NaN bit pattern (a verification step's inert tokens
    and a CUDA graph's padding rows sit at positions nothing wrote). On the GPU a memset; on the CPU an anonymous
    mapping, zero pages that become resident only as blocks are written (a memset would make a 4 GiB default pool
    resident at start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
