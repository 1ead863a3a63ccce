"""RMSNorm with an optional fused residual add."""

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
