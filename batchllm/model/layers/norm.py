"""RMSNorm (Llama's, and Gemma's `1 + weight` variant) with an optional fused residual add."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from batchllm import kernels


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, numerically identical to HF's `LlamaRMSNorm`.

    The statistics are computed in float32 and the result is cast back to the input dtype before the
    weight multiply, in that order, because that is what the checkpoints were trained and evaluated with.
    """

    # The weight for which the norm only normalises: what random (dummy) weights get.
    identity_weight = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`; or, given the residual stream, `(norm(x + residual), x + residual)`.

        The fused form lets a decoder layer carry the residual stream without a separate add. The add
        happens in the input dtype, as HF's decoder layers do it.
        """
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, numerically HF's `Gemma2RMSNorm` / `Gemma3RMSNorm`: the weight is stored as an offset
    from 1, and the multiply by `1 + weight` happens in float32 before the cast back to the input dtype (the
    other order from `RMSNorm`'s, and what Gemma checkpoints were trained with)."""

    # The weight for which the norm only normalises: what random (dummy) weights get.
    identity_weight = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As `RMSNorm.forward`, with Gemma's order (the residual add in the input dtype, as HF's layers do it)."""
        if residual is not None:
            residual = x + residual
            return self(residual), residual
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
