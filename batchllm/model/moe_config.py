"""Config of the Mixture-of-Experts families (Mixtral, Qwen2-MoE, Qwen3-MoE), read the way transformers reads it.

Their attention and norms are those of a Llama-family sibling (Mixtral: Mistral's, Qwen2-MoE: Qwen2's, Qwen3-MoE:
Qwen3's), so the config is parsed as that sibling's, then the MoE switches (`MoEConfig`) and the differences of
the sibling's defaults are set. Torch-free, like config.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchllm.model.config import ModelConfig, architecture_of, required

# MoE architecture → the dense sibling whose attention, norms and config spelling it shares.
_DENSE_SIBLING = {
    "MixtralForCausalLM": "MistralForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The experts of a MoE decoder. A layer is sparse (router + experts) unless it is in `mlp_only_layers` or
    `(layer + 1) % decoder_sparse_step != 0`; a dense layer has the plain gated MLP of `intermediate_size`."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral always does)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    decoder_sparse_step: int = 1
    mlp_only_layers: frozenset[int] = frozenset()
    router_bias: bool = False  # gpt-oss: the router's linear has a bias
    expert_bias: bool = False  # gpt-oss: each expert's gate/up and down projections have biases

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes its tokens to experts (HF's rule, Qwen2MoeDecoderLayer)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    architecture = architecture_of(hf)
    num_layers = required(hf, "num_hidden_layers")
    sibling = dict(hf, architectures=[_DENSE_SIBLING[architecture]])
    if architecture == "MixtralForCausalLM":
        sibling["sliding_window"] = hf.get("sliding_window")  # Mistral's default is 4096, Mixtral's none
    elif architecture == "Qwen3MoeForCausalLM":
        # Qwen3-MoE windows every layer when use_sliding_window is set (Qwen3 only those from max_window_layers).
        sibling["layer_types"] = ["sliding_attention"] * num_layers
    elif hf.get("use_sliding_window") and hf.get("layer_types") is None:
        # Qwen2-MoE's own default (configuration_qwen2_moe.py): every other layer below max_window_layers.
        max_window_layers = int(hf.get("max_window_layers", 28))
        sibling["layer_types"] = ["sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
                                  for i in range(num_layers)]
    config = ModelConfig.from_hf_dict(sibling)
    if architecture == "MixtralForCausalLM":
        moe = MoEConfig(num_experts=_positive(hf, "num_local_experts", 8),
                        num_experts_per_tok=_positive(hf, "num_experts_per_tok", 2),
                        moe_intermediate_size=_positive(hf, "intermediate_size", None), norm_topk_prob=True)
    else:
        moe = MoEConfig(
            # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map).
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts",
                                                         60 if architecture == "Qwen2MoeForCausalLM" else 128))),
            num_experts_per_tok=_positive(hf, "num_experts_per_tok", 4 if architecture == "Qwen2MoeForCausalLM" else 8),
            moe_intermediate_size=_positive(hf, "moe_intermediate_size", None),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=(int(hf.get("shared_expert_intermediate_size", 5632))
                                             if architecture == "Qwen2MoeForCausalLM" else 0),
            decoder_sparse_step=_positive(hf, "decoder_sparse_step", 1),
            mlp_only_layers=frozenset(hf.get("mlp_only_layers") or ()))
    if moe.num_experts_per_tok > moe.num_experts > 0:
        raise ValueError(f"config.json num_experts_per_tok={moe.num_experts_per_tok} exceeds the "
                         f"{moe.num_experts} experts")
    changes: dict[str, Any] = {"architecture": architecture, "moe": moe}
    if architecture == "Qwen2MoeForCausalLM":
        changes["attention_bias"] = bool(hf.get("qkv_bias", True))  # q/k/v only, as in Qwen2
    return dataclasses.replace(config, **changes)


def _positive(hf: dict[str, Any], key: str, default: int | None) -> int:
    value = hf.get(key, default) if default is not None else required(hf, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json {key} must be a positive integer, got {value!r}")
    return value
