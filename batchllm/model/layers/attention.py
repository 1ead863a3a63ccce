"""Paged attention layer: the only place where model code meets the KV cache."""

from __future__ import annotations

import torch
from torch import nn

from batchllm.distributed.parallel_state import get_tp
from batchllm.forward_context import get_attention_metadata
from batchllm.model.attention import AttentionParams, attention_backend
from batchllm.model.checkpoint_tensor import copy_checked


class Attention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends over everything cached so far.

    `k_cache` and `v_cache` (`[num_blocks, block_size, num_kv_heads, head_dim]`) are plain attributes, not
    parameters or buffers, so they are never saved, loaded or moved with the model: the model runner
    allocates them once the model is loaded and assigns them to each layer. Paging metadata comes from the
    forward context (`batchllm.forward_context`); the layer's own parameters (`params`: scale, and the sliding
    window, sinks and logit soft-cap that some families use) reach the backend with the layer, so a model
    family sets them here and no caller's signature changes.

    With an FP8 cache, `k_scale` and `v_scale` are the layer's KV scales (the cache holds `k / k_scale`): the
    checkpoint's when it has them, otherwise 1.0, the default vLLM also uses (E4M3 holds ±448 with 3 mantissa
    bits, ample for the keys and values of the models we run; see README's FP8 section for the measured cost).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logit_soft_cap: float | None = None, sinks: bool = False) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.params = AttentionParams(scale, sliding_window, logit_soft_cap, sinks)
        # One learned logit per (this rank's) query head, loaded with the weights: the checkpoint holds every
        # head's, of which tensor parallelism gives each rank its heads' (query heads are split evenly, in order).
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            self.sinks.checkpoint_shapes = {None: (num_heads * get_tp().size,)}
        self.k_scale = self.v_scale = 1.0
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_group = 0  # whose block tables index this layer's cache (a hybrid KV cache has several groups)

    def _load_sinks(self, param: nn.Parameter, loaded_weight, shard_id: None = None) -> None:
        heads = param.shape[0]
        copy_checked(param.data, loaded_weight.narrow(0, get_tp().rank * heads, heads))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`query [T, Hq, D]`, `key`/`value [T, Hkv, D]` of the flat batch → attention output `[T, Hq * D]`."""
        if self.k_cache.numel() == 0:
            raise RuntimeError("Attention layer has no KV cache: the model runner must assign k_cache/v_cache first")
        backend = attention_backend(query.device)
        metadata = get_attention_metadata()
        if metadata.groups is not None:
            metadata = metadata.groups[self.kv_group]
        return backend.forward(self, query, key, value, metadata).flatten(1)
