"""Pipeline stages: which decoder layers each stage holds, and what else it holds.

Stages take contiguous runs of layers, balanced by parameter count: the first stage also holds the token
embedding, the last the final norm and the LM head (with tied embeddings, its own copy of the embedding table,
which the logits read). Every stage holds at least one layer.
"""

from __future__ import annotations

import re
from functools import cache

from batchllm.model.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_params(config: ModelConfig) -> int:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (q + 2 * kv) + q * config.hidden_size
    return attention + 3 * config.hidden_size * config.intermediate_size + 2 * config.hidden_size


@cache
def _split(num_layers: int, num_stages: int, per_layer: int, first_extra: int, last_extra: int
           ) -> tuple[tuple[int, int], ...]:
    """Contiguous runs of `num_layers` over `num_stages`, at least one each, minimising the largest stage's
    parameters (a small dynamic programme: stages and layers are few)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} must be between 1 and the model's {num_layers} layers")

    def cost(stage: int, start: int, end: int) -> int:
        return ((end - start) * per_layer + (first_extra if stage == 0 else 0)
                + (last_extra if stage == num_stages - 1 else 0))

    # best[s][e]: the smallest largest-stage cost of layers [0, e) over stages 0..s, and where stage s starts.
    best = [[(float("inf"), 0)] * (num_layers + 1) for _ in range(num_stages)]
    for end in range(1, num_layers + 1):
        best[0][end] = (cost(0, 0, end), 0)
    for stage in range(1, num_stages):
        for end in range(stage + 1, num_layers + 1):
            best[stage][end] = min((max(best[stage - 1][start][0], cost(stage, start, end)), start)
                                   for start in range(stage, end))
    bounds, end = [], num_layers
    for stage in range(num_stages - 1, -1, -1):
        start = best[stage][end][1]
        bounds.append((start, end))
        end = start
    return tuple(reversed(bounds))


def stage_layers(config: ModelConfig, num_stages: int) -> tuple[tuple[int, int], ...]:
    """(first layer, end layer) of each stage."""
    table = config.vocab_size * config.hidden_size
    return _split(config.num_layers, num_stages, layer_params(config), table, table + config.hidden_size)


class StagePlan:
    """What one stage of a `num_stages` pipeline holds."""

    def __init__(self, config: ModelConfig, stage: int, num_stages: int) -> None:
        self.start, self.end = stage_layers(config, num_stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.has_embedding = self.is_first or (self.is_last and config.tie_word_embeddings)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def held_elsewhere(self, checkpoint_name: str) -> bool:
        """Whether a checkpoint tensor belongs to another stage (the loader skips it)."""
        match = _LAYER.match(checkpoint_name)
        if match is not None:
            return not self.holds_layer(int(match.group(1)))
        if checkpoint_name.startswith("model.embed_tokens."):
            return not self.has_embedding
        if checkpoint_name.startswith(("model.norm.", "lm_head.")):
            return not self.is_last
        return False
