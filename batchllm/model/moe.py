"""Mixture-of-Experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama decoder with a sparse MoE block as the
MLP of its sparse layers.

Attention, norms, RoPE and windows are those of the dense sibling (Mistral, Qwen2, Qwen3), which
`LlamaForCausalLM` follows from the config; only the MLP differs: a router (`gate`, replicated on every
tensor-parallel rank), the experts (`FusedMoE`) and, in Qwen2-MoE, a shared expert (a dense gated MLP) scaled by
`sigmoid(shared_expert_gate(x))`. Dense layers of the Qwen MoE families (`mlp_only_layers`,
`decoder_sparse_step`) keep Llama's MLP. Module names follow the checkpoints (`block_sparse_moe` in Mixtral,
`mlp` in the Qwen families, ours), so besides that rename only the experts' tensors need mapping
(`expert_checkpoint_projections`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from batchllm.model.config import ModelConfig
from batchllm.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from batchllm.model.llama import LlamaForCausalLM, LlamaMLP
from batchllm.model.quantization.config import QuantConfig


class SparseMoeBlock(nn.Module):
    """`forward(hidden [T, H]) -> [T, H]`: routed experts, plus the gated shared expert where the config has one."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        moe = config.moe
        # The router stays unquantized and whole on every rank: its logits pick the experts, so all ranks must agree.
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(moe.num_experts, moe.num_experts_per_tok, config.hidden_size,
                                moe.moe_intermediate_size, renormalize=moe.norm_topk_prob, quant_config=quant_config)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(config, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared, quant_config)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            # Its down projection all-reduces on its own: a second all-reduce under tensor parallelism.
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


class _MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers (`config.moe.is_sparse`) hold a `SparseMoeBlock`."""

    expert_checkpoint_projections = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}

    def layer_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, layer: int) -> nn.Module:
        if config.moe is None or not config.moe.is_sparse(layer):
            return super().layer_mlp(config, quant_config, layer)
        return SparseMoeBlock(config, quant_config)


class MixtralForCausalLM(_MoeForCausalLM):
    # Mixtral's checkpoints call the block `block_sparse_moe` (ours: the layer's `mlp`) and an expert's projections
    # w1 (gate), w3 (up), w2 (down).
    checkpoint_module_renames = {".block_sparse_moe.": ".mlp."}
    expert_checkpoint_projections = {"w1": GATE, "w3": UP, "w2": DOWN}


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    """Qwen2-MoE: Qwen2's attention (q/k/v bias), a shared expert in every sparse layer."""


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), no shared expert."""
