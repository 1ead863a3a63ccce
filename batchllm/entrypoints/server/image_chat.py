"""Chat messages with image content parts → what the engine runs: the prompt's token ids (each image's placeholder
expanded) and its `MultiModalPrompt` (the model's image-processor outputs as numpy arrays, and content hashes).

This happens in the HTTP process, as tokenizing does (`request_mapping.py`): the token count must be known here (the
context-length check, `usage`), a bad image must be a 400 before anything is submitted, and the engine process only
steps. The prepared images cross to the engine inside the `Submit` message (they pickle). The chat route runs this
on a worker thread (`app.py`): decoding and resizing an image takes milliseconds the event loop must not wait.

Over HTTP an image is a `data:image/...;base64,` URL, or an http(s) URL only when the engine was built with
`allow_remote_media=True` (`batchllm serve --allow-remote-media`). A path, a `file://` URL or anything else would
name the server's own files: it is refused, never read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchllm.entrypoints.server.errors import bad_request
from batchllm.multimodal.inputs import MultiModalPrompt
from batchllm.multimodal.messages import split_chat_images

REMOTE_OPT_IN = "--allow-remote-media"
_IMAGE_PARTS = ("image", "image_url")


class ImageChat:
    def __init__(self, model_name: str, architecture: str | None, image_prompts: Callable[[], Any] | None) -> None:
        """`image_prompts`: the engine's `LLM.image_prompts` (or `RemoteLLM.image_prompts`), which returns its
        `MultiModalPrompts`; None for a model that takes text only."""
        self.model_name = model_name
        self.architecture = architecture
        self._image_prompts = image_prompts

    def prepare(self, messages: list[dict[str, Any]], tokenizer: Any) -> tuple[str, list[int], MultiModalPrompt]:
        """(prompt text, token ids, images) of a conversation with image parts; a 400 naming the part at fault."""
        if self._image_prompts is None:
            kind = f" ({self.architecture})" if self.architecture else ""
            raise bad_request(f"the model `{self.model_name}`{kind} takes text only: send messages without image "
                              f"parts", "messages")
        prompts = self._image_prompts()
        try:
            template_messages, sources = split_chat_images(messages)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        places = _image_places(messages)
        for place, source in zip(places, sources, strict=True):
            _check_source(source, place, prompts.allow_remote_media)
        from batchllm.multimodal.media import MediaError, load_images  # Pillow: only a vision model's server needs it

        images = load_images(sources, allow_remote_media=prompts.allow_remote_media)
        for place, image in zip(places, images, strict=True):
            if isinstance(image, MediaError):
                raise bad_request(f"{place}: {image}", "messages")
        try:
            text = tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja raises whatever the template author chose
            raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
        # As LLM.chat: the rendered template holds the special tokens already.
        row = prompts.prepare({0: {"prompt": text, "multi_modal_data": {"image": images}}}, add_special_tokens=False)[0]
        if row.error is not None:
            raise bad_request(f"messages: {row.error}", "messages")
        return text, row.token_ids, row.mm


def _image_places(messages: list[dict[str, Any]]) -> list[str]:
    """Where each image part is (`messages[i].content[j]`), in the order `split_chat_images` gives their sources."""
    return [f"messages[{i}].content[{j}]" for i, message in enumerate(messages)
            if isinstance(message.get("content"), list)
            for j, part in enumerate(message["content"]) if part.get("type") in _IMAGE_PARTS]


def _check_source(source: Any, place: str, allow_remote_media: bool) -> None:
    scheme = source.partition(":")[0].lower() if isinstance(source, str) else ""
    if scheme == "data":
        return
    if scheme in ("http", "https"):
        if allow_remote_media:
            return
        raise bad_request(f"{place}: http(s) image URLs are refused: this server fetches them only when started with "
                          f"{REMOTE_OPT_IN} (LLM(allow_remote_media=True)); send the image as a data: URL instead",
                          "messages")
    shown = repr(source) if len(repr(source)) <= 60 else repr(source)[:60] + "..."
    remote = " or an http(s) URL" if allow_remote_media else ""
    raise bad_request(f"{place}: an image must be a data: URL (data:image/png;base64,...){remote}, got {shown}; "
                      f"the server never reads its own files", "messages")
