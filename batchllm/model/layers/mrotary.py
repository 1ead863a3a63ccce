"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): each token has a (temporal, height, width) position, and the rotated
frequencies are split into three sections, each turned by one of the three components.

Text tokens have the same value in all three components, which makes the rotation plain RoPE at that position: a
step whose tokens all have one position each (decode, text-only prompts, the text after a prompt's last image)
passes `positions [T]` and runs the plain path, CUDA graphs included. A step with image tokens (or text before an
image) passes `positions [3, T]`.
"""

from __future__ import annotations

import torch

from batchllm import kernels
from batchllm.model.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_positions: int, base: float, section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_positions, base)
        if sum(section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to rotary_dim / 2 = {self.rotary_dim // 2}")
        bounds = [0]
        for size in section:
            bounds.append(bounds[-1] + size)
        self.bounds = bounds

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions [T]` (every component equal) or `[3, T]`; rotates `query` and `key` in place."""
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        rows = torch.arange(positions.shape[1], device=positions.device)
        return kernels.apply_rotary(rows, query, key, self._per_token(self.cos, positions),
                                    self._per_token(self.sin, positions))

    def _per_token(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's own cos (or sin) row `[T, rotary_dim / 2]`, section by section from the component that
        turns it."""
        sections = zip(self.bounds, self.bounds[1:])
        return torch.cat([table[positions[i], lo:hi] for i, (lo, hi) in enumerate(sections)], dim=-1)
