"""Normalizing what callers pass to `LLM.generate` / `chat`: prompts, per-prompt parameters, the progress bar."""

from __future__ import annotations

from typing import Sequence

from batchllm.sampling_params import SamplingParams

Prompt = str | list[int]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
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
