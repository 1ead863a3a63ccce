"""What a request carries for its images, from the door to the runner (torch-free: the engine holds these).

The engine reads only each image's place in the prompt and its content hash (prefix-cache keys, the step's
encoder work); the processor's tensors ride along, opaque, to the runner's encoder step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image through the model's image processor, before it has a place in a prompt: its content hash, how
    many placeholder tokens (encoder output rows) it becomes, and the processor's outputs for it alone."""

    hash: str
    length: int
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens are `[offset, offset + length)`, one per encoder output row.
    `hash`: the decoded image's content hash (same picture, same hash, however it was given); it keys the runner's
    encoder-output cache and the prefix-cache blocks that hold the image. `data`: the model's processor outputs for
    this image alone (Qwen2.5-VL: `pixel_values [patches, features]` and `image_grid_thw [3]`)."""

    hash: str
    offset: int
    length: int
    data: dict[str, Any]

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class MultiModalPrompt:
    """The images of one prompt, in prompt order. Multimodal RoPE models (Qwen2-VL) add `mrope_positions`
    (`[3, num_prompt_tokens]` int64, numpy) and `mrope_delta`: a token at index i past the last image sits at
    position i + delta in every component. `bidirectional` (Gemma 3): see below."""

    images: tuple[ImageInput, ...]
    mrope_positions: Any = None
    mrope_delta: int = 0
    # Gemma 3: each image's tokens attend to each other both ways, so a prefill chunk never ends inside an image.
    bidirectional: bool = False

    @property
    def last_image_end(self) -> int:
        """Tokens from here on have one position each (`index + mrope_delta`); before it, positions are 3-D. Read
        for every running row of every step: the images are in prompt order, so the last one ends last."""
        return self.images[-1].end if self.images else 0

    def image_hashes_in(self, start: int, end: int) -> tuple[str, ...]:
        """The hashes of the images with a placeholder token in `[start, end)`: what a KV block there depends on."""
        return tuple(image.hash for image in self.images if image.offset < end and image.end > start)
