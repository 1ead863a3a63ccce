"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from batchllm import kernels


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for a fused `gate_up` projection output `[..., 2 * d]` (gate first)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)
