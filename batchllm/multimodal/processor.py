"""A prompt and its images → the token ids the model reads and the `MultiModalPrompt` the engine carries.

The images go through the model's own HF image processor (transformers' PIL backend: no torchvision), which sizes
and normalises them and says how many embeddings each becomes; each image's one placeholder token in the prompt
(what the chat template writes, e.g. Qwen2.5-VL's `<|vision_start|><|image_pad|><|vision_end|>`) is expanded to
that many. Decoding and `preprocess` run per image on worker threads (`image_cache.ProcessedImages`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from batchllm.model.mrope import mrope_positions
from batchllm.multimodal.inputs import ImageInput, MultiModalPrompt, ProcessedImage
from batchllm.multimodal.media import image_hash
from batchllm.multimodal.spec import VisionSpec


def image_prompt_processor(model_path: str | Path, spec: VisionSpec, tokenizer: Any) -> Any:
    """The model family's processor: `preprocess(image) -> ProcessedImage` (one decoded image, through the model's
    HF image processor), `process(prompt, processed images, index, add_special_tokens) -> (token ids,
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

    def preprocess(self, image: Any) -> ProcessedImage:
        """A decoded RGB PIL image → its patches (`pixel_values [patches, features]`), patch grid and token count."""
        processed = self.image_processor(images=[image], return_tensors="np")
        grid = np.asarray(processed["image_grid_thw"], dtype=np.int64).reshape(3)
        data = {"pixel_values": np.asarray(processed["pixel_values"]), "image_grid_thw": grid}
        return ProcessedImage(image_hash(image), int(grid.prod()) // self.spec.spatial_merge_size**2, data)

    def process(self, prompt: str | list[int], images: list[ProcessedImage], index: int,
                add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt]:
        """`prompt` (text, or token ids) with one image placeholder token per image of `images` (in prompt order).
        ValueError naming row `index` when the counts differ."""
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
        expanded: list[int] = []
        items: list[ImageInput] = []
        previous = 0
        for place, image in zip(places, images, strict=True):
            expanded += token_ids[previous:place]
            items.append(ImageInput(image.hash, len(expanded), image.length, image.data))
            expanded += [image_token] * image.length
            previous = place + 1
        expanded += token_ids[previous:]
        grids = [tuple(int(v) for v in image.data["image_grid_thw"]) for image in images]
        positions, delta = mrope_positions(expanded, grids, image_token, self.spec.spatial_merge_size)
        return expanded, MultiModalPrompt(tuple(items), positions, int(delta))
