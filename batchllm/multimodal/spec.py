"""What a vision-language model's config says about its image side (torch-free: the engine and the doors read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """`family`: which encoder and which prompt layout ("qwen2_5_vl"). `image_token_id`: the placeholder token the
    processor repeats once per image embedding; the runner puts the encoder's rows at those positions.
    `vision_config`: the checkpoint's `vision_config` as written, for the encoder. `spatial_merge_size`: patches
    merged per side into one embedding (Qwen2-VL's grid of t x h x w patches gives t*h*w / merge^2 tokens).
    Gemma 3: `start_token_id` is the one placeholder a prompt holds per image, which becomes start, `tokens_per_image`
    image tokens and `end_token_id`; `bidirectional`: an image's tokens attend to each other both ways."""

    family: str
    image_token_id: int
    vision_config: dict[str, Any] = field(hash=False, compare=False)
    spatial_merge_size: int = 1
    start_token_id: int | None = None
    end_token_id: int | None = None
    tokens_per_image: int | None = None
    bidirectional: bool = False
