"""What an engine's options rule out for images though its model takes them (torch- and Pillow-free)."""

from __future__ import annotations

from typing import Any

from batchllm.model.config import ModelConfig


def image_refusal(config: Any, model_config: ModelConfig) -> str | None:
    """Why this engine cannot take images though its model can, or None. Refused by name: speculative decoding
    (drafts would need the multimodal positions), pipeline parallelism (the stages after the first would need the
    image rows' 3-D positions without the tower), `deterministic=True` (the vision tower's GEMMs and attention are
    not batch-invariant, and a step encodes whichever images its rows reach) and pooling tasks; a model whose image
    tokens attend both ways (Gemma 3) computes each image in one step, which the step budget must hold. Text
    prompts run as on any model."""
    vision, architecture = model_config.vision, model_config.architecture
    refused = [name for name, used in (("speculative_config", config.speculative is not None),
                                       ("pipeline_parallel_size", config.parallel.pipeline_parallel_size > 1),
                                       ("deterministic=True", config.deterministic),
                                       ("disaggregated", config.kv_transfer.disaggregated is not None),
                                       (f"task={config.pooling.task!r}", config.pooling.task != "generate")) if used]
    if refused:
        return f"LLM argument {refused[0]} does not work with images on {architecture} yet (text prompts do)"
    budget = config.scheduler.max_num_batched_tokens
    if vision.bidirectional and vision.tokens_per_image and budget < vision.tokens_per_image:
        return (f"LLM argument max_num_batched_tokens={budget} is smaller than an image of {architecture} "
                f"({vision.tokens_per_image} tokens, which are computed in one step)")
    return None
