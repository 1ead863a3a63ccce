"""The pure-torch reference of the mixture-of-experts MLP: the CPU path, and the oracle of the Triton kernel's tests.

Kept beside `reference.py` (which holds the other kernels' references) only for that file's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")
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


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """The experts' MLP of `hidden [T, H]`, each token through the `k` experts `topk_ids [T, k]` chose for it.

    Expert e: `w13[e] [2 * I, H]` (the gate projection's I rows first, then up's), `activation(gate, up)`,
    `w2[e] [H, I]`; optional biases `w13_bias [E, 2 * I]`, `w2_bias [E, H]`. The experts' outputs are summed
    with `topk_weights [T, k]`, accumulated in float32; the result is in hidden's dtype. A loop over the experts
    that some token chose: experts no token chose are never read.
    """
    num_tokens, hidden_size = hidden.shape
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        token_index, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden[token_index]
        gate_up = F.linear(x, w13[expert], None if w13_bias is None else w13_bias[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(moe_activation(gate, up, activation, swiglu_limit), w2[expert],
                     None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, token_index, y.float() * topk_weights[token_index, slot].float()[:, None])
    return out.to(hidden.dtype)
