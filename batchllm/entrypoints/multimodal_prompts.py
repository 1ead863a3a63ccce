"""The doors' side of image inputs: prompts with images → the rows the engine takes, a failed image failing its row.

A prompt with images is a dict, vLLM's shape: `{"prompt": text or token ids (or "prompt_token_ids"),
"multi_modal_data": {"image": one image or a list}}`; an image is bytes, a PIL image, a path, a `data:` URL, or
(with `allow_remote_media`) an http(s) URL (multimodal/media.py). The images of a call are decoded and processed on
worker threads, those given as bytes once however often they repeat (multimodal/image_cache.py); then each row's
placeholders are expanded by the model's processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.entrypoints.llm_inputs import prompt_content, prompt_images
from batchllm.model.config import ModelConfig
from batchllm.multimodal.image_cache import ProcessedImages
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.multimodal.media import MediaError
from batchllm.multimodal.processor import image_prompt_processor


@dataclass(frozen=True, slots=True)
class PreparedRow:
    """A prompt with images, ready for the engine; `error` (a bad image) fails the row alone."""

    text: str | None
    token_ids: list[int]
    mm: MultiModalPrompt | None
    error: str | None = None


class MultiModalPrompts:
    def __init__(self, model_path: str | Path, model_config: ModelConfig, tokenizer: Any,
                 allow_remote_media: bool, refusal: str | None = None) -> None:
        """`refusal`: why this engine takes no images though its model could (`image_refusal`)."""
        self.architecture = model_config.architecture
        self.processor = (None if model_config.vision is None
                          else image_prompt_processor(model_path, model_config.vision, tokenizer))
        self.allow_remote_media = allow_remote_media
        self.refusal = refusal
        self.images = None if self.processor is None else ProcessedImages(self.processor.preprocess,
                                                                           allow_remote_media)

    def check(self, prompts: dict[int, dict[str, Any]]) -> dict[int, tuple[str | None, list[int] | None]]:
        """Each row's `(text, token ids)` as given (one of them None); a malformed dict, or images for a text-only
        model, is a ValueError naming its row: the caller's mistake, which fails the whole call before it runs."""
        for index, prompt in prompts.items():
            if prompt_images(prompt, index) and self.processor is None:
                raise ValueError(f"prompt {index} has images, but {self.architecture} takes text only")
            if prompt_images(prompt, index) and self.refusal is not None:
                raise ValueError(f"prompt {index} has images: {self.refusal}")
        return {index: prompt_content(prompt, index) for index, prompt in prompts.items()}

    def prepare(self, prompts: dict[int, dict[str, Any]], add_special_tokens: bool = True) -> dict[int, PreparedRow]:
        """Rows `index → prompt dict` (checked by `check`) → engine rows; an image that does not load or fit, or a
        prompt whose placeholders do not match its images, fails that row alone."""
        sources: dict[int, list[Any]] = {index: prompt_images(prompt, index) for index, prompt in prompts.items()}
        loaded = iter(self.images.get([source for images in sources.values() for source in images]))
        rows: dict[int, PreparedRow] = {}
        for index, prompt in prompts.items():
            text, token_ids = prompt_content(prompt, index)
            images = [next(loaded) for _ in sources[index]]
            failed = next((image for image in images if isinstance(image, MediaError)), None)
            if failed is not None:
                rows[index] = PreparedRow(text, [], None, f"prompt {index}: {failed}")
                continue
            try:
                ids, mm = self.processor.process(text if token_ids is None else token_ids, images, index,
                                                 add_special_tokens)
            except ValueError as exc:
                rows[index] = PreparedRow(text, [], None, str(exc))
                continue
            rows[index] = PreparedRow(text, ids, mm if mm.images else None)
        return rows

