"""Sampler tests against independent references: hand-computed values, torch.log_softmax, and empirical
frequencies of many draws compared with the exact renormalised distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchllm.model.layers.sampler import Sampler, apply_penalties
from batchllm.model.layers.sampling_tensors import SamplingRow, SamplingTensors, make_generator
from batchllm.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]

# A small distribution with no ties, so each filter's kept set is unambiguous.
PROBS = [0.30, 0.25, 0.20, 0.12, 0.08, 0.05]
NUM_DRAWS = 20_000


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def row(prompt=(), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator)


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids=()):
    t = SamplingTensors.build(rows, logits.shape[-1], logits.device, eos_token_ids)
    return Sampler()(logits, t)


def test_greedy_is_argmax(device):
    logits = torch.randn(8, 100, device=device)
    out = sample(logits, [row(temperature=0.0) for _ in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None

    # Greedy rows stay argmax when mixed with random rows that use every filter.
    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01) for i in range(8)]
    out = sample(logits, rows)
    assert torch.equal(out.token_ids[1::2], logits.argmax(-1)[1::2])


def test_top_k_1_is_greedy(device):
    logits = torch.randn(16, 300, device=device)
    out = sample(logits, [row(temperature=0.7, top_k=1) for _ in range(16)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_penalties_match_hand_computed_values(device):
    base = [2.0, -1.0, 0.5, 1.0, -2.0]
    rows = [
        row(prompt=[0], output=[2, 2, 3, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[0], output=[1, 2]),  # no penalties: untouched although it has history
        row(prompt=[4, 4], output=[0], repetition_penalty=1.5),  # repetition covers prompt and output
        row(prompt=[3], output=[3, 3, 3], presence_penalty=-0.5),  # presence counts once, not per occurrence
        row(prompt=[0], output=[1, 1], frequency_penalty=1.0),  # frequency ignores the prompt
        row(prompt=[0], output=[], repetition_penalty=4.0, temperature=0.0),
    ]
    expected = torch.tensor(
        [
            # t0: 2/2; t1: -1*2 - 0.5*1 - 0.25; t2: 0.5/2 - 0.5*2 - 0.25; t3: 1/2 - 0.5*1 - 0.25; t4 unseen
            [1.0, -2.75, -1.0, -0.25, -2.0],
            [2.0, -1.0, 0.5, 1.0, -2.0],
            [2.0 / 1.5, -1.0, 0.5, 1.0, -3.0],
            [2.0, -1.0, 0.5, 1.5, -2.0],
            [2.0, -3.0, 0.5, 1.0, -2.0],
            [0.5, -1.0, 0.5, 1.0, -2.0],
        ],
        device=device,
    )
    logits = torch.tensor([base] * len(rows), device=device)
    t = SamplingTensors.build(rows, 5, device)
    torch.testing.assert_close(apply_penalties(logits, t.penalties), expected)
    assert torch.equal(logits, torch.tensor([base] * len(rows), device=device)), "input must not be modified"

    # The greedy row's penalty moves its argmax from token 0 to token 3.
    assert sample(logits, rows).token_ids[5].item() == 3


def _normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, PROBS),
        ({"top_k": 3}, _normalised([0.30, 0.25, 0.20, 0, 0, 0])),
        # Cumulative 0.30, 0.55: the smallest prefix reaching 0.5 is two tokens.
        ({"top_p": 0.5}, _normalised([0.30, 0.25, 0, 0, 0, 0])),
        # Threshold 0.3 * 0.30 = 0.09 drops 0.08 and 0.05.
        ({"min_p": 0.3}, _normalised([0.30, 0.25, 0.20, 0.12, 0, 0])),
        # top-p sees the top-k renormalised probs 0.4, 0.33, 0.27: two tokens reach 0.6 (three would
        # without renormalisation).
        ({"top_k": 3, "top_p": 0.6}, _normalised([0.30, 0.25, 0, 0, 0, 0])),
        ({"temperature": 2.0}, _normalised([p ** (1 / 2.0) for p in PROBS])),
        # Temperature comes first: p**2 renormalised is 0.417, 0.290, 0.185, 0.067, ..., so top_p=0.8
        # keeps three tokens (on the raw probs it would keep four).
        ({"temperature": 0.5, "top_p": 0.8}, _normalised([0.30**2, 0.25**2, 0.20**2, 0, 0, 0])),
    ],
)
def test_empirical_frequencies_match_the_filtered_distribution(device, params, expected):
    logits = torch.tensor(PROBS, device=device).log().expand(NUM_DRAWS, -1).contiguous()
    shared = row(**params)
    tokens = sample(logits, [shared] * NUM_DRAWS).token_ids
    counts = torch.bincount(tokens, minlength=len(PROBS)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0:
            assert count == 0, f"token {token} is outside the kept set but was sampled {count} times"
        else:
            # Five standard deviations of a binomial frequency: a wrong distribution misses by far more.
            tolerance = 5 * math.sqrt(p * (1 - p) / NUM_DRAWS)
            assert abs(count / NUM_DRAWS - p) < tolerance, (token, count / NUM_DRAWS, p)


def _seeded_stream(device: str, position: int, num_others: int, seed: int, steps: int = 12) -> list[int]:
    """Token stream of one seeded request at `position` in a batch of `num_others` varied neighbours."""
    vocab = 500
    target_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(7)).to(device)
    target = row(generator=make_generator(seed, device), seed=seed, temperature=0.9, top_p=0.95)
    neighbour_kinds = [
        lambda i: row(),
        lambda i: row(temperature=0.0),
        lambda i: row(seed=1000 + i, generator=make_generator(1000 + i, device), top_k=20),
        lambda i: row(output=[1, 2, 3], repetition_penalty=1.3, presence_penalty=0.5, min_p=0.05, logprobs=3),
        lambda i: row(min_tokens=5, stop_token_ids=[4], temperature=1.7),
    ]
    neighbours = [neighbour_kinds[i % len(neighbour_kinds)](i) for i in range(num_others)]
    stream = []
    for step in range(steps):
        rows = neighbours[:position] + [target] + neighbours[position:]
        logits = torch.randn(len(rows), vocab, device=device)
        logits[position] = target_logits[step]
        token = sample(logits, rows, eos_token_ids=[0]).token_ids[position].item()
        target.output_token_ids.append(token)
        stream.append(token)
    return stream


def test_seeded_row_is_independent_of_batch(device):
    alone = _seeded_stream(device, position=0, num_others=0, seed=1234)
    assert _seeded_stream(device, position=17, num_others=30, seed=1234) == alone
    assert _seeded_stream(device, position=3, num_others=5, seed=1234) == alone
    # Sanity: the stream does depend on the seed, and the generator advances between steps.
    assert _seeded_stream(device, position=0, num_others=0, seed=4321) != alone
    assert len(set(alone)) > 1


def test_seed_requires_a_generator():
    with pytest.raises(ValueError, match="generator"):
        SamplingTensors.build([row(seed=3)], 10, "cpu")


def test_logprobs_ranks_and_top_k(device):
    logits = torch.randn(5, 64, device=device) * 3
    rows = [
        row(logprobs=None),
        row(logprobs=0),
        row(logprobs=3),
        # Logprobs describe the raw model distribution, not the penalised / tempered / filtered one.
        row(logprobs=5, temperature=0.3, top_k=10, repetition_penalty=2.0, prompt=[1, 2, 3]),
        row(logprobs=2, temperature=0.0),
    ]
    out = sample(logits, rows)
    reference = torch.log_softmax(logits.double(), -1).float()
    order = reference.argsort(-1, descending=True)
    assert out.top_ids.shape == (5, 5) and out.top_logprobs.shape == (5, 5)
    for i in range(5):
        token = out.token_ids[i].item()
        torch.testing.assert_close(out.logprobs[i], reference[i, token])
        assert out.ranks[i].item() == (order[i] == token).nonzero().item() + 1
        assert torch.equal(out.top_ids[i], order[i, :5])
        torch.testing.assert_close(out.top_logprobs[i], reference[i, order[i, :5]])
    assert out.ranks[4].item() == 1  # greedy without penalties picks the most likely token

    tokens = out.to_sampled_tokens()
    assert [tok.token_id for tok in tokens] == out.token_ids.tolist()
    assert tokens[0].logprob is None and tokens[0].top_logprobs is None
    assert tokens[1].logprob == pytest.approx(reference[1, tokens[1].token_id].item(), abs=1e-5)
    assert tokens[1].top_logprobs == {}
    assert list(tokens[2].top_logprobs) == order[2, :3].tolist()
    assert len(tokens[3].top_logprobs) == 5 and len(tokens[4].top_logprobs) == 2
    assert tokens[4].rank == 1


def test_min_tokens_masks_eos_and_stop_ids(device):
    eos = [9, 8]

    def peaked(*ranking: int) -> list[float]:
        logits = [0.0] * 10
        for score, token in zip((100.0, 90.0, 80.0, 70.0), ranking):
            logits[token] = score
        return logits

    cases = [
        # (row, logits, expected greedy token)
        (row(temperature=0.0, min_tokens=3, output=[1], stop_token_ids=[5]), peaked(9, 8, 5, 2), 2),
        (row(temperature=0.0, min_tokens=3, output=[1, 1, 1], stop_token_ids=[5]), peaked(9, 8, 5, 2), 9),
        # ignore_eos: EOS does not stop the request, so only the stop ids are masked.
        (row(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[5]), peaked(5, 9, 2), 9),
        # Stop ids outside the vocabulary are ignored rather than crashing.
        (row(temperature=0.0, min_tokens=1, stop_token_ids=[1000]), peaked(9, 3), 3),
        (row(temperature=0.0), peaked(9, 3), 9),
    ]
    logits = torch.tensor([c[1] for c in cases], device=device)
    out = sample(logits, [c[0] for c in cases], eos_token_ids=eos)
    assert out.token_ids.tolist() == [c[2] for c in cases]

    # Random rows: flat logits, so any unmasked token would show up among many draws.
    flat = torch.zeros(4000, 10, device=device)
    tokens = sample(flat, [row(min_tokens=2, stop_token_ids=[5])] * 4000, eos_token_ids=eos).token_ids
    assert not torch.isin(tokens, torch.tensor([5, 8, 9], device=device)).any()
    assert len(tokens.unique()) == 7


def test_build_skips_unused_stages():
    t = SamplingTensors.build([row(temperature=0.0), row(temperature=0.0, output=[1])], 32, "cpu")
    assert t.all_greedy and t.greedy is None and t.temperature is None and t.top_k is None
    assert t.penalties is None and t.banned_index is None and t.max_num_logprobs is None

    t = SamplingTensors.build([row(), row(top_k=64), row(top_p=1.0)], 32, "cpu")  # top_k >= vocab is off
    assert not t.all_greedy and t.greedy is None and t.temperature is None
    assert t.top_k is None and t.top_p is None and t.min_p is None and t.penalties is None

    t = SamplingTensors.build([row(temperature=0.0), row(frequency_penalty=0.5, output=[3])], 32, "cpu")
    assert t.greedy.tolist() == [True, False]
    assert t.penalties.repetition is None and t.penalties.prompt_index is None and t.penalties.presence is None
    assert t.penalties.output_index.tolist() == [1 * 32 + 3]


def _pack(allowed: torch.Tensor) -> np.ndarray:
    """[N, V] bool → the int32 bitmask layout, packed by hand bit by bit (the reference)."""
    num_rows, vocab = allowed.shape
    width = (vocab + 31) // 32
    out = np.zeros((num_rows, width), dtype=np.uint32)
    for r in range(num_rows):
        for t in allowed[r].nonzero().flatten().tolist():
            out[r, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def test_grammar_bitmask_masks_exactly_the_forbidden_tokens(device):
    vocab = 70  # not a multiple of 32: the last word is partly unused
    logits = torch.randn(5, vocab, device=device)
    allowed = torch.rand(3, vocab) < 0.2
    allowed[:, 33] = True  # a bit in the second word, so no row is empty
    rows = [0, 2, 4]
    for params in ({"temperature": 0.0}, {"temperature": 1.3, "top_k": 20, "top_p": 0.9}):
        t = SamplingTensors.build([row(**params) for _ in range(5)], vocab, device)
        t.add_grammar(rows, _pack(allowed), torch.device(device))
        for _ in range(20):
            out = Sampler()(logits, t)
            for i, r in enumerate(rows):
                assert allowed[i, out.token_ids[r].item()], (params, r)
        if params["temperature"] == 0.0:
            expected = logits.cpu().masked_fill(~torch.ones(5, vocab, dtype=torch.bool).index_copy(
                0, torch.tensor(rows), allowed), float("-inf")).argmax(-1)
            assert out.token_ids.cpu().tolist() == expected.tolist()
            unconstrained = [1, 3]
            assert out.token_ids[unconstrained].tolist() == logits.argmax(-1)[unconstrained].tolist()
