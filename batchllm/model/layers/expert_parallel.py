"""Expert parallelism: each rank of the tensor-parallel group holds whole experts, and tokens travel to them.

With `enable_expert_parallel=True` and n tensor-parallel ranks, rank r holds experts `[r * E/n, (r + 1) * E/n)`
of every MoE layer (`ExpertParallel.local_experts`), each with all of its intermediate features, instead of
1/n of every expert. The layer's input is replicated over the group (it is the attention's all-reduced output),
and so is the router's choice (a replicated router on a replicated input). A layer's step:

1. `dispatch`: each rank takes its contiguous 1/n share of the step's tokens and sends each (token, chosen expert)
   pair's hidden row to the rank holding that expert: one all-to-all of the counts, then one of the rows and one
   of each row's local expert id and routing weight.
2. The owner runs its local experts on the rows it received (the kernel entry, routing weights applied, an
   expert's down bias added once per pair).
3. `combine`: the results go back by the reverse all-to-all; each rank sums its tokens' k results (float32),
   and an all-gather rebuilds the full `[T, H]` on every rank, as the next layer's replicated input.

Why an all-to-all: each rank sends exactly the rows the other ranks' experts need (k/n of its share's rows to
each, for a uniform router), so a step moves `T * k * H` values each way in total, in place of tensor
parallelism's all-reduce of `[T, H]` per layer, and no rank reads another's expert weights. Split sizes differ
from step to step and must be known on the host before the rows move: the counts' all-to-all is a device-to-host
sync, so steps with expert parallelism run eagerly (no CUDA graphs; model_runner.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchllm.distributed.parallel_state import ExpertParallel, all_gather_rows, all_to_all


@dataclass(frozen=True, slots=True)
class Dispatched:
    """What a rank received for its experts, and what `combine` needs to send the results back."""

    rows: torch.Tensor  # [R, H] the hidden rows of the (token, expert) pairs that chose this rank's experts
    expert_ids: torch.Tensor  # [R, 1] each row's expert, as a local index (global id - this rank's first)
    weights: torch.Tensor  # [R, 1] float32, each row's routing weight
    sent: list[int]  # rows this rank sent to each rank (its share's pairs, grouped by owner)
    received: list[int]  # rows this rank received from each rank
    token_of_sent_row: torch.Tensor  # [P] each sent row's token, as an index into this rank's share
    shares: list[int]  # every rank's number of tokens (rank r's share follows rank r - 1's)


# `(rows [R, H], weights [R, 1], local expert ids [R, 1]) -> [R, H]`: a rank's experts on the rows sent to them.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def expert_parallel_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        ep: ExpertParallel, experts_per_rank: int, run_local_experts: LocalExperts) -> torch.Tensor:
    """The MoE layer's output `[T, H]` on every rank: dispatch, this rank's experts, combine."""
    dispatched = dispatch(hidden, topk_weights, topk_ids, ep, experts_per_rank)
    rows = dispatched.rows
    # A rank whose experts no token chose still joins the reverse all-to-all, with no rows.
    out = run_local_experts(rows, dispatched.weights, dispatched.expert_ids) if rows.shape[0] else rows
    return combine(out, dispatched, ep)


def token_shares(num_tokens: int, size: int) -> list[int]:
    """Tokens per rank, contiguous and as even as can be: the first `num_tokens % size` ranks take one more."""
    return [num_tokens // size + (rank < num_tokens % size) for rank in range(size)]


def dispatch(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             ep: ExpertParallel, experts_per_rank: int) -> Dispatched:
    """Send this rank's share of `hidden [T, H]` (routed by `topk_weights`, `topk_ids [T, k]`, identical on every
    rank) to the ranks holding the chosen experts; returns what this rank received."""
    shares = token_shares(hidden.shape[0], ep.size)
    start = sum(shares[:ep.rank])
    ids = topk_ids[start:start + shares[ep.rank]].flatten()  # this share's pairs, token-major
    owner = ids // experts_per_rank
    order = torch.argsort(owner, stable=True)  # pairs grouped by the rank they go to, as all_to_all sends them
    top_k = topk_ids.shape[1]
    token_of_sent_row = order // top_k
    send_counts = torch.bincount(owner, minlength=ep.size)
    # The counts first: each rank must know how many rows it will receive before the rows move.
    sent, received = send_counts.tolist(), all_to_all(send_counts, [1] * ep.size, [1] * ep.size).tolist()
    rows = all_to_all(hidden[start:start + shares[ep.rank]][token_of_sent_row], sent, received)
    # Each row's local expert id and float32 weight travel together, the weight's bits as an int32.
    weights = topk_weights[start:start + shares[ep.rank]].flatten()[order].float()
    local_ids = (ids[order] - owner[order] * experts_per_rank).to(torch.int32)
    meta = all_to_all(torch.stack([local_ids, weights.view(torch.int32)], dim=1), sent, received)
    return Dispatched(rows, meta[:, :1].long(), meta[:, 1:].view(torch.float32), sent, received,
                      token_of_sent_row, shares)


def combine(expert_out: torch.Tensor, dispatched: Dispatched, ep: ExpertParallel) -> torch.Tensor:
    """The inverse of `dispatch`: `expert_out [R, H]` (the weighted expert output of each received row) back to
    the rows' senders, summed per token, then gathered into the whole `[T, H]` on every rank."""
    returned = all_to_all(expert_out, dispatched.received, dispatched.sent)  # in the order this rank sent
    share = torch.zeros(dispatched.shares[ep.rank], expert_out.shape[1], dtype=torch.float32,
                        device=expert_out.device)
    share.index_add_(0, dispatched.token_of_sent_row, returned.float())
    return all_gather_rows(share.to(expert_out.dtype), dispatched.shares)
