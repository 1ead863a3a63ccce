"""Images that HTTP clients send → what the engine runs: the prompt's token ids (each image's placeholder expanded)
and its `MultiModalPrompt` (the model's image-processor outputs as numpy arrays, and content hashes).

This happens in the HTTP process, as tokenizing does (`request_mapping.py`): the token count must be known here (the
context-length check, `usage`), a bad image must be a 400 before anything is submitted, and the engine process only
steps. The prepared images cross to the engine inside the `Submit` message (they pickle). The chat route runs this
on a worker thread (`app.py`): decoding and resizing an image takes milliseconds the event loop must not wait.

Over HTTP an image is a `data:image/...;base64,` URL, or an http(s) URL only when the engine was built with
`allow_remote_media=True` (`batchllm serve --allow-remote-media`). A path, a `file://` URL or anything else would
name the server's own files: it is refused, never read, on the chat route (`ImageChat`) and in the Batch API's jobs
(`ServedImagePrompts`).
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
            problem = source_problem(source, prompts.allow_remote_media)
            if problem is not None:
                raise bad_request(f"{place}: {problem}", "messages")
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


class ServedImagePrompts:
    """An engine's `MultiModalPrompts` for prompts that came over HTTP (the Batch API's rows): `prepare` fails a row
    whose image is a path, a `file://` URL (or an http(s) URL without the opt-in) instead of loading it; everything
    else is the wrapped object's."""

    def __init__(self, prompts: Any) -> None:
        self._prompts = prompts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._prompts, name)

    def prepare(self, prompts: dict[int, dict[str, Any]], add_special_tokens: bool = True) -> dict[int, Any]:
        from batchllm.entrypoints.multimodal_prompts import PreparedRow

        refused: dict[int, Any] = {}
        for index, prompt in prompts.items():
            data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
            images = data.get("image") if isinstance(data, dict) else None
            sources = images if isinstance(images, (list, tuple)) else [] if images is None else [images]
            problem = next(filter(None, (source_problem(s, self._prompts.allow_remote_media) for s in sources)), None)
            if problem is not None:
                text = prompt.get("prompt")
                refused[index] = PreparedRow(text if isinstance(text, str) else None, [], None,
                                             f"prompt {index}: {problem}")
        rest = {index: prompt for index, prompt in prompts.items() if index not in refused}
        return {**(self._prompts.prepare(rest, add_special_tokens) if rest else {}), **refused}


def source_problem(source: Any, allow_remote_media: bool) -> str | None:
    """Why an image source a client sent is not used (it would name the server's files, or fetch without the
    opt-in); None when it is used. Bytes (decoded from a request, not named by it) are used."""
    if isinstance(source, (bytes, bytearray)):
        return None
    scheme = source.partition(":")[0].lower() if isinstance(source, str) else ""
    if scheme == "data":
        return None
    if scheme in ("http", "https"):
        if allow_remote_media:
            return None
        return (f"http(s) image URLs are refused: this server fetches them only when started with {REMOTE_OPT_IN} "
                f"(LLM(allow_remote_media=True)); send the image as a data: URL instead")
    shown = repr(source) if len(repr(source)) <= 60 else repr(source)[:60] + "..."
    remote = " or an http(s) URL" if allow_remote_media else ""
    return (f"an image must be a data: URL (data:image/png;base64,...){remote}, got {shown}; the server never reads "
            f"its own files")


def _image_places(messages: list[dict[str, Any]]) -> list[str]:
    """Where each image part is (`messages[i].content[j]`), in the order `split_chat_images` gives their sources."""
    return [f"messages[{i}].content[{j}]" for i, message in enumerate(messages)
            if isinstance(message.get("content"), list)
            for j, part in enumerate(message["content"]) if part.get("type") in _IMAGE_PARTS]
