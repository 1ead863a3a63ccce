"""Rotary position embedding (neox style: the head dimension is split in two halves), as in HF Llama."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchllm import kernels
from batchllm.model.config import RopeScaling


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's position, from a cos/sin table precomputed for every position.

    The table is built in float32 exactly the way HF builds its per-step cos/sin (same inverse frequencies,
    same `position * inv_freq` product), so indexing it gives bit-identical values.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(head_dim, base, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Not persistent: derived from the config, never loaded from a checkpoint.
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_positions, head_dim // 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query [T, Hq, D]` and `key [T, Hkv, D]` by `positions [T]`, in place; returns them."""
        return kernels.apply_rotary(positions, query, key, self.cos, self.sin)


def _inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
