"""gpt-oss (`GptOssForCausalLM`): the Llama decoder with attention sinks and a Mixture-of-Experts MLP in every layer.

Attention: q/k/v/o biases, a learned sink logit per head (`self_attn.sinks` in the checkpoint; the attention
kernels add it to each softmax's denominator), even layers windowed (128 tokens) and odd ones full, YaRN RoPE: all
config (gpt_oss_config.py) that `LlamaForCausalLM` follows. MLP (`mlp.router`, `mlp.experts`):
a linear router with a bias, the top-k of its logits then a softmax over those k, and experts with biases and
the clamped SwiGLU (`swigluoai`), run by `FusedMoE`'s kernels.

The checkpoint stores all of a layer's experts in one tensor per projection, transposed against ours and with
gate and up interleaved: `experts.gate_up_proj [E, H, 2I]` (column 2j: gate's feature j, column 2j + 1: up's),
`gate_up_proj_bias [E, 2I]` likewise, `down_proj [E, I, H]`, `down_proj_bias [E, H]`. Each is read whole-shaped
and handed expert by expert, de-interleaved and transposed, to `FusedMoE`'s loaders, which quantize the weights
as the layer's expert method stores them (`quantization="fp8"`) and keep this rank's slice of the intermediate
features as they do for the other MoE families. MXFP4 checkpoints (the released models) store the experts'
weights as blocks and scales instead, read by gpt_oss_mxfp4.py.
"""

from __future__ import annotations

import torch
from torch import nn

from batchllm.model.config import ModelConfig
from batchllm.model.gpt_oss_mxfp4 import MXFP4_RENAMES, use_mxfp4_checkpoint
from batchllm.model.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from batchllm.model.llama import LlamaForCausalLM
from batchllm.model.quantization.config import MXFP4, QuantConfig


class GptOssExperts(FusedMoE):
    """`FusedMoE` with biases and the clamped SwiGLU, loaded from gpt-oss's stacked, interleaved tensors and
    routed by gpt-oss's rule: `forward(hidden [T, H], router_logits [T, E])`."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        moe = config.moe
        super().__init__(moe.num_experts, moe.num_experts_per_tok, config.hidden_size, moe.moe_intermediate_size,
                         renormalize=True, activation="swigluoai", bias=True, quant_config=quant_config,
                         swiglu_limit=moe.swiglu_limit)
        experts, hidden, inter = moe.num_experts, config.hidden_size, moe.moe_intermediate_size
        # The checkpoint's whole-layer shapes (shard id None): `load_stacked` cuts them into FusedMoE's shards.
        for name, shape in (("w13_weight", (experts, hidden, 2 * inter)), ("w13_bias", (experts, 2 * inter)),
                            ("w2_weight", (experts, inter, hidden)), ("w2_bias", (experts, hidden))):
            param = getattr(self, name)
            param.weight_loader, param.checkpoint_shapes = self.load_stacked, {None: shape}
        if quant_config is not None and quant_config.checkpoint_format == MXFP4:
            use_mxfp4_checkpoint(self, experts, hidden, inter)

    def load_stacked(self, param: nn.Parameter, loaded, shard_id: None = None) -> None:
        """One of the checkpoint's stacked expert tensors (a tensor or a lazy `CheckpointSlice`) into `param`,
        one expert at a time: gate is the even columns of `gate_up_proj`, up the odd ones. A weight goes through
        `load_full_weight` (quantized there if the experts are), a bias straight to `weight_loader`."""
        is_down = param is self.w2_weight or param is self.w2_bias
        load = self.weight_loader if param is self.w13_bias or param is self.w2_bias else self.load_full_weight
        for expert in self.local_experts:
            tensor = loaded.narrow(0, expert, 1)[0]  # read: a lazy slice's narrow reads
            if is_down:
                # down_proj[e] is [I, H] (x @ W); ours is [H, I]. Its bias [H] goes as it is.
                load(param, tensor.t() if tensor.dim() == 2 else tensor, (expert, DOWN))
                continue
            gate, up = tensor[..., 0::2], tensor[..., 1::2]
            for part, value in ((GATE, gate), (UP, up)):
                load(param, value.t() if value.dim() == 2 else value, (expert, part))

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # gpt-oss's routing: the k largest logits, then a softmax over those k only (not over every expert).
        top_logits, topk_ids = torch.topk(router_logits.float(), self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), topk_ids


class GptOssMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        super().__init__()
        # Unquantized and whole on every rank: its logits pick the experts, so all ranks must agree.
        self.router = nn.Linear(config.hidden_size, config.moe.num_experts, bias=True)
        self.experts = GptOssExperts(config, quant_config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssForCausalLM(LlamaForCausalLM):
    # The sink logits sit on the checkpoint's attention module, on our paged attention layer.
    checkpoint_module_renames = {
        ".self_attn.sinks": ".self_attn.attn.sinks",
        **MXFP4_RENAMES,
        # `_bias` first: `.experts.gate_up_proj` is a prefix of it.
        ".experts.gate_up_proj_bias": ".experts.w13_bias",
        ".experts.gate_up_proj": ".experts.w13_weight",
        ".experts.down_proj_bias": ".experts.w2_bias",
        ".experts.down_proj": ".experts.w2_weight",
    }

    def layer_mlp(self, config: ModelConfig, quant_config: QuantConfig | None, layer: int) -> nn.Module:
        return GptOssMLP(config, quant_config)
