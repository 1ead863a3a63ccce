"""The n-gram proposer against a brute-force scan, and the adaptive policy against hand-computed plans and an
exhaustive search of its objective."""

from __future__ import annotations

import itertools
import random

import pytest

from batchllm.engine.speculative.ngram import NgramProposer
from batchllm.engine.speculative.policy import SpeculationPolicy


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # occurrences ending before the last position, latest first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 3), (2, 3, 4), (1, 4, 2), (3, 5, 5)])
def test_ngram_matches_brute_force_incrementally(min_n, max_n, k):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(60):
        proposer = NgramProposer(min_n, max_n)
        tokens: list[int] = []
        alphabet = rng.randint(2, 5)
        while len(tokens) < 60:
            tokens += [rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
            assert proposer.propose("r", tokens, k) == brute_force(tokens, min_n, max_n, k), (trial, tokens)
            assert NgramProposer(min_n, max_n).propose("fresh", tokens, k) == brute_force(tokens, min_n, max_n, k)


def test_ngram_hand_cases():
    proposer = NgramProposer(2, 3)
    assert proposer.propose("a", [5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]
    assert proposer.propose("b", [1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 2).propose("c", [1, 1, 1, 1], 3) == [1]  # the continuation may run into the suffix
    assert NgramProposer(1, 1).propose("d", [4, 1, 4, 2, 4], 1) == [2]  # the most recent occurrence wins
    # The longest n wins over a more recent shorter match: [7, 4] matched at the start, [4] alone later.
    assert NgramProposer(1, 2).propose("e", [7, 4, 1, 4, 3, 7, 4], 1) == [1]
    proposer.forget("a")
    assert "a" not in proposer._indexes


def _throughput(rates, ks, overhead, verify_overhead=0.0):
    tokens = len(rates) + sum(sum(r ** j for j in range(1, k + 1)) for r, k in zip(rates, ks))
    return tokens / (overhead + len(rates) + sum(ks) + (verify_overhead if any(ks) else 0.0))


def test_policy_hand_cases():
    policy = SpeculationPolicy(4, overhead_tokens=100)
    assert policy.plan([("a", 4)]) == [4]  # one row, a large fixed cost: every draft pays
    assert policy.plan([("a", 2)]) == [2]  # capped by the row
    crowded = SpeculationPolicy(4, overhead_tokens=0)
    assert crowded.plan([(str(i), 4) for i in range(256)]) == [0] * 256  # E / C = 1 already: nothing pays
    assert SpeculationPolicy(4, 0, adaptive=False).plan([("a", 4), ("b", 1)]) == [4, 1]
    # A verification step's fixed cost: rate 0.8, overhead 100: 4 drafts give 1 + 2.36 tokens for 105 + 300
    # units, 0.0083 per unit, against 1 / 101 = 0.0099 without: not worth it; at 100 it is (0.0164).
    assert SpeculationPolicy(4, 100, verify_overhead_tokens=300).plan([("a", 4)]) == [0]
    assert SpeculationPolicy(4, 100, verify_overhead_tokens=100).plan([("a", 4)]) == [4]


def test_policy_turns_itself_off_and_counts_positions():
    policy = SpeculationPolicy(3, overhead_tokens=20)
    for _ in range(10):
        k = policy.plan([("bad", 3)])[0]
        if k:
            policy.record("bad", k, 0)
    assert policy.plan([("bad", 3)]) == [0]
    for i in range(30):  # a job whose rows all reject: its new rows stop drafting
        request_id = f"bad{i}"
        while k := policy.plan([(request_id, 3)])[0]:
            policy.record(request_id, k, 0)
    assert policy.plan([("new", 3)]) == [0]
    good = SpeculationPolicy(3, overhead_tokens=20)
    good.record("g", 3, 2)
    assert good.stats.drafted_per_position == [1, 1, 1] and good.stats.accepted_per_position == [1, 1, 0]
    assert good.stats.per_position_acceptance == [1.0, 1.0, 0.0]


def test_policy_is_optimal_for_its_objective():
    rng = random.Random(3)
    for _ in range(200):
        num_rows, k_max = rng.randint(1, 3), rng.randint(1, 3)
        overhead, verify = rng.choice([0, 1, 3, 10, 40]), rng.choice([0, 0, 2, 10, 50])
        policy = SpeculationPolicy(k_max, overhead, verify)
        rows = []
        for i in range(num_rows):
            for _ in range(rng.randint(0, 4)):
                drafted = rng.randint(0, k_max)
                policy.record(str(i), drafted, rng.randint(0, drafted))
            rows.append((str(i), rng.randint(0, k_max)))
        rates = [policy.rate(r) for r, _ in rows]
        ks = policy.plan(rows)
        best = max(_throughput(rates, c, overhead, verify)
                   for c in itertools.product(*(range(m + 1) for _, m in rows)))
        assert _throughput(rates, ks, overhead, verify) == pytest.approx(best)


def test_speculator_stays_on_through_misses_and_turns_off_after_eight():
    """The asynchronous loop keeps tokens known while drafting pays: one n-gram miss must not turn it off, eight
    in a row do, and a policy that plans nothing turns it off at once."""
    from batchllm.engine.request import Request
    from batchllm.engine.speculative.config import SpeculativeConfig
    from batchllm.engine.speculative.speculator import PROBE_INTERVAL, Speculator
    from batchllm.sampling_params import SamplingParams

    speculator = Speculator(SpeculativeConfig("ngram", 3), overhead_tokens=8.0, max_model_len=1000)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=100))
    request.num_computed_tokens = len(request.token_ids) - 1  # decoding, nothing in flight
    request.known_to_runner = True
    speculator.plan([request])
    assert request.draft_token_ids == [3, 1, 2] and speculator.active
    for step in range(PROBE_INTERVAL):
        request.token_ids.append(100 + step)  # tokens never seen before: no match
        request.num_computed_tokens += 1
        speculator.plan([request])
        assert request.draft_token_ids == []
        assert speculator.active == (step < PROBE_INTERVAL - 1)
    request.token_ids += [1, 2]  # matches again, its latest occurrence
    request.num_computed_tokens += 2
    speculator.plan([request])
    assert request.draft_token_ids == [100, 101, 102] and speculator.active
    speculator.policy.overhead_tokens = 0.0  # no forward pass is cheap enough for a draft to pay
    speculator.policy._counts["r"] = (0.0, 10.0)
    speculator.plan([request])
    assert request.draft_token_ids == [] and not speculator.active


def test_speculator_plans_nothing_past_the_rows_verification_graphs_cover():
    """On CUDA a verification step of more rows than its graphs hold runs eagerly, which no acceptance repays: the
    adaptive policy drafts for none of them; a fixed configuration (`adaptive: false`) still drafts."""
    from batchllm.engine.request import Request
    from batchllm.engine.speculative.config import SpeculativeConfig
    from batchllm.engine.speculative.speculator import Speculator
    from batchllm.sampling_params import SamplingParams

    def rows(n: int) -> list[Request]:
        requests = [Request(str(i), [1, 2, 3, 1, 2], SamplingParams(max_tokens=100)) for i in range(n)]
        for request in requests:
            request.num_computed_tokens = len(request.token_ids) - 1
            request.known_to_runner = True
        return requests

    for adaptive, expected_at_three in ((True, []), (False, [3, 1, 2])):
        speculator = Speculator(SpeculativeConfig("ngram", 3, adaptive=adaptive), overhead_tokens=8.0,
                                max_model_len=1000, max_verify_rows=2)
        two, three = rows(2), rows(3)
        speculator.plan(two)
        assert [r.draft_token_ids for r in two] == [[3, 1, 2]] * 2
        speculator.plan(three)
        assert [r.draft_token_ids for r in three] == [expected_at_three] * 3
        assert speculator.active == (not adaptive)
        # No probing of the asynchronous loop while the batch is too large for any plan: it stays overlapped.
        probes = [speculator.needs_known_tokens(3) for _ in range(20)]
        assert probes == [True] * 20 if not adaptive else not any(probes)
        assert any(speculator.needs_known_tokens(2) for _ in range(8))


def test_a_row_new_to_the_runner_gets_no_drafts():
    """A request swapped back in decodes from its first step back, but the runner meets it in that step: its row
    is laid out as a new request, without drafts to verify."""
    from batchllm.engine.request import Request
    from batchllm.engine.speculative.config import SpeculativeConfig
    from batchllm.engine.speculative.speculator import Speculator
    from batchllm.sampling_params import SamplingParams

    speculator = Speculator(SpeculativeConfig("ngram", 3), overhead_tokens=8.0, max_model_len=1000)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=100))
    request.num_computed_tokens = len(request.token_ids) - 1
    speculator.plan([request])
    assert request.draft_token_ids == [] and request.num_lookahead == 0
