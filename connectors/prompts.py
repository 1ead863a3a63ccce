"""Rows → prompt token ids, with a per-row error instead of an exception for every bad row.

A bad row (null / NaN / non-string / blank prompt, malformed messages, a template field that is null or
missing in that row, a chat template that rejects the conversation, a prompt over the length budget under
`truncate="error"`) gets an `EncodedPrompt` with `error` set; the other rows are unaffected. Prompts are
tokenized exactly as `LLM.generate` (text) and `LLM.chat` (messages) do, so results match the facade's.

The length budget leaves room for the whole completion: `max_model_len - max_tokens` prompt tokens
(`max_model_len - 1` when max_tokens is None). Over budget, "error" fails the row, "left" keeps the end
of the prompt (the right choice for chat prompts: the generation prompt survives) and "right" keeps its
beginning.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchllm.connectors.cells import RowError, check_text, is_missing, to_plain
from batchllm.connectors.images import (
    NOT_CARRIED,
    ImagePreparer,
    has_image_parts,
    images_first,
    row_error,
    split_message_images,
)
from batchllm.connectors.messages import check_messages, template_renders_tools
from batchllm.connectors.options import MapOptions, PromptSpec, with_system_prompt

_MAX_RENDERED = 65536  # distinct conversations remembered per encoder


@dataclass(slots=True)
class EncodedPrompt:
    """A row's prompt token ids, or why it has none. Over-long prompts keep their ids so the count is known.
    `prepared`: a row with images, as the engine takes it (a `PreparedRow`: the ids with the images' tokens)."""

    token_ids: list[int] | None
    error: str | None = None
    prepared: Any = None

    @property
    def num_tokens(self) -> int | None:
        return None if self.token_ids is None else len(self.token_ids)

    @property
    def engine_prompt(self) -> Any:
        """What `LLM.stream` takes for this row: its token ids, or the prepared row with its images."""
        return self.token_ids if self.prepared is None else self.prepared


@dataclass(slots=True)
class Rendered:
    """A prompt as text; chat-rendered text already holds its special tokens, so none are added. `images`: the
    image sources of its placeholders, in order (None: a text-only prompt)."""

    text: str
    is_chat: bool
    images: list[Any] | None = None


class PromptEncoder:
    """Renders chat messages and tokenizes prompts in batches, applying the truncation policy."""

    def __init__(self, tokenizer: Any, max_model_len: int, truncate: str, system_prompt: str | None = None,
                 engine: Any = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.truncate = truncate
        self.system_prompt = system_prompt
        self.engine = engine  # for rows with images (`images.py`); None: an encoder of text only
        self._images: ImagePreparer | None = None
        self._renders_tools = template_renders_tools(tokenizer)
        # Tables repeat conversations (a fixed few-shot prefix with a label column, duplicated rows): the
        # template is rendered once per distinct conversation, keyed by its JSON text (cheaper than Jinja).
        self._rendered: dict[str, Rendered | RowError] = {}

    @classmethod
    def for_llm(cls, llm: Any, options: MapOptions) -> PromptEncoder:
        """The encoder for `llm`; fails fast when the call's max_tokens leaves no room for any prompt."""
        max_tokens = options.sampling_params.max_tokens
        if max_tokens is not None and max_tokens >= llm.max_model_len:
            raise ValueError(f"max_tokens={max_tokens} leaves no room for a prompt: the model's max_model_len "
                             f"is {llm.max_model_len}")
        encoder = cls(llm.tokenizer, llm.max_model_len, options.truncate, options.prompt.system_prompt, llm)
        if options.prompt.image_column is not None:
            encoder.image_preparer()  # a model or an engine that takes no images fails the call here
        return encoder

    def image_preparer(self) -> ImagePreparer:
        """The engine's image side, built when first needed; ValueError when the engine takes no images."""
        if self._images is None:
            if self.engine is None:
                raise ValueError("this door takes text only")
            self._images = ImagePreparer(self.engine)
        return self._images

    def render_chat(self, messages: Any, images: list[Any] | None = None) -> Rendered:
        """Messages (image parts allowed) through the chat template; `images` (an image column's) go first in the
        first user message."""
        value = to_plain(messages)
        sources: list[Any] = []
        if isinstance(value, list) and has_image_parts(value) and self._takes_images():
            if images:
                raise RowError("the row has images in image_column and in its messages' image parts: give them in "
                               "one place")
            try:
                conversation, sources = split_message_images(value, self._check_messages)
            except ValueError as exc:  # RowError included
                raise RowError(str(exc)) from None
        else:
            conversation = self._check_messages(value)
        if images:
            try:
                conversation, sources = images_first(conversation, len(images)), images
            except ValueError as exc:
                raise RowError(str(exc)) from None
        rendered = self._render_conversation(conversation)
        if sources:
            self._require_images()
            return Rendered(rendered.text, True, sources)
        return rendered

    def render_text_with_images(self, text: str, images: list[Any], chat: bool) -> Rendered:
        """A prompt text with an image column's images: used as it is when it holds the model's placeholder, else
        put after the images in a user message (`images.py`)."""
        if not images:
            return self.render_chat([{"role": "user", "content": text}]) if chat else Rendered(text, is_chat=False)
        if self._require_images().placeholder in text:
            rendered = self.render_chat([{"role": "user", "content": text}]) if chat else Rendered(text, False)
            return Rendered(rendered.text, rendered.is_chat, images)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RowError(f"the prompt has no image placeholder ({self._images.placeholder}) and the model has no "
                           f"chat template to place its images with")
        return self.render_chat([{"role": "user", "content": text}], images)

    def _takes_images(self) -> bool:
        """Whether the engine takes images; if not, image parts fail their row as any non-text part does. An engine
        that cannot carry them (replicas) fails the row saying so."""
        if self.engine is not None and getattr(self.engine, "image_prompts", None) is None:
            raise RowError(NOT_CARRIED)
        try:
            self.image_preparer()
        except ValueError:
            return False
        return True

    def _require_images(self) -> ImagePreparer:
        try:
            return self.image_preparer()
        except ValueError as exc:
            raise RowError(str(exc)) from None

    def _check_messages(self, value: Any) -> list[dict[str, Any]]:
        return check_messages(value, template_renders_tools=self._renders_tools)

    def _render_conversation(self, conversation: list[dict[str, Any]]) -> Rendered:
        conversation = with_system_prompt(conversation, self.system_prompt)
        key = json.dumps(conversation, ensure_ascii=False, sort_keys=True, default=str)
        rendered = self._rendered.get(key)
        if rendered is None:
            rendered = self._rendered[key] = self._render(conversation)
        if isinstance(rendered, RowError):
            raise RowError(str(rendered))
        return rendered

    def _render(self, conversation: list[dict[str, Any]]) -> Rendered | RowError:
        if len(self._rendered) >= _MAX_RENDERED:
            self._rendered.clear()
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja raises whatever the template author chose, e.g. roles not alternating
            return RowError(f"the chat template rejected the messages: {exc}")
        return Rendered(text, is_chat=True)

    def encode(self, prompts: Sequence[Rendered | RowError | list[int]],
               max_tokens: Sequence[int | None]) -> list[EncodedPrompt]:
        """Tokenize the rendered prompts (one batch per kind) and fit each into its length budget; a prompt given as
        token ids (an OpenAI embeddings input) is only fitted."""
        encoded = [EncodedPrompt(None, str(p)) if isinstance(p, RowError)
                   else self._fit(p, max_tokens[i]) if isinstance(p, list) else None for i, p in enumerate(prompts)]
        for is_chat in (False, True):
            rendered = [i for i, p in enumerate(prompts) if isinstance(p, Rendered) and p.is_chat == is_chat]
            indices = [i for i in rendered if not prompts[i].images]
            if indices:
                ids = self.tokenizer([prompts[i].text for i in indices], add_special_tokens=not is_chat)["input_ids"]
                for i, token_ids in zip(indices, ids):
                    encoded[i] = self._fit(token_ids, max_tokens[i])
            with_images = [i for i in rendered if prompts[i].images]
            if with_images:
                rows = self.image_preparer().prepare([prompts[i].text for i in with_images],
                                                     [prompts[i].images for i in with_images], not is_chat)
                for key, (i, row) in enumerate(zip(with_images, rows)):
                    encoded[i] = self._fit_images(row, key, max_tokens[i])
        return encoded

    def _fit_images(self, row: Any, key: int, max_tokens: int | None) -> EncodedPrompt:
        """A prepared row with images as an EncodedPrompt; over the budget it fails, whatever `truncate` says."""
        if row.error is not None:
            return EncodedPrompt(None, row_error(row.error, key))
        fitted = self._fit(row.token_ids, max_tokens)
        if fitted.error is not None:
            return fitted
        if len(fitted.token_ids) < len(row.token_ids):
            return EncodedPrompt(row.token_ids, f"the prompt with its images has {len(row.token_ids)} tokens, over "
                                                f"the budget of {len(fitted.token_ids)}; a prompt with images is "
                                                f"never truncated (that would cut image tokens)")
        return EncodedPrompt(row.token_ids, None, row)

    def _fit(self, token_ids: list[int], max_tokens: int | None) -> EncodedPrompt:
        """`token_ids` fitted into max_model_len less `max_tokens` (None: one token), as `truncate` says."""
        reserved = 1 if max_tokens is None else max_tokens
        budget = self.max_model_len - reserved
        if budget < 1:
            return EncodedPrompt(token_ids, f"max_tokens={max_tokens} leaves no room for a prompt within "
                                            f"max_model_len={self.max_model_len}")
        if len(token_ids) <= budget:
            return EncodedPrompt(token_ids)
        if self.truncate == "left":
            return EncodedPrompt(token_ids[-budget:])
        if self.truncate == "right":
            return EncodedPrompt(token_ids[:budget])
        return EncodedPrompt(token_ids, f"the prompt has {len(token_ids)} tokens, over the budget of {budget} "
                                        f"(max_model_len={self.max_model_len} minus {reserved} for the completion); "
                                        f"pass truncate='left' or 'right' to cut it")


def encode_rows(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions,
                encoder: PromptEncoder) -> list[EncodedPrompt]:
    """Encode the prompts of `num_rows` rows whose needed columns are given as Python sequences."""
    rendered = render_rows(columns, num_rows, options, encoder)
    max_tokens = 0 if options.pools else options.sampling_params.max_tokens  # a pooled prompt keeps no room
    return encoder.encode(rendered, [max_tokens] * num_rows)


def render_rows(columns: Mapping[str, Sequence[Any]], num_rows: int, options: MapOptions,
                encoder: PromptEncoder) -> list[Rendered | RowError]:
    """Each row's prompt text (chat template applied), or the error that keeps it from the engine."""
    return [_render_row(columns, i, options.prompt, encoder) for i in range(num_rows)]


def _render_row(columns: Mapping[str, Sequence[Any]], index: int, spec: PromptSpec,
                encoder: PromptEncoder) -> Rendered | RowError:
    try:
        images = None if spec.image_column is None else row_images(columns[spec.image_column][index],
                                                                  spec.image_column)
        if spec.messages_column is not None:
            return encoder.render_chat(columns[spec.messages_column][index], images)
        if spec.prompt_column is not None:
            text = check_text(columns[spec.prompt_column][index], f"prompt column {spec.prompt_column!r}")
        else:
            prompt = _apply_template(spec.template, {name: values[index] for name, values in columns.items()})
            if isinstance(prompt, str) or spec.chat:
                text = check_text(prompt, "the template's prompt")
            else:
                return encoder.render_chat(prompt, images)  # a callable template may return chat messages
        if images is not None:
            return encoder.render_text_with_images(text, images, spec.chat)
        if spec.chat:
            return encoder.render_chat([{"role": "user", "content": text}])
        return Rendered(text, is_chat=False)
    except RowError as exc:
        return exc


def row_images(cell: Any, column: str) -> list[Any]:
    """An image column's cell as a list of image sources: one image, or a list of them (an Arrow / pandas list
    cell). A null cell fails the row."""
    value = to_plain(cell)
    if is_missing(value):
        raise RowError(f"image column {column!r} is null in this row")
    return value if isinstance(value, list) else [value]


def _apply_template(template: Any, row: dict[str, Any]) -> Any:
    if callable(template):
        try:
            return template(row)
        except Exception as exc:  # the user's code: any exception is that row's failure
            raise RowError(f"prompt_template raised {type(exc).__name__}: {exc}") from exc
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            column = field.split(".", 1)[0].split("[", 1)[0]
            if is_missing(row[column]):
                raise RowError(f"template field {{{field}}}: column {column!r} is null in this row")
    try:
        return template.format_map(row)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        raise RowError(f"prompt_template cannot be rendered for this row: {type(exc).__name__}: {exc}") from exc
