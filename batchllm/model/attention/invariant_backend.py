"""The batch-invariant CPU backend: the torch backend's K/V write, then `invariant_paged_attention`, whose reduction
for a query row does not depend on the rest of the step. `attention_backend` picks it inside `batch_invariant_mode`
(`deterministic=True`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference
from batchllm.model.attention.backend import AttentionBackend
from batchllm.model.layers.batch_invariant import invariant_paged_attention

if TYPE_CHECKING:
    from batchllm.model.layers.attention import Attention


class InvariantAttentionBackend(AttentionBackend):
    name = "torch-batch-invariant"
    needs_host_metadata = True  # it cuts each sequence's query rows into chunks on the host

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        params = layer.params
        reference.write_kv(key, value, layer.k_cache, layer.v_cache, metadata.slot_mapping, layer.k_scale,
                           layer.v_scale)
        return invariant_paged_attention(query, layer.k_cache, layer.v_cache, metadata, params.scale, layer.k_scale,
                                         layer.v_scale, sliding_window=params.sliding_window,
                                         logit_soft_cap=params.logit_soft_cap, sinks=layer.sinks)


INVARIANT_BACKEND = InvariantAttentionBackend()
