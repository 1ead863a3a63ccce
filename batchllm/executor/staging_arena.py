"""One pinned host block and its device twin that hold a step's staged arrays back to back: one copy uploads them.

Each torch call on the CUDA path costs the host 10-40 us, and a step used to upload each of its arrays by itself
(seven copies, three torch calls each). Here a step lays its arrays out at its own sizes, one after another, fills
them on the host through numpy views, and uploads the bytes in use with one copy. A layout is a pure function of
its arrays' sizes, so a CUDA graph captured at one shape reads the device views that every later step of that
shape gets again: the graph-read arrays come first, their offsets independent of the sizes of those after them.

On CUDA several host blocks take turns in front of the one device block (`num_buffers`): a host block may be refilled
only once its last copy has run, and copies queue behind the device's work, so with one block the host could stage a
step only after the step two before it had finished on the device. With more, the host runs further ahead: a decode
burst's passes (executor/decode_burst.py) stay queued while the host applies the previous burst.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Every array starts on this boundary: what a Triton kernel's pointer specialisation and vector loads expect.
ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class ArraySpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StagedLayout:
    """One step's arrays: `host[name]` (a numpy view of the pinned block) and `device[name]` (its twin on the
    device, the same tensor on the CPU); `nbytes` spans them all."""

    host: dict[str, np.ndarray]
    device: dict[str, torch.Tensor]
    nbytes: int
    buffer: int = 0  # the host block the views are in


def _round_up(value: int) -> int:
    return -(-value // ALIGNMENT) * ALIGNMENT


def arena_bytes(specs: list[ArraySpec]) -> int:
    """The bytes a layout of these arrays takes, alignment included: the arena's capacity for the largest step."""
    return sum(_round_up(_nbytes(spec)) for spec in specs)


def _nbytes(spec: ArraySpec) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize


class StagingArena:
    def __init__(self, capacity: int, device: torch.device, num_buffers: int = 1) -> None:
        """`num_buffers` host blocks in front of the device block; one on the CPU is the device block itself."""
        pin = device.type == "cuda"
        self.hosts = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=pin) for _ in range(num_buffers)]
        shared = device.type == "cpu" and num_buffers == 1
        self.device = self.hosts[0] if shared else torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._host_nps = [host.numpy() for host in self.hosts]

    @property
    def num_buffers(self) -> int:
        return len(self.hosts)

    def layout(self, specs: tuple[ArraySpec, ...], buffer: int = 0) -> StagedLayout:
        """Views of these arrays laid out back to back from the start of host block `buffer` and of the device block
        (new views: the caller keeps them)."""
        host_np, capacity = self._host_nps[buffer], len(self.device)
        host, device, offset = {}, {}, 0
        for spec in specs:
            size = _nbytes(spec)
            if offset + size > capacity:
                raise ValueError(f"the staged arrays need over {offset + size} bytes; the arena holds {capacity}")
            host[spec.name] = host_np[offset:offset + size].view(_numpy_dtype(spec.dtype)).reshape(spec.shape)
            device[spec.name] = self.device[offset:offset + size].view(spec.dtype).view(spec.shape)
            offset = _round_up(offset + size)
        return StagedLayout(host, device, offset, buffer)

    def upload(self, layout: StagedLayout) -> None:
        """Copy the layout's bytes from its host block to the device block (asynchronous on CUDA)."""
        host = self.hosts[layout.buffer]
        if self.device is not host:
            self.device[:layout.nbytes].copy_(host[:layout.nbytes], non_blocking=True)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in the arena's device block."""
        start = self.device.data_ptr()
        return start <= tensor.data_ptr() < start + len(self.device)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
