"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchllm import kernels


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for a fused `gate_up` projection output `[..., 2 * d]` (gate first)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)


class GeluTanhAndMul(nn.Module):
    """`gelu_tanh(gate) * up` (Gemma's gated MLP, HF's `gelu_pytorch_tanh`) for a fused `gate_up` output
    `[..., 2 * d]` (gate first). Pure torch: on the GPU, one elementwise pass that does not dominate a step."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
