"""RMSNorm (Llama's, and Gemma's `1 + weight` variant) with an optional fused residual add."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from batchllm import kernels
from batchllm.model.quantization.fp8 import Fp8Rows


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

    @overload
    def quantized(self, x: torch.Tensor, residual: None = None) -> Fp8Rows: ...

    @overload
    def quantized(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[Fp8Rows, torch.Tensor]: ...

    def quantized(self, x: torch.Tensor,
                  residual: torch.Tensor | None = None) -> Fp8Rows | tuple[Fp8Rows, torch.Tensor]:
        """`forward` for an FP8 linear layer that alone reads the norm: its output quantized per token exactly as
        `fp8_linear` would quantize it; on the GPU one kernel, which never writes the 16-bit output."""
        q, scale, new_residual = kernels.rms_norm_fp8(x, self.weight, self.eps, residual)
        rows = Fp8Rows(q, scale, torch.promote_types(self.weight.dtype, x.dtype), tuple(x.shape))
        return rows if new_residual is None else (rows, new_residual)


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

    def quantized(self, x: torch.Tensor,
                  residual: torch.Tensor | None = None) -> Fp8Rows | tuple[Fp8Rows, torch.Tensor]:
        """As `RMSNorm.quantized`, unfused: the fused kernel multiplies in Llama's order."""
        out = self(x, residual)
        normed, new_residual = out if residual is not None else (out, None)
        q, scale = kernels.quantize_fp8_per_token(normed.reshape(-1, x.shape[-1]))
        rows = Fp8Rows(q, scale, normed.dtype, tuple(x.shape))
        return rows if new_residual is None else (rows, new_residual)


def normalize_for(reader: nn.Module | None, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
                  ) -> torch.Tensor | Fp8Rows | tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """`norm(x[, residual])` for `reader`, the one layer that reads its output: quantized to FP8 rows
    (`RMSNorm.quantized`) where the reader takes them (`takes_fp8_rows`: an FP8 linear layer without an adapter)."""
    if isinstance(norm, RMSNorm) and getattr(reader, "takes_fp8_rows", False):
        return norm.quantized(x, residual)
    return norm(x) if residual is None else norm(x, residual)
