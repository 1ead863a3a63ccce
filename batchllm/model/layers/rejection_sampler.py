"""Verifying a step's draft tokens on the device, keeping the target distribution exactly.

A speculating row r of the step has `k_r` drafts and `k_r + 1` verification rows of logits: row j (< k_r) is
the target's distribution at draft j's position, row k_r the one after the last draft. The row keeps its
drafts up to the first rejected one, then one more token: at the rejection, a token from the residual
distribution; after all k_r, a token from the last row ("bonus"). Per verification row:

- greedy rows: the target token is the argmax; a draft is accepted iff it equals it;
- seeded random rows: the target token is the exponential race of `Sampler` with noise seeded by
  (seed, position); a draft is accepted iff it equals it. The tokens are those of the same request without
  speculation, whatever was drafted, so they depend only on the seed;
- other random rows: the rejection sampler of Leviathan et al. / Chen et al.: draft d, drawn from the
  draft distribution q (one-hot for deterministic proposers: n-gram, greedy draft models and heads), is
  accepted with probability min(1, p(d) / q(d)); a rejected one is replaced by a token from
  normalise(max(p - q, 0)). Either way the token has distribution p.

`p` is the distribution `Sampler` would sample from (penalties, min_tokens, grammar, temperature, top-k/p,
min-p), computed per verification row with that row's own token history. No host sync in here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm.model.layers.sampler import (
    SamplerOutput,
    exponential_race,
    filtered_probs,
    processed_logits,
    with_logprobs,
)
from batchllm.model.layers.sampling_tensors import SamplingTensors


@dataclass(slots=True)
class DraftBatch:
    """The drafts of a step in its verification rows (device tensors, N = sum over rows of k_r + 1)."""

    draft_ids: torch.Tensor  # [N] long: the draft each verification row checks, -1 on each row's last one
    segment: torch.Tensor  # [N] long: the step row (0..R-1) a verification row belongs to
    offset: torch.Tensor  # [N] long: j, the verification row's place in its segment
    num_rows: int  # R
    draft_probs: torch.Tensor | None = None  # [N, V] q on draft rows; None: deterministic drafts

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> DraftBatch:
        """From each step row's drafts (an empty list for a row that does not speculate)."""
        draft_ids, segment, offset = [], [], []
        for row, row_drafts in enumerate(drafts):
            draft_ids += row_drafts
            draft_ids.append(-1)
            segment += [row] * (len(row_drafts) + 1)
            offset += range(len(row_drafts) + 1)
        pin = device.type == "cuda"

        def upload(values: list[int]) -> torch.Tensor:
            host = torch.tensor(values, dtype=torch.long)
            return (host.pin_memory() if pin else host).to(device, non_blocking=True)

        return cls(upload(draft_ids), upload(segment), upload(offset), len(drafts))


class RejectionSampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, t: SamplingTensors, drafts: DraftBatch) -> SamplerOutput:
        """`logits` and `t` have one row per verification row. The output's `token_ids` hold each verification
        row's token (valid for the first `num_accepted[r] + 1` rows of segment r) and its logprobs."""
        logits, raw_logprobs = processed_logits(logits, t)
        tokens, accept = verify(logits, t, drafts)
        big = torch.iinfo(torch.long).max
        first_rejected = torch.where(accept, big, drafts.offset)  # a segment's last row is never "accepted"
        num_accepted = torch.full((drafts.num_rows,), big, dtype=torch.long, device=logits.device)
        num_accepted.scatter_reduce_(0, drafts.segment, first_rejected, reduce="amin")
        return with_logprobs(tokens, raw_logprobs, t, num_accepted)


def verify(logits: torch.Tensor, t: SamplingTensors, drafts: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each verification row, whether its draft is accepted) from processed float32 logits."""
    is_draft = drafts.draft_ids >= 0
    draft_ids = drafts.draft_ids.clamp_min(0)
    tokens = logits.argmax(-1)
    if t.all_greedy:
        return tokens, is_draft & (tokens == draft_ids)
    probs = filtered_probs(logits, t)
    # Rows whose target token is fixed by its own noise (greedy, seeded) accept a draft iff it matches it.
    coupled = torch.zeros(len(tokens), dtype=torch.bool, device=logits.device)
    if t.greedy is not None:
        coupled |= t.greedy
    for row, _, _ in t.generators:
        coupled[row] = True
    p_draft = probs.gather(1, draft_ids[:, None]).squeeze(1)
    if drafts.draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = probs.scatter(1, draft_ids[:, None], 0.0)
    else:
        q_draft = drafts.draft_probs.gather(1, draft_ids[:, None]).squeeze(1)
        residual = (probs - drafts.draft_probs).clamp_min_(0.0)
    residual_rows = is_draft & ~coupled
    # p <= q everywhere means p == q: the draft is always accepted, and the residual is never read.
    residual_rows &= residual.sum(-1) > 0
    race_input = torch.where(residual_rows[:, None], residual, probs)
    raced = exponential_race(race_input, t)
    if t.greedy is not None:
        raced = torch.where(t.greedy, tokens, raced)
    uniform = torch.rand(len(tokens), device=logits.device)
    accept = torch.where(coupled, raced == draft_ids, uniform * q_draft < p_draft) & is_draft
    return torch.where(accept, draft_ids, raced), accept
