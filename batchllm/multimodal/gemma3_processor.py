"""Gemma 3's prompts with images: each `<start_of_image>` becomes the image's token run, transformers' way.

transformers' Gemma3Processor replaces each start-of-image token in the prompt text by "\\n\\n", the start token,
`mm_tokens_per_image` image tokens, the end token and "\\n\\n", then tokenizes; the same is done here (a prompt given
as token ids gets the same ids spliced in, the newlines tokenized on their own). Images are resized to the tower's
square input by transformers' PIL image processor (no pan-and-scan crops).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from batchllm.multimodal.inputs import ImageInput, MultiModalPrompt, ProcessedImage
from batchllm.multimodal.media import image_hash
from batchllm.multimodal.processor import load_image_processor
from batchllm.multimodal.spec import VisionSpec


class Gemma3PromptProcessor:
    def __init__(self, model_path: str | Path, spec: VisionSpec, tokenizer: Any) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        self.spec = spec
        self.tokenizer = tokenizer
        self.placeholder_token_id = spec.start_token_id
        side = int(spec.vision_config.get("vision_config", {}).get("image_size", 896))
        self.image_processor = load_image_processor(Gemma3ImageProcessorPil, model_path,
                                                    size={"height": side, "width": side})

    def preprocess(self, image: Any) -> ProcessedImage:
        """A decoded RGB PIL image → the tower's square input (`pixel_values [3, side, side]`)."""
        pixels = np.asarray(self.image_processor(images=[image], return_tensors="np")["pixel_values"])[0]
        return ProcessedImage(image_hash(image), self.spec.tokens_per_image, {"pixel_values": pixels})

    def process(self, prompt: str | list[int], images: list[ProcessedImage], index: int,
                add_special_tokens: bool = True) -> tuple[list[int], MultiModalPrompt]:
        spec, count = self.spec, self.spec.tokens_per_image
        start, end, image_token = spec.start_token_id, spec.end_token_id, spec.image_token_id
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text, but the LLM was built with skip_tokenizer_init=True")
            boi = self.tokenizer.convert_ids_to_tokens(start)
            places = prompt.count(boi)
            if places == len(images) and images:
                run = "".join(self.tokenizer.convert_ids_to_tokens([image_token] * count))
                eoi = self.tokenizer.convert_ids_to_tokens(end)
                prompt = prompt.replace(boi, f"\n\n{boi}{run}{eoi}\n\n")
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            places = sum(token == start for token in prompt)
            newlines = [] if self.tokenizer is None else self.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
            token_ids = []
            for token in prompt:
                token_ids += [*newlines, start, *[image_token] * count, end, *newlines] if token == start else [token]
        if places != len(images):
            raise ValueError(f"prompt {index} has {places} image placeholder token(s) (id {start}) for "
                             f"{len(images)} image(s): put one per image in the prompt (the chat template does)")
        if not images:
            return token_ids, MultiModalPrompt(())
        offsets = [i for i, token in enumerate(token_ids) if token == image_token and token_ids[i - 1] == start]
        if len(offsets) != len(images):
            raise ValueError(f"prompt {index}: {len(offsets)} image token runs for {len(images)} image(s)")
        items = tuple(ImageInput(image.hash, offset, count, image.data)
                      for image, offset in zip(images, offsets, strict=True))
        return token_ids, MultiModalPrompt(items, bidirectional=True)
