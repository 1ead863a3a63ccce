"""The pure-torch reference backend: the CPU path, and the ground truth the Triton backend is tested against.
It implements every `AttentionParams` feature."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference
from batchllm.model.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from batchllm.model.layers.attention import Attention


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    needs_host_metadata = True  # it loops over the sequences on the host

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        params = layer.params
        reference.write_kv(key, value, layer.k_cache, layer.v_cache, metadata.slot_mapping, layer.k_scale,
                           layer.v_scale)
        return reference.paged_attention(query, layer.k_cache, layer.v_cache, metadata, params.scale, layer.k_scale,
                                         layer.v_scale, sliding_window=params.sliding_window,
                                         logit_soft_cap=params.logit_soft_cap, sinks=layer.sinks)


TORCH_BACKEND = TorchAttentionBackend()
