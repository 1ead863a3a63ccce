"""KV-aware admission (engine/admission.py, engine/output_length.py) against the optimistic policy, driven through
EngineCore with the fake executors (no torch, milliseconds). Every expected row count and block count below is
worked out by hand from the pool size; outputs are checked against the fake model's own continuation."""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.kv_groups import plan_kv_groups
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit import test_hybrid_kv_cache as hybrid
from tests.unit.fake_executor import FakeExecutor, expected_continuation
from tests.unit.test_scheduler import _max_tokens_stop, _NoDetokenizer

BLOCK = 16


def _engine(policy: str, num_blocks: int, budget: int = 512, max_num_seqs: int = 64, async_scheduling: bool = False,
            check_stop=_max_tokens_stop, enable_caching: bool = False) -> EngineCore:
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching)
    config = SchedulerConfig(max_num_seqs, budget, num_blocks * BLOCK, admission_policy=policy)
    return EngineCore(Scheduler(config, kv, check_stop), FakeExecutor(num_blocks, BLOCK, budget), _NoDetokenizer(),
                      async_scheduling)


def _run(engine: EngineCore) -> tuple[dict[str, Request], int]:
    """Every request's final state, and the most requests that ran at once."""
    done, most_running = {}, 0
    for _ in range(100_000):
        if not engine.has_unfinished():
            return done, most_running
        for finished in engine.step():
            done[finished.request.request_id] = finished.request
        most_running = max(most_running, len(engine.scheduler.running))
    raise AssertionError("engine did not finish: livelock")


def _rows(count: int, seed: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 900) for _ in range(length)] for _ in range(count)]


def _stop_at(targets: dict[str, int]):
    """A fake EOS: request i stops (FINISHED_STOPPED) after targets[i] output tokens, or at max_tokens."""
    def check_stop(request: Request) -> bool:
        if request.num_output_tokens >= targets.get(request.request_id, 1 << 30):
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return _max_tokens_stop(request)
    return check_stop


@pytest.mark.parametrize("forced", [dict(ignore_eos=True), dict(min_tokens=64)], ids=["ignore_eos", "min_tokens"])
@pytest.mark.parametrize("policy", ["kv_aware", "optimistic"])
def test_forced_outputs_never_preempt_while_the_pool_holds_them(policy, forced, async_scheduling):
    # 32-token prompts + 64 forced tokens = 96 tokens = 6 blocks of 16: a 40-block pool holds 6 rows to the end.
    engine = _engine(policy, num_blocks=40, async_scheduling=async_scheduling)
    rows = _rows(20, seed=1, length=32)
    for i, row in enumerate(rows):
        engine.add_request(str(i), row, SamplingParams(max_tokens=64, **forced))
    done, most_running = _run(engine)
    assert all(done[str(i)].output_token_ids == expected_continuation(row, 64) for i, row in enumerate(rows))
    stats = engine.scheduler.stats
    if policy == "kv_aware":
        assert (stats.num_preemptions, stats.num_recomputed_tokens) == (0, 0)
        assert most_running == 40 // 6, "the pool's rows were not all admitted"
    else:  # the same setup preempts under the old policy: the test above can fail
        assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0
        assert most_running > 40 // 6


def test_forced_outputs_of_mixed_lengths_never_preempt(async_scheduling):
    engine = _engine("kv_aware", num_blocks=40, budget=64, async_scheduling=async_scheduling)
    rng = random.Random(3)
    rows = [_rows(1, seed=i, length=rng.randint(1, 90))[0] for i in range(30)]
    max_tokens = [rng.randint(1, 120) for _ in rows]
    for i, (row, n) in enumerate(zip(rows, max_tokens)):
        engine.add_request(str(i), row, SamplingParams(max_tokens=n, ignore_eos=True))
    done, _ = _run(engine)
    for i, (row, n) in enumerate(zip(rows, max_tokens)):
        assert done[str(i)].output_token_ids == expected_continuation(row, n), i
    assert engine.scheduler.stats.num_preemptions == 0
    assert engine.scheduler.kv_cache.pool.num_free_blocks == 40


def _learn_then_run(later_targets: list[int], async_scheduling: bool):
    """10 rows stop after 3..12 tokens (the learned estimate: ceil(0.9-quantile 11 x 1.2) = 14 tokens), then 60
    more 16-token rows with max_tokens 200 stop after `later_targets[i]` tokens. Returns the engine, the later
    rows, their outputs and the most of them that ran at once."""
    rows = _rows(70, seed=7, length=16)
    targets = {str(i): 3 + i for i in range(10)} | {str(10 + i): n for i, n in enumerate(later_targets)}
    engine = _engine("kv_aware", num_blocks=64, async_scheduling=async_scheduling, check_stop=_stop_at(targets))
    for i in range(10):
        engine.add_request(str(i), rows[i], SamplingParams(max_tokens=200))
    _run(engine)
    assert engine.scheduler.output_lengths.estimate == 14
    for i in range(10, 70):
        engine.add_request(str(i), rows[i], SamplingParams(max_tokens=200))
    done, most_running = _run(engine)
    return engine, rows, targets, done, most_running


def test_learned_lengths_admit_more_rows_than_max_tokens_would(async_scheduling):
    engine, rows, targets, done, most_running = _learn_then_run([random.Random(i).randint(3, 12) for i in range(60)],
                                                                async_scheduling)
    for i in range(10, 70):
        assert done[str(i)].output_token_ids == expected_continuation(rows[i], targets[str(i)]), i
    # max_tokens: 16 + 200 tokens = 14 blocks, 64 // 14 = 4 rows. Learned: 16 + 14 = 30 tokens = 2 blocks, and any
    # estimate of 1..16 tokens (the later rows move it) still needs 2: 64 // 2 = 32 rows, and none preempted.
    assert most_running == 32 > 64 // 14
    assert engine.scheduler.stats.num_preemptions == 0


