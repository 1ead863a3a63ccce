"""The adapters an `LLM` has been asked for: each read and checked against the model once, before generation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchllm.lora.request import LoRARequest


def check_lora_options(enable_lora: Any, max_loras: Any, max_lora_rank: Any) -> None:
    if not isinstance(enable_lora, bool):
        raise ValueError(f"LLM argument enable_lora must be True or False, got {enable_lora!r}")
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"LLM argument {name} must be an int >= 1, got {value!r}")


class AdapterRegistry:
    """Names and ids stay one-to-one per LLM (the prefix cache keys K/V by them), and an adapter the engine
    cannot apply fails the call before any generation, with `LoRAError` naming it."""

    def __init__(self, model_config: Any, max_rank: int, enabled: bool) -> None:
        self.model_config, self.max_rank, self.enabled = model_config, max_rank, enabled
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}

    def check_call(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                   num_prompts: int) -> list[LoRARequest | None] | None:
        """Each prompt's adapter (None: no adapter anywhere in the call)."""
        if lora_request is None:
            return None
        if not self.enabled:
            raise ValueError("lora_request needs an LLM built with enable_lora=True")
        if isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError(f"lora_request has {len(loras)} entries for {num_prompts} prompts")
        for i, lora in enumerate(loras):
            if lora is not None and not isinstance(lora, LoRARequest):
                raise TypeError(f"lora_request[{i}] must be a LoRARequest or None, got {type(lora).__name__}")
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            self.check(lora)
        return loras

    def check(self, lora: LoRARequest) -> None:
        if self._by_name.get(lora.lora_name) == lora:
            return
        for known in (self._by_name.get(lora.lora_name), self._by_id.get(lora.lora_int_id)):
            if known is not None:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}, {lora.lora_path}) clashes "
                                 f"with {known.lora_name!r} (id {known.lora_int_id}, {known.lora_path}) registered "
                                 f"earlier: names and ids must each name one adapter")
        from batchllm.model.lora_adapter import load_adapter  # torch: only when adapters are used

        load_adapter(lora, self.model_config, self.max_rank)
        self._by_name[lora.lora_name] = self._by_id[lora.lora_int_id] = lora
