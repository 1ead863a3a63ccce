"""A model's parameter count by role, from its config alone (no weights read): the dry run's estimate and the
default step budget (batchllm/config.py) use it."""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.model.config import ModelConfig, causal_lm_of


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Parameters by role: `layers` (attention, MLP and their norms), the token `embedding`, the `head` a logits
    row multiplies (tied to the embedding or not) and whether the checkpoint stores the head apart."""

    layers: int
    embedding: int
    head: int
    head_stored: bool
    final_norm: int

    @property
    def parameters(self) -> int:
        """What the checkpoint stores (a tied head counts once)."""
        return self.layers + self.embedding + self.final_norm + (self.head if self.head_stored else 0)


def model_size(config: ModelConfig) -> ModelSize:
    """The parameter count of a Llama-family model (batchllm/model/llama.py) from its config alone."""
    h, heads, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention = h * heads * d + 2 * h * kv * d + heads * d * h
    if config.attention_bias:
        attention += heads * d + 2 * kv * d
    if config.o_proj_bias:
        attention += h
    mlp = 3 * h * config.intermediate_size + (2 * config.intermediate_size + h if config.mlp_bias else 0)
    norms = 2 * h + (2 * d if config.qk_norm else 0)
    classifier = causal_lm_of(config.architecture) != config.architecture
    head = config.num_labels * h if classifier else config.vocab_size * h
    return ModelSize(config.num_layers * (attention + mlp + norms), config.vocab_size * h, head,
                     classifier or not config.tie_word_embeddings, h)