def test_a_short_estimate_is_recovered_by_preemption_with_exact_outputs(async_scheduling):
    engine, rows, targets, done, most_running = _learn_then_run([100] * 60, async_scheduling)
    for i in range(10, 70):  # far past the estimate of 14: preempted and recomputed, the same tokens all the same
        assert done[str(i)].output_token_ids == expected_continuation(rows[i], 100), i
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0
    assert engine.scheduler.kv_cache.pool.num_free_blocks == 64


def test_prefix_hits_on_blocks_in_use_cost_nothing():
    """A: a 64-token prompt + 16 forced tokens = 5 blocks. B: the same 64 tokens + 1 and 15 forced = 5 blocks, 4 of
    them A's (hit in the step A computes them). In 7 blocks: A still takes 1, B 1 more: both run at once, where
    counting B whole (5 of the 3 left) would hold it back."""
    engine = _engine("kv_aware", num_blocks=7, enable_caching=True)
    a = _rows(1, seed=11, length=64)[0]
    b = a + [7]
    engine.add_request("a", a, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.add_request("b", b, SamplingParams(max_tokens=15, ignore_eos=True))
    done, most_running = _run(engine)
    assert done["a"].output_token_ids == expected_continuation(a, 16)
    assert done["b"].output_token_ids == expected_continuation(b, 15)
    assert most_running == 2 and engine.scheduler.stats.num_preemptions == 0
    assert engine.scheduler.kv_cache.stats.hits == 64


def test_recomputed_tokens_counted_exactly():
    """3 blocks of 16. A (16-token prompt, 30 outputs) and B (10-token prompt, 20 outputs) start together. A takes
    the last free block in step 2 (position 16); in step 8 B needs a block for position 16 and is preempted with
    positions 0..15 computed. It waits for A to finish (step 30: A needs its third block in step 18, and B two),
    then computes its 17 tokens again at once: 16 of them recomputed."""
    engine = _engine("optimistic", num_blocks=3, budget=64)
    rng = random.Random(0)
    a, b = [rng.randrange(5, 900) for _ in range(16)], [rng.randrange(5, 900) for _ in range(10)]
    engine.add_request("a", a, SamplingParams(max_tokens=30))
    engine.add_request("b", b, SamplingParams(max_tokens=20))
    done, _ = _run(engine)
    assert done["a"].output_token_ids == expected_continuation(a, 30)
    assert done["b"].output_token_ids == expected_continuation(b, 20)
    stats = engine.scheduler.stats
    assert stats.num_preemptions == 1
    assert stats.num_recomputed_tokens == 16
    assert stats.num_prefill_tokens == 16 + 10 + 17


def test_hybrid_manager_counts_a_window_group_up_to_its_window():
    # Block 16, groups (full, window 32): a decode at length l > 32 holds cdiv(32 + (l - 32) % 16, 16) <= 3 blocks.
    kv = HybridKVCacheManager(200, BLOCK, plan_kv_groups([None, 32]))
    assert [kv.num_blocks_to_hold(n) for n in (1, 16, 20, 33, 47, 48, 100)] == [2, 2, 4, 6, 6, 6, 7 + 3]
    request = Request("a", list(range(5, 21)), SamplingParams(max_tokens=84))  # 16 + 84 = 100 tokens
    assert kv.allocate_slots(request, 16) is not None
    request.num_computed_tokens = 16
    most = 0
    for _ in range(84):
        kv.allocate_slots(request, 1)
        most = max(most, kv.num_blocks_held(request))
        assert kv.pool.num_used_blocks == kv.num_blocks_held(request)
        request.num_computed_tokens += 1
    assert most == 10


@pytest.mark.parametrize("policy", ["kv_aware", "optimistic"])
def test_hybrid_forced_outputs_fill_the_pool_their_windows_leave(policy):
    """Block 4, groups (full, window 8): an 8-token prompt + 32 forced tokens = 40 tokens holds 10 full blocks and
    at most cdiv(8 + 3, 4) = 3 window blocks: 13, so a 52-block pool runs 4 rows (counting the window group whole,
    20 blocks a row, would run 2)."""
    layout = plan_kv_groups([None, 8])
    kv = HybridKVCacheManager(52, hybrid.BLOCK, layout)
    config = SchedulerConfig(64, 64, kv.capacity_tokens, admission_policy=policy)
    engine = EngineCore(Scheduler(config, kv, _max_tokens_stop), hybrid.GroupedFakeExecutor(52, layout),
                        _NoDetokenizer(), False)
    rows = _rows(12, seed=5, length=8)
    for i, row in enumerate(rows):
        engine.add_request(str(i), row, SamplingParams(max_tokens=32, ignore_eos=True))
    done, most_running = _run(engine)
    for i, row in enumerate(rows):
        assert done[str(i)].output_token_ids == hybrid.expected(row, 32, layout.group_windows), i
    assert kv.pool.num_free_blocks == 52
    if policy == "kv_aware":
        assert engine.scheduler.stats.num_preemptions == 0 and most_running == 4
    else:
        assert engine.scheduler.stats.num_preemptions > 0


def test_the_policy_is_checked_and_defaults_to_kv_aware():
    from batchllm.engine_config import EngineConfig

    assert EngineConfig.from_kwargs(device="cpu").scheduler.admission_policy == "kv_aware"
    assert EngineConfig.from_kwargs(device="cpu", admission_policy="optimistic").scheduler.admission_policy == (
        "optimistic")
    with pytest.raises(ValueError, match="admission_policy must be 'kv_aware' or 'optimistic', got 'fcfs'"):
        EngineConfig.from_kwargs(device="cpu", admission_policy="fcfs")
