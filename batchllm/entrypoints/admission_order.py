"""The order a batch known up front is admitted in: shared by `LLM` and the replica pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchllm.lora.request import LoRARequest


def admission_order(token_lists: Sequence[Any], loras: Sequence[LoRARequest | None] | None,
                    reorder_by_prefix: bool) -> list[int]:
    """Prompts in lexicographic token order (with `reorder_by_prefix`), so rows sharing a prefix run back to back
    and hit its blocks before they can be evicted. With adapters, the rows of one adapter go together first
    (base rows ahead), so a job with more adapters than device slots swaps each in about once.

    Texts not tokenized yet may stand in for the token lists (any keys that sort alike): rows sharing a text
    prefix are adjacent in text order, and share the tokens of that prefix but for the last few."""
    if loras is not None and any(lora is not None for lora in loras):
        def key(i: int) -> tuple:
            lora = loras[i]
            return ((0, "", 0) if lora is None else (1, *lora.cache_key), token_lists[i])
        return sorted(range(len(token_lists)), key=key)
    if not reorder_by_prefix:
        return list(range(len(token_lists)))
    return sorted(range(len(token_lists)), key=token_lists.__getitem__)
