"""The pure-torch reference of the mixture-of-experts MLP: the CPU path, and the oracle of the Triton kernel's tests.

Kept beside `reference.py` (which holds the other kernels' references) only for that file's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")
# OCP Microscaling (MX) v1.0, FP4 E2M1: the value of each 4-bit code (sign bit 3, exponent bits 2-1, mantissa bit 0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per E8M0 scale
SWIGLUOAI_ALPHA = 1.702  # gpt-oss's gated activation: gate * sigmoid(alpha * gate) * (up + 1), both clamped


def moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, swiglu_limit: float | None) -> torch.Tensor:
    """The gated activation of one expert's gate and up projections (same shape), in their dtype."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        return gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate) * (up + 1)
    raise ValueError(f"MoE activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 `[..., K]` of MXFP4 `packed [..., K / 2]` uint8 (value 2j in the low nibble of byte j, 2j + 1 in
    the high one) with E8M0 `scales [..., K / 32]` uint8 (the block's factor is `2 ** (scale - 127)`)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    values = table[codes].unflatten(-1, (scales.shape[-1], MXFP4_BLOCK))
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)


def dequantize_int_experts(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           in_features: int) -> torch.Tensor:
    """Float32 `[..., N, K = in_features]` of integer codes packed along K: `weight [..., N, K / pack]` int32,
    code k in bits `bits * (k % pack)` upwards of word `k // pack` (`pack = 32 / bits`: 8 codes of 4 bits, 4 of 8),
    `scale [..., N, G]` float32 and `zero [..., N, G]` uint8 (unsigned zero points) per group of `K / G`
    consecutive input features: `w[n, k] = (code - zero) * scale`, as `reference.dequantize_int` for a linear
    weight (whose PackedInt layout is this one transposed)."""
    pack = in_features // weight.shape[-1]
    bits = 32 // pack
    shifts = torch.arange(pack, dtype=torch.int32, device=weight.device) * bits
    codes = ((weight[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)
    group = in_features // scale.shape[-1]
    zeros = zero.long().repeat_interleave(group, dim=-1)
    return (codes - zeros).float() * scale.float().repeat_interleave(group, dim=-1)


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None = None,
                      in_features: int | None = None) -> torch.Tensor:
    """One expert's (or the stacked experts') weight `[..., N, K]` in float32: FP8 E4M3 codes times their
    output row's `scale [..., N]`, MXFP4 (uint8 packed, see `dequantize_mxfp4`) with `scale [..., N, K / 32]`,
    4- or 8-bit integer codes (int32 packed, see `dequantize_int_experts`: `zero` given, K = `in_features`), or a
    floating-point weight as it is (`scale` None)."""
    if weight.dtype == torch.int32:
        return dequantize_int_experts(weight, scale, zero, in_features)
    if weight.dtype == torch.uint8:
        return dequantize_mxfp4(weight, scale)
    if scale is not None:
        return weight.float() * scale.float()[..., None]
    return weight.float()


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_limit: float | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              w13_zero: torch.Tensor | None = None, w2_zero: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' MLP of `hidden [T, H]`, each token through the `k` experts `topk_ids [T, k]` chose for it.

    Expert e: `w13[e] [2 * I, H]` (the gate projection's I rows first, then up's), `activation(gate, up)`,
    `w2[e] [H, I]`; optional biases `w13_bias [E, 2 * I]`, `w2_bias [E, H]`. The experts' outputs are summed
    with `topk_weights [T, k]`, accumulated in float32; the result is in hidden's dtype. A loop over the experts
    that some token chose: experts no token chose are never read (nor dequantized).

    Quantized experts (`dequantize_expert`): FP8 E4M3 `w13`, `w2` with per-row `w13_scale [E, 2 * I]`,
    `w2_scale [E, H]`; or MXFP4, `w13 [E, 2 * I, H / 2]`, `w2 [E, H, I / 2]` uint8 with `w13_scale
    [E, 2 * I, H / 32]`, `w2_scale [E, H, I / 32]`; or 4- / 8-bit integers (GPTQ, AWQ), `w13 [E, 2 * I, H / pack]`,
    `w2 [E, H, I / pack]` int32 with group scales `w13_scale [E, 2 * I, G13]`, `w2_scale [E, H, G2]` float32 and
    zero points `w13_zero`, `w2_zero` (uint8, the scales' shapes; see `dequantize_int_experts`). Each chosen expert
    is dequantized to hidden's dtype first.
    """
    num_tokens, hidden_size = hidden.shape
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        token_index, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden[token_index]
        gate_up = F.linear(x, _expert_weight(w13, w13_scale, w13_zero, expert, hidden.dtype, hidden_size),
                           None if w13_bias is None else w13_bias[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(moe_activation(gate, up, activation, swiglu_limit),
                     _expert_weight(w2, w2_scale, w2_zero, expert, hidden.dtype, w13.shape[1] // 2),
                     None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, token_index, y.float() * topk_weights[token_index, slot].float()[:, None])
    return out.to(hidden.dtype)


def _expert_weight(weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None, expert: int,
                   dtype: torch.dtype, in_features: int) -> torch.Tensor:
    if scale is None and weight.dtype == dtype:
        return weight[expert]
    return dequantize_expert(weight[expert], None if scale is None else scale[expert],
                             None if zero is None else zero[expert], in_features).to(dtype)
