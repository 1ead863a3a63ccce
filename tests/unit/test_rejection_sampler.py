"""The rejection sampler keeps the target distribution: chi-square tests over many draws on a small vocabulary
with known draft and target distributions (critical values from the chi-square table), plus hand-checked
greedy verification and seeded coupling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchllm.model.layers.rejection_sampler import DraftBatch, RejectionSampler
from batchllm.model.layers.sampler import Sampler
from batchllm.model.layers.sampling_tensors import SamplingRow, SamplingTensors, make_generator
from batchllm.sampling_params import SamplingParams

P_FIRST = np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])  # the target at the draft's position
P_BONUS = np.array([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # the target after the draft
Q = np.array([0.05, 0.05, 0.40, 0.30, 0.10, 0.10])  # the draft distribution
NUM_DRAWS = 40_000
CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001
CHI2_DF35_P001 = 66.619  # 35 degrees of freedom


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _random_tensors(num_rows: int, generators=()) -> SamplingTensors:
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], []) for _ in range(num_rows)]
    for i, (generator, position) in generators:
        rows[i] = SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [], generator, position)
    return SamplingTensors.build(rows, len(P_FIRST), "cpu")


def _verify(draft_ids: list[int], with_q: bool):
    """One draft per request, NUM_DRAWS requests: verification rows [first, bonus] each."""
    logits = torch.log(torch.tensor(np.stack([P_FIRST, P_BONUS] * len(draft_ids)), dtype=torch.float32))
    drafts = DraftBatch.build([[d] for d in draft_ids], torch.device("cpu"))
    if with_q:
        q = torch.tensor(Q, dtype=torch.float32).expand(2 * len(draft_ids), -1).clone()
        drafts.draft_probs = q
    out = RejectionSampler()(logits, _random_tensors(2 * len(draft_ids)), drafts)
    tokens = out.token_ids.view(-1, 2)
    return tokens[:, 0].numpy(), tokens[:, 1].numpy(), out.num_accepted.numpy()


@pytest.mark.parametrize("with_q", [True, False], ids=["sampled-drafts", "one-hot-drafts"])
def test_output_distribution_is_the_target(with_q):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    draft_ids = rng.choice(len(Q), size=NUM_DRAWS, p=Q) if with_q else np.full(NUM_DRAWS, 2)
    first, bonus, num_accepted = _verify(draft_ids.tolist(), with_q)
    counts = np.bincount(first, minlength=len(P_FIRST))
    assert _chi2(counts, P_FIRST) < CHI2_DF5_P001, counts
    # Accepted draft: the kept token is the draft; the acceptance rate is sum(min(p, q)) (one-hot: p(draft)).
    assert ((first == draft_ids) == (num_accepted == 1)).all()
    expected_rate = np.minimum(P_FIRST, Q).sum() if with_q else P_FIRST[2]
    assert abs(num_accepted.mean() - expected_rate) < 0.01
    # After an accepted draft the bonus token follows the target's next distribution, independently.
    bonus_counts = np.bincount(bonus[num_accepted == 1], minlength=len(P_BONUS))
    assert _chi2(bonus_counts, P_BONUS) < CHI2_DF5_P001, bonus_counts
    joint = np.bincount(first[num_accepted == 1] * 6 + bonus[num_accepted == 1], minlength=36).reshape(6, 6)
    accepted_first = joint.sum(1) / joint.sum()
    expected = np.outer(accepted_first, P_BONUS).ravel()
    keep = expected > 0
    assert _chi2(joint.ravel()[keep], expected[keep] / expected[keep].sum()) < CHI2_DF35_P001


def test_greedy_accepts_exactly_the_argmax_prefix():
    vocab = 8
    logits = torch.full((7, vocab), -5.0)
    targets = [3, 5, 1, 2, 6, 0, 4]  # rows 0-3: request 0 (3 drafts + bonus); rows 4-6: request 1 (2 drafts + bonus)
    logits[torch.arange(7), torch.tensor(targets)] = 5.0
    drafts = DraftBatch.build([[3, 5, 7], [6, 0]], torch.device("cpu"))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], []) for _ in range(7)]
    out = RejectionSampler()(logits, SamplingTensors.build(rows, vocab, "cpu"), drafts)
    assert out.num_accepted.tolist() == [2, 2]
    assert out.token_ids.tolist()[:3] == [3, 5, 1]  # two drafts, then the target's token at the rejection
    assert out.token_ids.tolist()[4:] == [6, 0, 4]  # both drafts, then the bonus token


def test_seeded_rows_sample_what_the_sampler_would():
    """A seeded row's token at each position is the plain sampler's seeded token there, whatever the draft."""
    logits = torch.log(torch.tensor(np.stack([P_FIRST, P_BONUS]), dtype=torch.float32))
    plain = []
    for position, row_logits in zip((10, 11), logits):
        generator = make_generator(7, "cpu")
        rows = [SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [], generator, position)]
        plain.append(Sampler()(row_logits[None], SamplingTensors.build(rows, 6, "cpu")).token_ids.item())
    for draft in range(6):
        generator = make_generator(7, "cpu")
        tensors = _random_tensors(2, [(0, (generator, 10)), (1, (generator, 11))])
        out = RejectionSampler()(logits, tensors, DraftBatch.build([[draft]], torch.device("cpu")))
        accepted = out.num_accepted.item()
        assert accepted == int(draft == plain[0])
        assert out.token_ids.tolist()[:accepted + 1] == plain[:accepted + 1]
