"""The Triton backend: the KV write and paged-attention kernels of `batchllm.kernels` (importing this module
imports Triton). The kernels do not implement sliding windows, sinks or logit soft-capping yet: a layer that
uses one fails here, naming it, rather than computing plain causal attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels.attention import paged_attention_triton
from batchllm.kernels.kv_write import write_kv_triton
from batchllm.model.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from batchllm.model.layers.attention import Attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    needs_host_metadata = False  # launch shapes come from tensor shapes and the metadata's max lengths

    def forward(self, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        params = layer.params
        unsupported = params.features_on()
        if unsupported:
            raise NotImplementedError(f"the Triton attention backend does not implement {', '.join(unsupported)} "
                                      f"yet; set BATCHLLM_DISABLE_TRITON=1 to run the torch reference instead")
        write_kv_triton(key, value, layer.k_cache, layer.v_cache, metadata.slot_mapping, layer.k_scale,
                        layer.v_scale)
        return paged_attention_triton(query, layer.k_cache, layer.v_cache, metadata, params.scale,
                                      k_scale=layer.k_scale, v_scale=layer.v_scale)
