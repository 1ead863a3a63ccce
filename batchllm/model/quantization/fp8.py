"""FP8 (E4M3) linear layers: per-output-channel weight scales, activations quantized per token on the fly.

The GEMM on the GPU is `torch._scaled_mm` with row-wise scales (Hopper and Ada FP8 tensor cores):
`out[t, o] = (sum_k qx[t, k] qw[o, k]) * sx[t] * sw[o]`, accumulated in float32. The CPU runs the same
arithmetic as a dequantize-then-matmul reference: the same quantized operands and the same scales, the sum
exact in float64, so CI tests the math and an FP8 checkpoint loads (slowly, correctly) on a laptop.

The scales are float32 and so is the division, for weights and activations alike: a row's scale is
`float32(absmax) / 448` rounded to float32 (the value stored in `weight_scale` and read by `_scaled_mm`), and
`q = E4M3(clamp(float32(x) / scale, ±448))`, nearest with ties to even: `q * scale` is the E4M3 multiple of the
scale actually used that is nearest `x`, up to the division's own rounding (on the GPU the Triton kernel's
division errs by up to 2 ulp, which moves a rare activation one E4M3 step). Against an unrounded absmax / 448 a
few weights round the other way: those on an exact E4M3 tie, common in checkpoints dequantized from a GGUF grid
(734 of the default model's 106M). FP8 rounding is discontinuous, so such a difference, or any float-rounding
difference elsewhere in the model, flips further roundings layer after layer: two implementations of this scheme
agree closely only if they agree bit for bit (tests/e2e/test_fp8_vs_simulation.py compares with a simulation on
HF's model in float64 for that reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchllm import kernels
from batchllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, quantize_fp8

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later.
MIN_CUDA_CAPABILITY = (8, 9)


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [out, in]` → `(q [out, in] float8_e4m3fn, scale [out] float32)`, one float32 absmax / 448 per row."""
    scale = (weight.float().abs().amax(dim=1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    return quantize_fp8(weight, scale[:, None]), scale


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """Float32 `weight * scale_inv` with one scale per `block_shape` block (the edge blocks may be partial)."""
    rows, cols = weight.shape
    expected = (-(-rows // block_shape[0]), -(-cols // block_shape[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a "
                         f"{rows} x {cols} weight in {block_shape[0]} x {block_shape[1]} blocks")
    scales = scale_inv.float().repeat_interleave(block_shape[0], 0)[:rows].repeat_interleave(block_shape[1], 1)
    return weight.float() * scales[:, :cols]


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations `[..., K]` of `dtype` already quantized per token, as `fp8_linear` would quantize them: `q
    [T, K]` float8_e4m3fn and `scale [T, 1]` float32 (`kernels.silu_and_mul_fp8` writes them for a down projection,
    `kernels.rms_norm_fp8` for a qkv or gate_up one). `shape` is the activations' own."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T + b` for an FP8 `weight [out, in]` with per-row `weight_scale [out]`; the output is in x's dtype."""
    if isinstance(x, Fp8Rows):
        q, x_scale, dtype, shape = x.q, x.scale, x.dtype, x.shape
    else:
        q, x_scale = kernels.quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
        dtype, shape = x.dtype, x.shape
    if q.is_cuda:
        # weight.t() is column-major, the layout the FP8 GEMM wants for its second operand.
        out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=dtype)
    else:
        # In float64 the sum is exact (a product of two E4M3 values is a multiple of 2**-18 below 2**18, so a sum
        # of up to 2**17 of them fits 53 bits): the CPU result depends on the operands only, not on the batch.
        out = (F.linear(q.double(), weight.double()) * x_scale.double() * weight_scale.double()).to(dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def check_fp8_device(device: torch.device, what: str) -> None:
    """FP8 on CUDA needs FP8 tensor cores; the CPU always runs the reference arithmetic."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        raise ValueError(f"{what} needs a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
                         f"Blackwell); {torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}. "
                         f"Supported here: quantization=None and kv_cache_dtype='auto'.")


__all__ = ["FP8_DTYPE", "Fp8Rows", "check_fp8_device", "dequantize_blocks", "fp8_linear", "quantize_fp8_per_channel"]
