"""Images with a row's prompt, for the table doors and the jobs (`image_column=`, messages with image parts).

Where a row's images come from:
- `image_column`: a cell holds one image or a list of them (an empty list: a text-only row); an image is bytes
  (PNG / JPEG / WebP / GIF / BMP), a PIL image, a local path or `file://` URL, a `data:` URL, an HF `datasets`
  Image value (`{"bytes", "path"}`, or the PIL image it decodes to) or, with the engine's
  `allow_remote_media=True`, an http(s) URL. A null cell fails its row.
- chat messages (`messages_column`, an OpenAI batch request's `messages`): OpenAI content parts
  `{"type": "image_url", "image_url": {"url": ...}}` and `{"type": "image", "image": ...}`, in order of appearance.
  A row may not take images from both.

Where they go in the prompt: the model reads one placeholder per image (Qwen2.5-VL's
`<|vision_start|><|image_pad|><|vision_end|>`). A prompt text that holds the placeholder token (`<|image_pad|>`)
is used as it is, one placeholder per image. One that holds none (the usual case, "Describe the image.") becomes
a user message with the images first, `[{"type": "image"}, ..., {"type": "text", "text": prompt}]`, rendered
with the model's chat template, whether or not `chat=True`: the template is what writes the placeholders. Messages
from an image column go first in the first user message.

The images are decoded and run through the model's image processor with the prompt's tokenization, on the
tokenize-ahead worker (`entrypoints/tokenize_ahead.py`), so the engine's thread never waits for them. A row
whose image does not load (corrupt, missing, too large, a refused URL) or whose placeholders do not match its
images gets that as its `error`; a prompt with images is never truncated (that would cut image tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchllm.entrypoints.chat_prompts import has_image_parts
from batchllm.multimodal.messages import split_chat_images

__all__ = ["NOT_CARRIED", "ImagePreparer", "has_image_parts", "images_first", "refuse_uncarried",
           "split_message_images"]


def split_message_images(messages: list[dict[str, Any]], check: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages with image parts → the checked conversation for the chat template (image parts as `{"type":
    "image"}`) and the image sources in order. `check` checks the text (roles, content) as for text-only messages;
    it sees each content list without its image parts, which are put back in place afterwards. ValueError for a
    malformed part, naming `messages[i].content[j]`."""
    template_messages, sources = split_chat_images(messages)
    text_only = [{**message, "content": [p for p in message["content"] if p["type"] == "text"]}
                 if isinstance(message.get("content"), list) else message for message in template_messages]
    checked = check(text_only)
    for message, original in zip(checked, template_messages):
        if isinstance(original.get("content"), list):
            message["content"] = original["content"]
    return checked, sources


def images_first(conversation: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`conversation` with `count` image parts put first in its first user message. ValueError without one."""
    for position, message in enumerate(conversation):
        if message["role"] == "user":
            content = message["content"]
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            updated = {**message, "content": [*({"type": "image"} for _ in range(count)), *parts]}
            return [*conversation[:position], updated, *conversation[position + 1:]]
    raise ValueError("the messages have no user message to put the images in")


# Several-model jobs route rows as token ids through a model router; the images would have to travel with them.
NOT_CARRIED = ("image inputs need one model: several models (models= / --model NAME=PATH) do not carry images yet; "
               "run with one model")


def refuse_uncarried(image_column: str | None, several_models: bool = False) -> None:
    """Fail a call with an image column that would run on several models before any engine starts."""
    if image_column is not None and several_models:
        raise ValueError(NOT_CARRIED)


class ImagePreparer:
    """The engine's image side (`LLM.image_prompts()`): its placeholder text, and rows → engine rows.

    ValueError when the engine takes no images: a text-only model, or an engine that cannot carry them."""

    def __init__(self, engine: Any) -> None:
        image_prompts = getattr(engine, "image_prompts", None)
        if image_prompts is None:
            raise ValueError(NOT_CARRIED)
        self.prompts = image_prompts()
        if self.prompts.processor is None:
            raise ValueError(f"the model at {engine.model_path} ({self.prompts.architecture}) takes text only; "
                             f"image inputs need a vision-language model (Qwen2.5-VL)")
        token_id = self.prompts.processor.placeholder_token_id
        self.placeholder = engine.tokenizer.convert_ids_to_tokens(token_id)

    def prepare(self, texts: Sequence[str], images: Sequence[list[Any]], add_special_tokens: bool) -> list[Any]:
        """Each prompt text with its images → a `PreparedRow` (token ids, the engine's images, or the row's error)."""
        rows = self.prompts.prepare({key: {"prompt": text, "multi_modal_data": {"image": sources}}
                                     for key, (text, sources) in enumerate(zip(texts, images))}, add_special_tokens)
        return [rows[key] for key in range(len(texts))]


def row_error(message: str, key: int) -> str:
    """A `PreparedRow`'s error without the position `prepare` was given (`prompt 3: ...`), which is not the row's."""
    prefix = f"prompt {key}"
    if message.startswith(prefix + ": "):
        return "image: " + message[len(prefix) + 2:]
    if message.startswith(prefix + " "):
        return "the prompt " + message[len(prefix) + 1:]
    return message
