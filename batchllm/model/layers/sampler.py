"""Batched token sampling on the device, one row per request, per-request parameters as tensors.

Per step the runner gathers the batch's `SamplingColumns` (plus a `SamplingRow` for each row that needs
per-row state: a seed, penalties, min_tokens, logprobs), turns them into `SamplingTensors`
(`sampling_tensors.py`: host work only for the stages some row uses, one host→device copy per tensor) and calls
`Sampler` on the logits of the last position. Nothing in here reads device values back: the one
host sync is the caller's read of `SamplerOutput`.

Pipeline, per row (vLLM / HF semantics):

    logits ─▶ logprobs of the raw model distribution (rows that ask)
           ─▶ penalties: repetition, then frequency and presence
           ─▶ min_tokens: stop tokens masked to -inf
           ─▶ structured outputs: tokens the row's grammar forbids masked to -inf
           ─▶ greedy rows: argmax
           ─▶ random rows: / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ argmax(probs / q), q ~ Exp(1)

`argmax(probs / q)` with independent Exp(1) noise picks token i with probability probs[i] (the
exponential race, equivalent to Gumbel-max) and needs neither normalised probs nor a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchllm import kernels
from batchllm.engine.interfaces import SampledToken
from batchllm.model.layers.sampling_tensors import PenaltyTensors, SamplingTensors


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, still on the device. The logprob fields are None unless a row asked.

    Logprobs come from the raw model distribution (log_softmax of the logits before penalties,
    temperature and filtering); `top_ids`/`top_logprobs` hold `max_num_logprobs` columns and each row
    keeps its own first `num_logprobs[row]`.
    """

    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None  # [B] float32, of the sampled token
    ranks: torch.Tensor | None  # [B] long, 1 = the most likely token
    top_ids: torch.Tensor | None  # [B, k] long, most likely first
    top_logprobs: torch.Tensor | None  # [B, k] float32
    num_logprobs: list[int | None]
    # Speculative decoding (`rejection_sampler.py`): row r of the step keeps the tokens of its first
    # `num_accepted[r] + 1` verification rows.
    num_accepted: torch.Tensor | None = None  # [R] long

    def to_sampled_tokens(self) -> list[SampledToken]:
        """Reads the step back to the host (the step's one sync) as a `SampledToken` per row."""
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return [SampledToken(token_id) for token_id in token_ids]
        logprobs, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        tokens = []
        for row, (token_id, k) in enumerate(zip(token_ids, self.num_logprobs)):
            if k is None:
                tokens.append(SampledToken(token_id))
                continue
            top = dict(zip(top_ids[row][:k], top_logprobs[row][:k]))
            tokens.append(SampledToken(token_id, logprobs[row], ranks[row], top))
        return tokens


class Sampler(torch.nn.Module):
    """Samples one token per row of `[B, V]` logits; see the module docstring for the pipeline."""

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """Samples from `logits` (not modified; cast to float32) with the parameters in `t`."""
        logits, raw_logprobs = processed_logits(logits, t)
        token_ids = logits.argmax(-1)
        if not t.all_greedy:
            sampled = exponential_race(filtered_probs(logits, t), t)
            token_ids = sampled if t.greedy is None else torch.where(t.greedy, token_ids, sampled)
        return with_logprobs(token_ids, raw_logprobs, t)


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits after penalties, min_tokens and grammar masks (the input is not modified), and the raw
    model log-probabilities when a row asks for logprobs."""
    model_logits, logits = logits, logits.float()
    raw_logprobs = logits.log_softmax(-1) if t.max_num_logprobs is not None else None
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    if t.banned_index is not None:
        logits = logits.flatten().index_fill(0, t.banned_index, float("-inf")).view_as(logits)
    if t.grammar_rows is not None:
        if logits is model_logits:  # float32 logits, untouched so far: masked in place below, so copied
            logits = logits.clone()
        kernels.apply_token_bitmask_(logits, t.grammar_rows, t.grammar_bitmask)
    return logits, raw_logprobs


def with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, t: SamplingTensors,
                  num_accepted: torch.Tensor | None = None) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, None, t.num_logprobs, num_accepted)
    sampled_logprobs = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    ranks = (raw_logprobs > sampled_logprobs[:, None]).sum(-1) + 1
    top_logprobs, top_ids = raw_logprobs.topk(t.max_num_logprobs, dim=-1)
    return SamplerOutput(token_ids, sampled_logprobs, ranks, top_ids, top_logprobs, t.num_logprobs, num_accepted)


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """Returns penalised `[B, V]` logits (the input is not modified).

    Repetition (HF): for tokens in prompt ∪ output, logit / r if positive else logit * r.
    Then frequency and presence (OpenAI): logit -= f * count_in_output + p * (count_in_output > 0).
    """
    batch, vocab = logits.shape
    ones = torch.ones_like(p.output_index, dtype=torch.float32)
    counts = torch.zeros(batch * vocab, dtype=torch.float32, device=logits.device)
    counts = counts.index_add_(0, p.output_index, ones).view(batch, vocab)
    in_output = counts > 0
    if p.repetition is not None:
        seen = in_output.clone()
        if p.prompt_index is not None:
            seen.view(-1).index_fill_(0, p.prompt_index, True)
        r = p.repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if p.frequency is not None:
        logits = logits - p.frequency[:, None] * counts
    if p.presence is not None:
        logits = logits - p.presence[:, None] * in_output
    return logits


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution random rows sample from: temperature, top-k, top-p, then min-p (not renormalised)."""
    if t.temperature is not None:
        logits = logits / t.temperature[:, None]
    if t.top_k is not None or t.top_p is not None:
        logits = _apply_top_k_top_p(logits, t.top_k, t.top_p)
    probs = logits.softmax(-1)
    if t.min_p is not None:
        threshold = probs.amax(-1, keepdim=True) * t.min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def exponential_race(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row with probability proportional to `probs` (consumed). A seeded row draws its noise from
    its generator seeded for the position it samples, so its token depends on nothing else in the batch."""
    q = torch.empty_like(probs).exponential_()
    for row, generator, draw_seed in t.generators:
        if draw_seed is not None:
            generator.manual_seed(draw_seed)
        q[row].exponential_(generator=generator)
    # A zero draw would turn a filtered-out token (prob 0) into NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    # One descending sort serves both filters: top-k keeps the first k positions; top-p then keeps a
    # token while the probability of the tokens before it (renormalised after top-k) is below top_p.
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(positions >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # exactly 0 for the first token, which always stays
        sorted_logits.masked_fill_(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
