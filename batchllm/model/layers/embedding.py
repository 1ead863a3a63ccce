"""Token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """A `[vocab_size, hidden_size]` lookup table; also the LM head when embeddings are tied.

    Allocated uninitialised (unlike `nn.Embedding`): the checkpoint fills it, and random init of a
    128k-token vocabulary is a noticeable cost at load time.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
