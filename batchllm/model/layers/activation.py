"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchllm import kernels
from batchllm.model.quantization.fp8 import Fp8Rows


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for a fused `gate_up` projection output `[..., 2 * d]` (gate first)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)

    @staticmethod
    def quantized(gate_up: torch.Tensor) -> Fp8Rows:
        """The product quantized per token for an FP8 down projection, exactly as `fp8_linear` would quantize
        `forward`'s output; on the GPU one kernel, which never writes the 16-bit product."""
        d = gate_up.shape[-1] // 2
        q, scale = kernels.silu_and_mul_fp8(gate_up.reshape(-1, 2 * d))
        return Fp8Rows(q, scale, gate_up.dtype, (*gate_up.shape[:-1], d))


class GeluTanhAndMul(nn.Module):
    """`gelu_tanh(gate) * up` (Gemma's gated MLP, HF's `gelu_pytorch_tanh`) for a fused `gate_up` output
    `[..., 2 * d]` (gate first). Pure torch: on the GPU, one elementwise pass that does not dominate a step."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
