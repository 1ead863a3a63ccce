"""Qwen2.5-VL: Qwen2's decoder with multimodal RoPE, and a vision tower whose rows replace the image placeholders.

The decoder is Llama's (`llama.py`) with `MRotaryEmbedding` (its config's `mrope_section`); the runner's
multimodal step (executor/multimodal_step.py) calls `encode_images` for the images a step reaches and hands the
merged embeddings to `forward(inputs_embeds=...)`. transformers 5 names the checkpoint's tensors
`model.language_model.*` and `model.visual.*`, transformers 4 `model.*` and `visual.*`; both load.
"""

from __future__ import annotations

from typing import Any

import torch

from batchllm.model.config import ModelConfig
from batchllm.model.llama import LlamaForCausalLM
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.uploads import rows_to_device


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    checkpoint_prefix_renames = {"model.language_model.": "model.", "model.visual.": "visual."}
    checkpoint_unpacked_prefixes = ("visual.",)

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None) -> None:
        """The vision tower is never quantized (quantized releases keep it in 16 bits); under pipeline
        parallelism the first stage, which embeds the tokens, holds it."""
        from batchllm.model.qwen2_5_vl_vision import Qwen2_5_VisionTower  # torch only, but only for this family

        super().__init__(config, quant_config)
        assert config.vision is not None
        self.merge = config.vision.spatial_merge_size
        self.visual = Qwen2_5_VisionTower(config.vision.vision_config) if self.model.stage.has_embedding else None

    def held_elsewhere(self, checkpoint_name: str) -> bool:
        if checkpoint_name.startswith("visual."):
            return self.visual is None
        return super().held_elsewhere(checkpoint_name)

    def encode_images(self, images: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's merged embeddings `[t*h*w / merge^2, hidden]`, from its processor outputs
        (`pixel_values [patches, features]`, `image_grid_thw [3]`); all images in one tower call."""
        device, dtype = self.model.embed_tokens.weight.device, self.model.embed_tokens.weight.dtype
        # Queued behind the running step (pinned memory), never waiting for it; the grids stay on the host.
        pixels = rows_to_device([image["pixel_values"] for image in images], device, dtype)
        grids = torch.stack([torch.as_tensor(image["image_grid_thw"]).reshape(3) for image in images])
        rows = self.visual(pixels, grids)
        return list(rows.split([int(grid.prod()) // self.merge**2 for grid in grids]))
