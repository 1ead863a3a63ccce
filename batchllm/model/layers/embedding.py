"""Vocab-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchllm.distributed.parallel_state import all_reduce, gather_last_dim, get_tp
from batchllm.model.checkpoint_tensor import copy_checked
from batchllm.model.layers import batch_invariant


class VocabEmbedding(nn.Module):
    """A `[vocab_size, hidden_size]` lookup table split by rows across the tensor-parallel ranks.

    Rank r holds tokens `[r * shard, (r + 1) * shard)`, the vocabulary padded up to a multiple of the group
    size (padding rows are zero and never looked up). Each rank embeds the tokens it holds, zeros for the
    others, and one all-reduce sums the result. Allocated uninitialised (unlike `nn.Embedding`): the
    checkpoint fills it, and random init of a 128k-token vocabulary is a noticeable cost at load time.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shapes = {None: (vocab_size, hidden_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        held = (local >= 0) & (local < self.shard_size)
        embedded = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce(embedded * held.unsqueeze(-1).to(embedded.dtype))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
        if loaded_weight.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor has {loaded_weight.shape[0]} rows, expected {self.vocab_size}")
        rows = max(0, min(self.shard_size, self.vocab_size - self.start))
        copy_checked(param.data[:rows], loaded_weight.narrow(0, self.start, rows))


class LMHead(VocabEmbedding):
    """The output projection `[vocab_size, hidden_size]`, split by vocabulary rows like the embedding."""


def compute_logits(hidden: torch.Tensor, table: VocabEmbedding) -> torch.Tensor | None:
    """Float32 logits `[N, vocab_size]` from a vocab-parallel table (an LM head, or a tied embedding).

    Each rank computes the logits of its vocabulary rows; they are gathered on rank 0, the only rank that
    samples. The other ranks get None.
    """
    logits = gather_last_dim(batch_invariant.lm_head_linear(hidden, table.weight))
    return None if logits is None else logits[:, : table.vocab_size].float()
