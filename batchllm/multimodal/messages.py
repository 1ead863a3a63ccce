"""OpenAI chat messages with image content parts → messages an HF chat template renders, and their image sources.

HF templates (Qwen2.5-VL, Gemma 3) write one image placeholder per `{"type": "image"}` part and ignore where the
image came from, so the sources are taken out here, in order of appearance, to be loaded (`media.load_images`)
and matched to the placeholders in that same order.
"""

from __future__ import annotations

from typing import Any


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list[object]]:
    """`messages` (each `content` a string or a list of parts) rewritten for an HF chat template, and the image
    sources in order of appearance (unloaded). Parts: `{"type": "text", "text": ...}`, `{"type": "image_url",
    "image_url": {"url": ...}}` (or a bare URL string), `{"type": "image", "image": <bytes | PIL | path | URL>}`.
    Images become `{"type": "image"}` parts. ValueError naming `messages[i].content[j]` for a malformed part.
    The input is not modified."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    rewritten: list[dict] = []
    sources: list[object] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        content = message.get("content")
        if content is None or isinstance(content, str):  # None: an assistant turn that only calls tools
            rewritten.append(dict(message))
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts, "
                             f"got {type(content).__name__}")
        parts = []
        for j, part in enumerate(content):
            template_part, source = _split_part(part, f"messages[{i}].content[{j}]")
            parts.append(template_part)
            if source is not None:
                sources.append(source)
        rewritten.append({**message, "content": parts})
    return rewritten, sources


def _split_part(part: Any, where: str) -> tuple[dict, object | None]:
    """One content part → (its template form, its image source or None for text)."""
    if not isinstance(part, dict):
        raise ValueError(f"{where}: a content part must be a dict, got {type(part).__name__}")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}: a text part needs 'text' as a string, got {type(text).__name__}")
        return {"type": "text", "text": text}, None
    if kind == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: an image_url part needs a url ({{'image_url': {{'url': ...}}}}), "
                             f"got {_short_repr(image_url)}")
        return {"type": "image"}, url
    if kind == "image":
        image = part.get("image")
        if image is None:
            raise ValueError(f"{where}: an image part needs 'image' (bytes, a PIL image, a path or a URL)")
        return {"type": "image"}, image
    if kind is None:
        raise ValueError(f"{where}: a content part needs a 'type' ('text', 'image_url' or 'image')")
    raise ValueError(f"{where}: unknown part type {_short_repr(kind)} (expected 'text', 'image_url' or 'image')")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
