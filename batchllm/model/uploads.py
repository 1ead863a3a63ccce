"""Host values (indices, masks, an image step's pixels) uploaded to the device without waiting for it.

A plain `torch.tensor(..., device="cuda")` copies from pageable memory and synchronizes with the stream, so the
host would wait for every step queued on it; from pinned memory the copy is queued behind them instead (the
caching host allocator keeps the pinned block until the copy has run).
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list or numpy array) as a tensor on `device`, queued behind the device's work."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
