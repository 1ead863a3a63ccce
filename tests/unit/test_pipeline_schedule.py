"""The engine loop under pipeline parallelism (P steps in flight, `num_micro_batches=P`), through EngineCore with the
fake executor (no torch): a request whose token is in flight is not scheduled again (a prompt's chunks may follow
each other down the pipeline, and a request preempted meanwhile may start over: every stage runs its steps in
order), no placeholder tokens, a step capped at
max_num_seqs / P rows, the pipeline kept full, and the fake model's outputs exact under preemption, prefix caching,
the host tier and aborts."""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import expected_continuation
from tests.unit.test_abort import _RecordingDetokenizer
from tests.unit.test_host_tier import TieredFakeExecutor
from tests.unit.test_scheduler import BLOCK, _max_tokens_stop, _run


def _pipelined(depth: int, num_blocks: int, budget: int, max_num_seqs: int, caching: bool = True,
               num_host_blocks: int = 0, mode: str = "recompute"):
    kv = KVCacheManager(num_blocks, BLOCK, caching, num_host_blocks)
    config = SchedulerConfig(max_num_seqs, budget, num_blocks * BLOCK, preemption_mode=mode, num_micro_batches=depth)
    scheduler = Scheduler(config, kv, _max_tokens_stop)
    executor = TieredFakeExecutor(num_blocks, max(num_host_blocks, 1), BLOCK, budget)
    engine = EngineCore(scheduler, executor, _RecordingDetokenizer(), pipeline_depth=depth)
    # Per launch: (rows of the step, how many steps were in flight with it, its continuing rows whose tokens are).
    launches = []
    launch = executor.execute_model_async

    def checked(so):
        sampling = {r.request_id for step, _ in engine._in_flight for r in step.requests if r.sample}
        continuing = {r.request_id for r in so.requests if r.new is None}
        assert not any(r.placeholder for r in so.requests), "a pipelined step carries a placeholder"
        launches.append((len(so.requests), len(engine._in_flight) + 1, continuing & sampling))
        return launch(so)

    executor.execute_model_async = checked
    return engine, launches


def _prompts(count: int, seed: int, shared: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [shared[: rng.choice([0, 16, 32])] + [rng.randrange(5, 900) for _ in range(rng.randint(1, 60))]
            for _ in range(count)]


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("num_blocks,budget,host", [(400, 8192, 0), (18, 48, 0), (18, 48, 12)],
                         ids=["roomy", "tight", "tight+host-tier"])
def test_pipelined_steps_are_exact_and_disjoint(depth, num_blocks, budget, host):
    max_num_seqs = 6
    engine, launches = _pipelined(depth, num_blocks, budget, max_num_seqs, num_host_blocks=host,
                                  mode="swap" if host else "recompute")
    shared = [random.Random(99).randrange(5, 900) for _ in range(32)]
    prompts = _prompts(30, seed=depth * 100 + num_blocks, shared=shared)
    max_tokens = [random.Random(i).randint(1, 25) for i in range(len(prompts))]
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n))
    done = _run(engine)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, n), f"request {i}"
    assert all(not waiting for _, _, waiting in launches), "a request ran again before its token came back"
    assert max(rows for rows, _, _ in launches) <= -(-max_num_seqs // depth)
    assert max(in_flight for _, in_flight, _ in launches) == depth, "the pipeline never filled"
    kv = engine.scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    stats = engine.scheduler.stats
    assert kv.stats.hits > 0
    if num_blocks == 18:
        assert stats.num_preemptions > 0
    if host:
        assert kv.host.stats.swap_preemptions > 0 and kv.host.pool.num_free_blocks == host


def test_abort_of_a_request_in_a_pipelined_step():
    engine, _ = _pipelined(2, 200, 8192, 4)
    prompts = _prompts(6, seed=1, shared=[])
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=15))
    engine.step()
    engine.step()
    in_flight = [r.request_id for step, _ in engine._in_flight for r in step.requests if r.sample]
    assert in_flight
    engine.abort(in_flight[0])
    done = _run(engine)
    assert set(done) == {str(i) for i in range(6)} - {in_flight[0]}
    for request_id, request in done.items():
        assert request.output_token_ids == expected_continuation(prompts[int(request_id)], 15)
    assert engine.scheduler.kv_cache.pool.num_free_blocks == 200
