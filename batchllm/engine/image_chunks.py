"""How a prompt's images shape its prefill chunks: the encoder rows a chunk costs, and where a chunk may end."""

from __future__ import annotations

from batchllm.engine.request import Request
from batchllm.multimodal.inputs import MultiModalPrompt


def encoder_work(request: Request, num_new: int) -> int:
    """The encoder output rows of the images whose first placeholder token is among the `num_new` tokens from
    `request.num_computed_tokens` on: their encoder runs in this step (unless the runner has them cached)."""
    start = request.num_computed_tokens
    return sum(image.length for image in request.mm.images if start <= image.offset < start + num_new)


def whole_images(mm: MultiModalPrompt, start: int, num_new: int, budget: int) -> int:
    """The tokens to compute from `start` (at most `num_new`, itself within `budget`) so that the chunk does not end
    inside an image whose tokens attend to each other both ways (Gemma 3): cut before the image, or, when the chunk
    starts at or in it, run to its end if the budget holds that, else 0 (the request waits for a step with room:
    `check_vision_options` makes the whole budget hold any image)."""
    end = start + num_new
    for image in mm.images:
        if image.offset < end < image.end:
            if image.offset > start:
                return image.offset - start
            return image.end - start if image.end - start <= budget else 0
    return num_new
