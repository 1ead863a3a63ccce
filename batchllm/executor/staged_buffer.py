"""A host staging array and its device twin at a fixed address: the LoRA segments' buffers (lora_slots.py), which the
decode CUDA graphs read whatever the step's size. The step's own arrays live in one arena (staging_arena.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StagedBuffer:
    """A host staging array (pinned memory on CUDA, with a numpy view) and its device twin of the same shape."""

    host: torch.Tensor
    device: torch.Tensor
    np: np.ndarray

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> StagedBuffer:
        pin = device.type == "cuda"
        host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        dev = host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        return cls(host, dev, host.numpy())

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n rows host → device (asynchronous on CUDA) and return the device view."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]
