"""Pooling requests' hidden states into one vector each (an embedding, or a classification's logits).

A prompt may be computed over several steps (chunked prefill), so mean and CLS pooling keep a running sum, and
the first token's state, per request between its chunks; a chunk that starts at position 0 starts them over
(a recomputation after preemption). Last-token pooling needs only the final chunk. Each step's work is a few
batched ops over all its pooling rows: one gather of their tokens, one `index_add_`, one gather of their last
tokens, whatever the number of rows; their indices are uploaded without waiting for the device (uploads.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from batchllm.model.uploads import to_device
from batchllm.pooling_params import PoolingParams


@dataclass(slots=True)
class PoolRow:
    request_id: str
    params: PoolingParams
    start: int  # its first token's index in the step's flat batch
    num_tokens: int
    position: int  # its first token's position in the prompt
    num_prompt_tokens: int
    final: bool  # the chunk that ends its prompt


class Pooler:
    def __init__(self, head: nn.Module | None, device: torch.device) -> None:
        self.head = head  # a sequence-classification model's score layer
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}  # mean pooling, over the chunks computed so far
        self._first: dict[str, torch.Tensor] = {}  # CLS pooling

    def forget(self, request_id: str) -> None:
        self._sums.pop(request_id, None)
        self._first.pop(request_id, None)

    def step(self, hidden: torch.Tensor, rows: list[PoolRow]) -> tuple[list[str], torch.Tensor] | None:
        """Take this step's chunks; returns the requests whose prompts ended and their vectors (float32, [R, D])."""
        means = [i for i, row in enumerate(rows) if row.params.pooling == "mean"]
        if means:
            self._add_chunk_sums(hidden, [rows[i] for i in means])
        for row in rows:
            if row.params.pooling == "cls" and row.position == 0:
                self._first[row.request_id] = hidden[row.start].float()
        finals = [row for row in rows if row.final]
        if not finals:
            return None
        last = hidden[to_device([row.start + row.num_tokens - 1 for row in finals], self.device)].float()
        vectors = []
        for index, row in enumerate(finals):
            if row.params.pooling == "mean":
                vectors.append(self._sums.pop(row.request_id) / row.num_prompt_tokens)
            elif row.params.pooling == "cls":
                vectors.append(self._first.pop(row.request_id))
            else:
                vectors.append(last[index])
        pooled = torch.stack(vectors)
        normalize = [row.params.normalize for row in finals]  # decided on the host: no sync with the device
        if any(normalize):
            mask = to_device(normalize, self.device, torch.bool)[:, None]
            pooled = torch.where(mask, F.normalize(pooled, dim=-1), pooled)
        classify = [row.params.classify for row in finals]
        if any(classify):
            if not all(classify):
                raise RuntimeError("a step mixes classification rows with embedding rows")
            if self.head is None:
                raise RuntimeError("classification needs a model with a classification head")
            pooled = self.head(pooled.to(self.head.weight.dtype)).float()
        return [row.request_id for row in finals], pooled

    def _add_chunk_sums(self, hidden: torch.Tensor, rows: list[PoolRow]) -> None:
        counts = np.array([row.num_tokens for row in rows])
        tokens = np.concatenate([np.arange(row.start, row.start + row.num_tokens) for row in rows])
        owner = np.repeat(np.arange(len(rows)), counts)
        sums = torch.zeros(len(rows), hidden.shape[-1], dtype=torch.float32, device=self.device)
        sums.index_add_(0, to_device(owner, self.device), hidden[to_device(tokens, self.device)].float())
        for index, row in enumerate(rows):
            earlier = None if row.position == 0 else self._sums.get(row.request_id)
            self._sums[row.request_id] = sums[index] if earlier is None else earlier + sums[index]
