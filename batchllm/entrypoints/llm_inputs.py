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
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


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
