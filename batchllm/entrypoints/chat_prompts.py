"""Conversations → prompt texts through the model's chat template, image content parts included (LLM.chat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchllm.multimodal.messages import split_chat_images

Messages = list[dict[str, Any]]


def render_conversations(tokenizer: Any, conversations: Sequence[Messages], chat_template: str | None,
                         add_generation_prompt: bool) -> tuple[list[str], dict[int, dict]]:
    """Each conversation's prompt text, and the conversations with images as prompt dicts (`multimodal_prompts.py`)
    by index. Image content parts (OpenAI's `image_url`, or `{"type": "image"}`) become the template's image parts,
    which it writes as the model's placeholder; conversations without one reach the template as given."""
    prompts: list[str] = []
    images: dict[int, dict] = {}
    for index, conversation in enumerate(conversations):
        template_messages, sources = (split_chat_images(conversation) if has_image_parts(conversation)
                                      else (conversation, []))
        prompts.append(tokenizer.apply_chat_template(template_messages, tokenize=False, chat_template=chat_template,
                                                     add_generation_prompt=add_generation_prompt))
        if sources:
            images[index] = {"prompt": prompts[-1], "multi_modal_data": {"image": sources}}
    return prompts, images


def has_image_parts(conversation: Messages) -> bool:
    return any(isinstance(message, dict) and isinstance(message.get("content"), list)
               and any(isinstance(part, dict) and part.get("type") in ("image", "image_url")
                       for part in message["content"]) for message in conversation)
