"""The Triton backend: the KV write and paged-attention kernels of `batchllm.kernels` (importing this module
imports Triton). The attention kernel implements every `AttentionParams` option (sliding window, logit
soft-cap, sinks), each compiled in only for the layers that use it. While a step runs batch-invariant
(`deterministic=True`) the attention kernel runs with `invariant=True`: one launch shape, no split-KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels.attention import paged_attention_triton
from batchllm.kernels.kv_write import write_kv_triton
from batchllm.model.attention.backend import AttentionBackend
from batchllm.model.layers import batch_invariant

if TYPE_CHECKING:
    from batchllm.model.layers.attention import Attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    needs_host_metadata = False  # launch shapes come from tensor shapes and the metadata's max lengths

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        params = layer.params
        write_kv_triton(key, value, layer.k_cache, layer.v_cache, metadata.slot_mapping, layer.k_scale,
                        layer.v_scale)
        return paged_attention_triton(query, layer.k_cache, layer.v_cache, metadata, params.scale,
                                      k_scale=layer.k_scale, v_scale=layer.v_scale,
                                      sliding_window=params.sliding_window, logit_soft_cap=params.logit_soft_cap,
                                      sinks=layer.sinks, invariant=batch_invariant.active())
