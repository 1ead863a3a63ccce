"""A prompt and its images → the token ids the model reads and the `MultiModalPrompt` the engine carries.

The images go through the model's own HF image processor (transformers' PIL backend: no torchvision), which sizes
and normalises them and says how many embeddings each becomes; each image's one placeholder token in the prompt
(what the chat template writes, e.g. Qwen2.5-VL's `<|vision_start|><|image_pad|><|vision_end|>`) is expanded to
that many. Decoding the images happens before, in `media.load_images`'s worker threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from batchllm.model.mrope import mrope_positions
from batchllm.multimodal.inputs import ImageInput, MultiModalPrompt
from batchllm.multimodal.media import image_hash
from batchllm.multimodal.spec import VisionSpec


def image_prompt_processor(model_path: str | Path, spec: VisionSpec, tokenizer: Any) -> Any:
    """The model family's processor: `process(prompt, images, index, add_special_tokens) -> (token ids,
    MultiModalPrompt)`, and `placeholder_token_id`, the one token a prompt holds per image."""
    if spec.family == "gemma3":
        from batchllm.multimodal.gemma3_processor import Gemma3PromptProcessor

        return Gemma3PromptProcessor(model_path, spec, tokenizer)
    if spec.family != "qwen2_5_vl":
        raise ValueError(f"image inputs are not supported for the {spec.family!r} family yet")
    return ImagePromptProcessor(model_path, spec, tokenizer)


def load_image_processor(processor_class: type, model_path: str | Path, **defaults: Any) -> Any:
    """The checkpoint's own image processor (its preprocessor_config.json), or `processor_class(**defaults)`."""
    path = Path(model_path)
    if (path / "preprocessor_config.json").is_file():
        return processor_class.from_pretrained(str(path), local_files_only=True)
    return processor_class(**defaults)


class ImagePromptProcessor:
    """Qwen2.5-VL's."""

    def __init__(self, model_path: str | Path, spec: VisionSpec, tokenizer: Any) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.spec = spec
        self.tokenizer = tokenizer
        self.placeholder_token_id = spec.image_token_id
        self.image_processor = load_image_processor(Qwen2VLImageProcessorPil, model_path)

    def process(self, prompt: str | list[int], images: list[Any], index: int,
                add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt]:
        """`prompt` (text, or token ids) with one image placeholder token per image of `images` (decoded PIL
        images, in prompt order). ValueError naming row `index` when the counts differ."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text, but the LLM was built with skip_tokenizer_init=True")
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            token_ids = list(prompt)
        image_token = self.spec.image_token_id
        places = [i for i, token in enumerate(token_ids) if token == image_token]
        if len(places) != len(images):
            raise ValueError(f"prompt {index} has {len(places)} image placeholder token(s) (id {image_token}) for "
                             f"{len(images)} image(s): put one per image in the prompt (the chat template does)")
        if not images:
            return token_ids, MultiModalPrompt(())
        processed = self.image_processor(images=images, return_tensors="np")
        grids = np.asarray(processed["image_grid_thw"], dtype=np.int64)
        pixels = np.asarray(processed["pixel_values"])
        merge = self.spec.spatial_merge_size
        expanded: list[int] = []
        items: list[ImageInput] = []
        previous, first_patch = 0, 0
        for place, grid, image in zip(places, grids, images, strict=True):
            expanded += token_ids[previous:place]
            length = int(grid.prod()) // merge**2
            patches = int(grid.prod())
            data = {"pixel_values": pixels[first_patch:first_patch + patches], "image_grid_thw": grid}
            items.append(ImageInput(image_hash(image), len(expanded), length, data))
            expanded += [image_token] * length
            previous, first_patch = place + 1, first_patch + patches
        expanded += token_ids[previous:]
        positions, delta = mrope_positions(expanded, [tuple(int(v) for v in g) for g in grids], image_token, merge)
        return expanded, MultiModalPrompt(tuple(items), positions, int(delta))
