"""Normalizing what callers pass to `LLM.generate` / `chat` / `stream`: prompts, per-prompt parameters, the progress
bar, and a stream's items (shared with the server's view of an engine in another process, `RemoteLLM`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Sequence

from batchllm.sampling_params import SamplingParams

Prompt = str | list[int]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):  # a dict: one prompt with images (entrypoints/multimodal_prompts.py)
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return [plain_prompt(prompt, index) for index, prompt in enumerate(prompts)]


def broadcast_params(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)


def show_preemptions(bar: Any, stats: Any) -> None:
    """The engine's preemptions and the prompt tokens they made it recompute, on the bar once there are any."""
    if stats.num_preemptions:
        bar.set_postfix_str(f"{stats.num_preemptions} preempted ({stats.num_recomputed_tokens} prompt tok recomputed)",
                            refresh=False)


def encode_prompt(tokenizer: Any, prompt: Prompt, index: int, tokenize: bool = True) -> tuple[str | None, list[int]]:
    """(text, token ids) of one prompt; `tokenize=False` leaves a text's token ids to the caller (empty)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is text, but the LLM was built with skip_tokenizer_init=True")
        return prompt, tokenizer(prompt)["input_ids"] if tokenize else []
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, prompt
    raise TypeError(f"prompt {index} must be a str or a list of token ids, got {type(prompt).__name__}")


def encode_requests(requests: Iterable[tuple | None], tokenizer: Any, check_lora: Callable[[Any], None],
                    prepare_images: Callable[[int, dict], Any] | None = None) -> Iterator[tuple | None]:
    """A stream's `(key, prompt, params[, lora_request])` items as (key, text, token ids, params, adapter),
    tokenized lazily as the stream pulls (an unbounded source is never materialized); adapters are checked, None
    (a pause) passes through. A prompt with images (a dict, `multimodal_prompts.py`) goes through
    `prepare_images(index, prompt)` and its item carries `(images, error)` sixth; a `PreparedRow` (what
    `MultiModalPrompts.prepare` returns: the table doors prepare rows on their tokenize-ahead worker) is taken as
    it is."""
    for index, item in enumerate(requests):
        if item is None:
            yield None
            continue
        key, prompt, params, *rest = item
        lora = rest[0] if rest else None
        if lora is not None:
            check_lora(lora)
        if _is_prepared(prompt):  # a row whose images a door already decoded and processed, off this thread
            yield key, prompt.text, prompt.token_ids, params, lora, (prompt.mm, prompt.error)
            continue
        prompt = plain_prompt(prompt, index)
        if isinstance(prompt, dict):
            if prepare_images is None:
                raise ValueError(f"prompt {index} has images: this engine takes text and token ids only")
            row = prepare_images(index, prompt)
            yield key, row.text, row.token_ids, params, lora, (row.mm, row.error)
            continue
        yield (key, *encode_prompt(tokenizer, prompt, index), params, lora)


def _is_prepared(prompt: Any) -> bool:
    # A PreparedRow can only exist once its module (which needs Pillow) is imported: never import it to type-check.
    module = sys.modules.get("batchllm.entrypoints.multimodal_prompts")
    return module is not None and isinstance(prompt, module.PreparedRow)


def prompt_images(prompt: dict[str, Any], index: int) -> list[Any]:
    """A prompt dict's images (vLLM's shape, multimodal_prompts.py); a ValueError naming the row for a malformed one."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown:
        raise ValueError(f"prompt {index}: unknown key {unknown[0]!r} (a prompt dict takes 'prompt' or "
                         f"'prompt_token_ids', and 'multi_modal_data')")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"prompt {index}: multi_modal_data must be a dict with the key 'image', got {data!r:.80}")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def prompt_content(prompt: dict[str, Any], index: int) -> tuple[str | None, list[int] | None]:
    """A prompt dict's (text, token ids), one of them None."""
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"prompt {index}: prompt_token_ids must be a list of ints")
        return None, ids
    text = prompt.get("prompt")
    if isinstance(text, str):
        return text, None
    if isinstance(text, list) and all(isinstance(t, int) for t in text):
        return None, text
    raise ValueError(f"prompt {index}: 'prompt' must be a str or a list of token ids, got {type(text).__name__}")


def plain_prompt(prompt: Any, index: int) -> Any:
    """A prompt dict without images (vLLM's `{"prompt": ...}` or `{"prompt_token_ids": [...]}`, which any model
    takes) as the text or token ids it holds; anything else as it is."""
    if not isinstance(prompt, dict) or prompt_images(prompt, index):
        return prompt
    text, token_ids = prompt_content(prompt, index)
    return text if token_ids is None else token_ids
