"""Which adapter a request runs under (vLLM's `LoRARequest`). Plain data: the engine layer reads it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) under a name.

    `lora_int_id` is a positive id, unique per adapter within a process (vLLM's convention); the name and the
    id together key the adapter's K/V in the prefix cache, so two adapters never share blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an int >= 1, got "
                             f"{self.lora_int_id!r}")

    @property
    def cache_key(self) -> tuple[str, int]:
        """Extra key of the prefix cache's block hashes for requests under this adapter."""
        return (self.lora_name, self.lora_int_id)
