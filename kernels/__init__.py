"""Paged KV-cache kernels, installed as `batchllm.kernels`.

The two functions below are the only dispatch point between implementations: model code calls them and
never imports an implementation directly. Today every device uses the pure-torch reference.
"""

from __future__ import annotations

import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference

__all__ = ["paged_attention", "write_kv"]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V `[T, num_kv_heads, head_dim]` into its cache slot (negative slots are skipped)."""
    reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat mixed batch of queries `[T, num_heads, head_dim]` over the paged KV cache."""
    return reference.paged_attention(query, k_cache, v_cache, metadata, scale)
