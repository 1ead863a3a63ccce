"""Copying checkpoint tensors into parameters: shape-checked, and reading only the slice a rank needs."""

from __future__ import annotations

import torch


class CheckpointSlice:
    """A safetensors tensor not read yet. `narrow` reads only the rows (or columns) asked for, so a
    tensor-parallel rank reads its shard of each weight from the memory-mapped file, never the whole
    tensor; `read()` reads all of it."""

    def __init__(self, source) -> None:  # safetensors' PySafeSlice
        self._source = source
        self.shape = torch.Size(source.get_shape())
        self.is_fp8 = source.get_dtype().startswith("F8")

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"checkpoint tensor of shape {tuple(self.shape)} has no [{start}, {start + length}) "
                             f"along dimension {dim}")
        return self._source[(slice(None),) * dim + (slice(start, start + length),)]

    def read(self) -> torch.Tensor:
        return self._source[:]

    def rows(self, start: int, length: int) -> CheckpointSlice:
        """Rows `[start, start + length)`, still not read: one shard of a fused tensor (Phi-3's `qkv_proj`)."""
        if not 0 <= start <= start + length <= self.shape[0]:
            raise ValueError(f"checkpoint tensor of shape {tuple(self.shape)} has no rows [{start}, {start + length})")
        return CheckpointSlice(_Rows(self._source, start, length))


class _Rows:
    """A safetensors slice seen through a range of its rows: indexing is shifted into the range."""

    def __init__(self, source, start: int, length: int) -> None:
        self._source, self._start, self._length = source, start, length

    def get_shape(self) -> list[int]:
        return [self._length, *self._source.get_shape()[1:]]

    def get_dtype(self) -> str:
        return self._source.get_dtype()

    def __getitem__(self, index) -> torch.Tensor:
        first, *rest = index if isinstance(index, tuple) else (index,)
        start, stop, step = first.indices(self._length)  # a slice, as CheckpointSlice indexes
        return self._source[(slice(self._start + start, self._start + stop, step), *rest)]


def copy_checked(target: torch.Tensor, loaded_weight: torch.Tensor | CheckpointSlice) -> None:
    """Copy a checkpoint tensor into a parameter (slice), refusing silent broadcasting of a wrong shape."""
    if target.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded_weight.read() if isinstance(loaded_weight, CheckpointSlice) else loaded_weight)
