"""LoRA on the linear layers: device slots of adapter weights, and the step's batched delta.

Each LoRA-enabled linear layer holds `max_loras` slots. A slot's A stacks the layer's sub-projections (q, k, v
of the fused QKV; gate, up; or one) along the rank axis, `[slices * max_rank, in]`, and its B is block-diagonal
to match, `[out, slices * max_rank]`, zero outside each sub-projection's rows and its adapter's rank. One
`x A^T B^T` per slot then adds every sub-projection's delta at once. The step says which tokens run under
which slot (`LoRABatch`, set by the runner around the forward pass); tokens of the base model are in no segment.

`kernels.add_lora_` applies every slot's segment in two launches per layer (Triton on CUDA, the torch
reference on the CPU). The batch's tensors are fixed device buffers refilled each step, so a captured CUDA
graph replays any mix of adapters. Under tensor parallelism a row layer's delta on its input shard is a
partial sum like its base product, so it joins the same all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from batchllm import kernels


@dataclass(slots=True)
class LoRABatch:
    """Which tokens run under which slot: slot s's flat token indices are
    `sorted_tokens[slot_starts[s]:slot_starts[s + 1]]` (int32 device tensors, `slot_starts` of `max_loras + 1`)."""

    sorted_tokens: torch.Tensor
    slot_starts: torch.Tensor


_current: LoRABatch | None = None


@contextmanager
def set_lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    global _current
    previous, _current = _current, batch
    try:
        yield
    finally:
        _current = previous


class LoRASlots:
    """One linear layer's adapter slots; `slices[i] = (output offset, size)` of sub-projection i."""

    def __init__(self, slices: Sequence[tuple[int, int]], input_size: int, output_size: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slices, self.max_rank = list(slices), max_rank
        width = len(self.slices) * max_rank
        self.a = torch.zeros(max_loras, width, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, output_size, width, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, slice_index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection `slice_index` of `slot` gets A `[r, in]` and B `[size, r]` (scaling folded in)."""
        rank = a.shape[0]
        column = slice_index * self.max_rank
        offset, size = self.slices[slice_index]
        self.a[slot, column:column + rank].copy_(a)
        self.b[slot, offset:offset + size, column:column + rank].copy_(b)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out[t] += x[t] A^T B^T` under token t's slot, for the tokens of the current step's segments."""
        if _current is not None:
            kernels.add_lora_(x, out, self.a, self.b, _current.sorted_tokens, _current.slot_starts)
