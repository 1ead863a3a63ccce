"""Scheduler invariants, driven through EngineCore with a fake executor (no torch, milliseconds)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import FakeExecutor, expected_continuation

BLOCK = 16


def _max_tokens_stop(request: Request) -> bool:
    if request.num_output_tokens >= request.sampling_params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


class _NoDetokenizer:
    def finish(self, request: Request) -> str:
        return ""


def _engine(num_blocks: int, budget: int, max_num_seqs: int = 64, max_model_len: int | None = None,
            enable_caching: bool = False, async_scheduling: bool = False):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching)
    config = SchedulerConfig(max_num_seqs, budget, max_model_len or num_blocks * BLOCK)
    scheduler = Scheduler(config, kv, _max_tokens_stop)
    executor = FakeExecutor(num_blocks, BLOCK, budget)
    return EngineCore(scheduler, executor, _NoDetokenizer(), async_scheduling), executor


def _run(engine: EngineCore) -> dict[str, Request]:
    done = {}
    for _ in range(100_000):
        if not engine.has_unfinished():
            return done
        for finished in engine.step():
            done[finished.request.request_id] = finished.request
    raise AssertionError("engine did not finish: livelock")


def run_and_check(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Request]:
    """Run request i (`prompts[i]`, `max_tokens[i]`) to the end: each output is the fake model's continuation, and
    every block is back in the pool."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n))
    done = _run(engine)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, n), f"request {i}"
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    return done


def stop_on_multiples_of_7(engine: EngineCore) -> None:
    """Rows also stop on a token's value, as on EOS or a stop token: a multiple of 7."""
    max_tokens_stop = engine.scheduler.check_stop

    def check_stop(request: Request) -> bool:
        if request.token_ids[-1] % 7 == 0:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return max_tokens_stop(request)

    engine.scheduler.check_stop = check_stop


def _prompts(count: int, seed: int, low: int = 1, high: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 900) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.mark.parametrize("num_blocks,budget,tight_pool", [(400, 8192, False), (40, 64, True), (12, 16, True),
                                                           (30, 7, False)])
def test_outputs_correct_under_pressure_and_pool_fully_freed(num_blocks, budget, tight_pool, async_scheduling):
    engine, executor = _engine(num_blocks, budget, async_scheduling=async_scheduling)
    prompts = _prompts(25, seed=num_blocks, high=min(150, num_blocks * BLOCK - 40))
    max_tokens = [random.Random(i).randint(1, 30) for i in range(len(prompts))]
    run_and_check(engine, prompts, max_tokens)
    assert max(s.num_scheduled_tokens for s in executor.steps) <= budget
    stats = engine.scheduler.stats
    if tight_pool:
        assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    if budget < 150:
        assert stats.num_chunked_prefills > 0
    assert stats.peak_used_blocks <= num_blocks
    if async_scheduling:
        assert any(r.placeholder for step in executor.steps for r in step.requests), "nothing was overlapped"


def test_async_drops_the_token_after_an_unforeseen_stop():
    """A request that stops on a token value (as on EOS or a stop token) is scheduled once more before its
    stop is known; that token is discarded, its blocks are freed and the outputs equal the synchronous ones."""
    prompts = _prompts(12, seed=5, low=5, high=40)
    results = {}
    for async_scheduling in (False, True):
        engine, executor = _engine(num_blocks=30, budget=48, async_scheduling=async_scheduling)
        stop_on_multiples_of_7(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=25))
        done = _run(engine)
        results[async_scheduling] = [done[str(i)].output_token_ids for i in range(len(prompts))]
        pool = engine.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks
        if async_scheduling:
            wasted = sum(1 for step in executor.steps for r in step.requests if r.sample) - sum(
                len(tokens) for tokens in results[True])
            assert wasted > 0, "no request was scheduled past its stop: the test exercises nothing"
    assert any(len(tokens) < 25 for tokens in results[False])
    assert results[True] == results[False]


def test_fifo_admission_order():
    engine, executor = _engine(num_blocks=20, budget=64, max_num_seqs=3)
    prompts = _prompts(12, seed=7, low=10, high=60)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=5))
    _run(engine)
    first_seen: list[str] = []
    for step in executor.steps:
        for r in step.requests:
            if r.request_id not in first_seen:
                first_seen.append(r.request_id)
    assert first_seen == [str(i) for i in range(len(prompts))]


def test_running_requests_are_served_before_new_ones():
    engine, executor = _engine(num_blocks=100, budget=32)
    engine.add_request("long", list(range(5, 100)), SamplingParams(max_tokens=3))
    engine.add_request("next", list(range(5, 20)), SamplingParams(max_tokens=3))
    _run(engine)
    # The long prompt is chunked 32 + 32 + 31; "next" only gets the budget the running request leaves.
    first = executor.steps[0]
    assert [(r.request_id, len(r.token_ids)) for r in first.requests] == [("long", 32)]
    third = executor.steps[2]
    assert [(r.request_id, len(r.token_ids)) for r in third.requests] == [("long", 31), ("next", 1)]


def test_request_larger_than_pool_fails_alone(async_scheduling):
    engine, _ = _engine(num_blocks=8, budget=64, async_scheduling=async_scheduling)  # 128 tokens of KV in all
    engine.add_request("ok1", list(range(5, 40)), SamplingParams(max_tokens=4))
    engine.add_request("huge", list(range(5, 205)), SamplingParams(max_tokens=4))
    engine.add_request("empty", [], SamplingParams(max_tokens=4))
    engine.add_request("ok2", list(range(7, 30)), SamplingParams(max_tokens=4))
    done = _run(engine)
    assert done["huge"].status is RequestStatus.FINISHED_ERROR and "max_model_len" in done["huge"].error
    assert done["empty"].status is RequestStatus.FINISHED_ERROR and "empty" in done["empty"].error
    for rid, prompt in (("ok1", list(range(5, 40))), ("ok2", list(range(7, 30)))):
        assert done[rid].output_token_ids == expected_continuation(prompt, 4)


def test_generation_stops_at_max_model_len(async_scheduling):
    engine, _ = _engine(num_blocks=10, budget=64, max_model_len=50, async_scheduling=async_scheduling)
    engine.add_request("a", list(range(5, 45)), SamplingParams(max_tokens=100))
    done = _run(engine)
    assert done["a"].num_tokens == 50 and done["a"].finish_reason == "length"


def test_max_num_seqs_is_respected():
    engine, executor = _engine(num_blocks=200, budget=4096, max_num_seqs=4)
    for i, prompt in enumerate(_prompts(10, seed=3)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6))
    _run(engine)
    assert max(len(step.requests) for step in executor.steps) <= 4


def test_engine_layer_does_not_import_torch():
    code = ("import sys, batchllm.engine.engine_core, batchllm.engine.scheduler, batchllm.engine.detokenizer; "
            "assert 'torch' not in sys.modules, 'engine imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
