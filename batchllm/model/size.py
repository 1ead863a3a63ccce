"""A model's parameter count by role, from its config alone (no weights read): the dry run's estimate and the
default step budget (batchllm/config.py) use it."""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.model.config import ModelConfig, causal_lm_of


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Parameters by role: `layers` (attention, MLP and their norms), the token `embedding`, the `head` a logits
    row multiplies (tied to the embedding or not) and whether the checkpoint stores the head apart.
    `linear`: the part of `layers` in linear weights (attention and MLP projections, every expert's), which a
    quantized model holds in fewer bits; the rest of `layers` (norms, biases, the MoE router) stays in the model's
    dtype. `active_layers`: the part of `layers` one token multiplies by, fewer than `layers` in a
    Mixture-of-Experts model (only its top-k experts; None: all of them, a dense model). `experts`: the part of
    `linear` in the routed experts' projections, which MXFP4 alone quantizes."""

    layers: int
    embedding: int
    head: int
    head_stored: bool
    final_norm: int
    linear: int
    active_layers: int | None = None
    experts: int = 0

    @property
    def active(self) -> int:
        """The decoder-layer parameters a token's forward pass multiplies by (its FLOPs are twice this)."""
        return self.layers if self.active_layers is None else self.active_layers

    @property
    def parameters(self) -> int:
        """What the checkpoint stores (a tied head counts once)."""
        return self.layers + self.embedding + self.final_norm + (self.head if self.head_stored else 0)


def model_size(config: ModelConfig) -> ModelSize:
    """The parameter count of a Llama-family model (batchllm/model/llama.py, and its MoE families, moe.py) from its
    config alone."""
    h, heads, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention_linear = h * heads * d + 2 * h * kv * d + heads * d * h
    attention = attention_linear
    if config.attention_bias:
        attention += heads * d + 2 * kv * d
    if config.o_proj_bias:
        attention += h
    if config.attention_sinks:
        attention += heads
    mlp_linear = 3 * h * config.intermediate_size
    mlp = mlp_linear + (2 * config.intermediate_size + h if config.mlp_bias else 0)
    norms = 2 * h + (2 * d if config.qk_norm else 0)
    classifier = causal_lm_of(config.architecture) != config.architecture
    head = config.num_labels * h if classifier else config.vocab_size * h
    layers = config.num_layers * (attention + mlp + norms)
    linear = config.num_layers * (attention_linear + mlp_linear)
    active, experts = None, 0
    if config.moe is not None:
        moe = config.moe
        sparse = sum(moe.is_sparse(i) for i in range(config.num_layers))
        expert = 3 * h * moe.moe_intermediate_size + (2 * moe.moe_intermediate_size + h if moe.expert_bias else 0)
        # A sparse layer: the router, the experts and the gated shared expert instead of the dense MLP.
        block = (h + moe.router_bias) * moe.num_experts + (3 * h * moe.shared_expert_intermediate_size + h
                                                           if moe.shared_expert_intermediate_size else 0)
        layers += sparse * (block + moe.num_experts * expert - mlp)
        shared = moe.shared_expert_intermediate_size or 0
        linear += sparse * (3 * h * (moe.num_experts * moe.moe_intermediate_size + shared) - mlp_linear)
        active = layers - sparse * (moe.num_experts - moe.num_experts_per_tok) * expert
        experts = sparse * 3 * h * moe.num_experts * moe.moe_intermediate_size
    return ModelSize(layers, config.vocab_size * h, head, classifier or not config.tie_word_embeddings, h, linear,
                     active, experts)
