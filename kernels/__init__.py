"""Kernels, installed as `batchllm.kernels`: the one dispatch point between implementations.

Model code calls the functions below and never imports an implementation directly. The rule is the same
for every function: the Triton kernel when the tensor is on CUDA and Triton is importable, otherwise the
pure-torch reference of `reference.py` (the CPU path). `BATCHLLM_DISABLE_TRITON=1` forces the references
everywhere; it is read once, on the first CUDA call. Triton is imported lazily on that first call, so
`import batchllm` never imports it and the CPU path works without it installed. Paged attention and the KV
write are the exception: they take per-layer parameters and paging metadata, and go through the attention
backends of `batchllm.model.attention`, which pick by the same rule (`triton_enabled`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace

import torch

from batchllm.kernels import moe_reference, reference

__all__ = ["add_lora_", "apply_rotary", "apply_token_bitmask_", "fused_moe", "int_matmul", "quantize_fp8_per_token",
           "rms_norm", "rms_norm_fp8", "silu_and_mul", "silu_and_mul_fp8", "triton_enabled"]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`norm(x)`, or `(norm(x + residual), x + residual)` given the residual stream (see `reference.rms_norm`)."""
    if _use_triton(x):
        return _triton().rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_norm`'s output quantized per token for an FP8 linear layer: `(q [T, H] float8_e4m3fn, scale [T, 1]
    float32, x + residual or None)`, the 16-bit output never written on the GPU."""
    if _use_triton(x):
        return _triton().rms_norm_fp8(x, weight, eps, residual)
    out = reference.rms_norm(x, weight, eps, residual)
    normed, new_residual = out if residual is not None else (out, None)
    return (*reference.quantize_fp8_per_token(normed.reshape(-1, x.shape[-1])), new_residual)


def apply_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query [T, Hq, D]` and `key [T, Hkv, D]` in place by `positions` (neox style); returns them."""
    if _use_triton(query):
        return _triton().apply_rotary(positions, query, key, cos, sin)
    return reference.apply_rotary(positions, query, key, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a fused gate_up tensor `[..., 2 * d]` (gate first) → `[..., d]`."""
    if _use_triton(gate_up):
        return _triton().silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_per_token(silu_and_mul(gate_up))` for rows `[T, 2 * d]`: `(q [T, d] float8_e4m3fn, scale
    [T, 1] float32)`, the 16-bit product never written on the GPU."""
    if _use_triton(gate_up):
        return _triton().silu_and_mul_fp8(gate_up)
    return reference.quantize_fp8_per_token(reference.silu_and_mul(gate_up))


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`-inf` in place wherever row `rows[i]`'s grammar bitmask forbids a token (see the reference)."""
    if _use_triton(logits):
        return _triton().apply_token_bitmask_(logits, rows, bitmask)
    return reference.apply_token_bitmask_(logits, rows, bitmask)


def add_lora_(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_tokens: torch.Tensor,
              slot_starts: torch.Tensor) -> torch.Tensor:
    """`out[t] += x[t] a[s]^T b[s]^T` for the tokens t of slot s's segment; in place, returns out (see reference)."""
    if _use_triton(x):
        return _triton().add_lora_(x, out, a, b, sorted_tokens, slot_starts)
    return reference.add_lora_(x, out, a, b, sorted_tokens, slot_starts)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 quantization of activations `[T, K]` → `(q float8_e4m3fn, scale [T, 1] float32)`."""
    if _use_triton(x):
        return _triton().quantize_fp8_per_token(x)
    return reference.quantize_fp8_per_token(x)


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ w` → `[M, N]` in x's dtype, w a K-packed 4- or 8-bit weight (see `reference.int_matmul`)."""
    if _use_triton(x):
        return _triton().int_matmul(x, qweight, scales, zeros, bits, group_size, g_idx)
    return reference.int_matmul(x, qweight, scales, zeros, bits, group_size, g_idx)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_limit: float | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              w13_zero: torch.Tensor | None = None, w2_zero: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' MLP of `hidden [T, H]` through the experts `topk_ids [T, k]`, weighted by `topk_weights`
    (see `moe_reference.fused_moe` for the weights' layout, unquantized, FP8, MXFP4 or 4- / 8-bit integers)."""
    if _use_triton(hidden):
        return _triton().fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                                   swiglu_limit, w13_scale, w2_scale, w13_zero, w2_zero)
    return moe_reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
                                   swiglu_limit, w13_scale, w2_scale, w13_zero, w2_zero)


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and triton_enabled()


@functools.cache
def triton_enabled() -> bool:
    """Whether CUDA tensors take the Triton kernels (installed, and not disabled by BATCHLLM_DISABLE_TRITON)."""
    return os.environ.get("BATCHLLM_DISABLE_TRITON") != "1" and importlib.util.find_spec("triton") is not None


@functools.cache
def _triton() -> SimpleNamespace:
    """The Triton implementations, imported on first use (importing them imports and initialises Triton)."""
    from batchllm.kernels.activation import silu_and_mul_fp8_triton, silu_and_mul_triton
    from batchllm.kernels.fp8 import quantize_fp8_per_token_triton
    from batchllm.kernels.int_gemm import int_matmul_triton
    from batchllm.kernels.lora import add_lora_triton
    from batchllm.kernels.moe import fused_moe_triton
    from batchllm.kernels.rmsnorm import rms_norm_fp8_triton, rms_norm_triton
    from batchllm.kernels.rotary import apply_rotary_triton
    from batchllm.kernels.token_bitmask import apply_token_bitmask_triton

    return SimpleNamespace(
        rms_norm=rms_norm_triton, apply_rotary=apply_rotary_triton, silu_and_mul=silu_and_mul_triton,
        apply_token_bitmask_=apply_token_bitmask_triton, add_lora_=add_lora_triton,
        quantize_fp8_per_token=quantize_fp8_per_token_triton, int_matmul=int_matmul_triton,
        fused_moe=fused_moe_triton, silu_and_mul_fp8=silu_and_mul_fp8_triton,
        rms_norm_fp8=rms_norm_fp8_triton,
    )
