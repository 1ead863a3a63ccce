"""Decode bursts in the scheduler (engine/decode_burst.py), against the fake executor's model: the outputs of bursts
equal the single steps' continuation, whatever the burst length, the loop, the pool's pressure and the stops."""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.decode_burst import burst_length
from batchllm.engine.request import Request
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import expected_continuation
from tests.unit.test_abort import _RecordingDetokenizer
from tests.unit.test_scheduler import _engine, _prompts, _run, run_and_check, stop_on_multiples_of_7


def _burst_engine(num_blocks: int, budget: int, steps: int, async_scheduling: bool, max_num_seqs: int = 64,
                  max_model_len: int | None = None):
    engine, executor = _engine(num_blocks, budget, max_num_seqs, max_model_len, async_scheduling=async_scheduling)
    engine.scheduler.config.num_decode_steps = steps
    return engine, executor


@pytest.mark.parametrize("steps", [2, 5, 8])
@pytest.mark.parametrize("num_blocks,budget,tight_pool", [(400, 8192, False), (40, 64, True)])
def test_bursts_give_the_single_steps_outputs(steps, num_blocks, budget, tight_pool, async_scheduling):
    engine, executor = _burst_engine(num_blocks, budget, steps, async_scheduling)
    prompts = _prompts(20, seed=num_blocks + steps, high=min(120, num_blocks * 16 - 60))
    max_tokens = [1 + (7 * i) % 30 for i in range(len(prompts))]  # most not a multiple of the burst
    run_and_check(engine, prompts, max_tokens)
    bursts = [step for step in executor.steps if step.num_steps > 1]
    assert bursts, "no step ran as a burst"
    assert all(step.num_steps <= steps for step in executor.steps)
    assert engine.scheduler.stats.num_decode_bursts == len(bursts)
    if tight_pool:
        assert engine.scheduler.stats.num_preemptions > 0, "the small pool was meant to force preemption"


def test_a_stop_inside_a_burst_drops_the_rest(async_scheduling):
    """Rows that stop on a token's value (EOS, a stop token) stop at that token; the burst's later tokens, and
    under the asynchronous loop the next burst's, are discarded; the outputs equal those of single steps."""
    prompts = _prompts(12, seed=5, low=5, high=40)
    results = {}
    for steps in (1, 6):
        engine, _ = _burst_engine(30, 48, steps, async_scheduling)
        stop_on_multiples_of_7(engine)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=25))
        done = _run(engine)
        results[steps] = [done[str(i)].output_token_ids for i in range(len(prompts))]
        pool = engine.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks
    assert any(len(tokens) < 25 for tokens in results[1])
    assert results[6] == results[1]


def test_bursts_stop_at_max_model_len(async_scheduling):
    engine, executor = _burst_engine(40, 8192, 8, async_scheduling, max_model_len=70)
    prompts = _prompts(6, seed=3, low=40, high=60)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1000))
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, 70 - len(prompt)), f"request {i}"
    assert any(step.num_steps > 1 for step in executor.steps)


def _request(request_id: str, params: SamplingParams, computed: bool = True) -> Request:
    request = Request(request_id, [5, 6, 7, 8], params)
    request.token_ids.append(9)  # one output token, known
    request.num_computed_tokens = 4 if computed else 0
    return request


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(max_tokens=100), 8),
    (SamplingParams(max_tokens=4), 3),  # 1 of 4 output tokens known: 3 left
    (SamplingParams(max_tokens=100, seed=1), 1),
    (SamplingParams(max_tokens=100, logprobs=2), 1),
    (SamplingParams(max_tokens=100, min_tokens=3), 1),
    (SamplingParams(max_tokens=100, presence_penalty=0.5), 1),
    (SamplingParams(max_tokens=100, repetition_penalty=1.2), 1),
    (SamplingParams(max_tokens=100, stop=["x"], temperature=0.7, top_p=0.9), 8),
])
def test_burst_length_by_sampling_params(params, expected):
    config = SchedulerConfig(64, 8192, 1000, num_decode_steps=8)
    assert burst_length([_request("a", params), _request("b", params)], 0, config) == expected
    # One row that needs the host between its tokens keeps every row to single steps.
    assert burst_length([_request("a", SamplingParams(max_tokens=100)), _request("b", params)], 0,
                        config) == (1 if expected == 1 else 8)


def test_burst_length_waits_for_prefill_and_admission():
    config = SchedulerConfig(2, 8192, 1000, num_decode_steps=8)
    plain = SamplingParams(max_tokens=100)
    decoding = [_request("a", plain), _request("b", plain)]
    assert burst_length(decoding, 0, config) == 8
    assert burst_length(decoding, 3, config) == 8  # waiting rows, but no seat is free
    assert burst_length(decoding[:1], 3, config) == 1  # a seat is free: admit first
    assert burst_length([*decoding[:1], _request("c", plain, computed=False)], 0, config) == 1  # prompt left
    assert burst_length(decoding, 0, SchedulerConfig(2, 8192, 1000)) == 1  # off by default
    assert burst_length(decoding, 0, SchedulerConfig(2, 8192, 8, num_decode_steps=8)) == 3  # model length 8


def test_abort_while_a_burst_is_in_flight(async_scheduling):
    """A request aborted while its burst runs: the burst's tokens for it are dropped, its blocks come back, the
    others keep exactly the fake model's tokens."""
    engine, executor = _burst_engine(200, 8192, 4, async_scheduling)
    engine.detokenizer = _RecordingDetokenizer()
    prompts = _prompts(5, seed=8, low=10, high=60)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20))
    done = {}
    while not any(step.num_steps > 1 for step in executor.steps):
        done.update((f.request.request_id, f.request) for f in engine.step())
    assert engine.abort("3") is not None
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        done.update((f.request.request_id, f.request) for f in engine.step())
    assert "3" not in done
    for i, prompt in enumerate(prompts):
        if i != 3:
            assert done[str(i)].output_token_ids == expected_continuation(prompt, 20), f"request {i}"
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_of_rows_pools_and_stops(seed, async_scheduling):
    """Rows that may burst beside rows that may not (seeded: single steps for every row while they run), arriving
    in waves, prefix caching on, pools from tight to roomy, stops on token values: every output is the fake model's
    continuation, and the pool ends empty."""
    rng = random.Random(seed)
    num_blocks = rng.choice([14, 30, 400])
    engine, _ = _burst_engine(num_blocks, rng.choice([16, 64, 8192]), rng.randint(2, 9),
                              async_scheduling, max_num_seqs=rng.choice([3, 8, 64]))
    engine.scheduler.kv_cache.pool.enable_caching = True
    stop_on_multiples_of_7(engine)
    shared = [rng.randrange(5, 900) for _ in range(40)]
    prompts = [shared[:rng.randint(0, 40)] + p for p in _prompts(16, seed=seed, low=1, high=60)]
    waves = [prompts[:6], prompts[6:11], prompts[11:]]
    limits = [rng.randint(1, 40) for _ in prompts]
    done, added = {}, 0
    for wave in waves:
        for prompt in wave:
            params = SamplingParams(max_tokens=limits[added], seed=1 if added % 8 == 3 else None)
            engine.add_request(str(added), prompt, params)
            added += 1
        for _ in range(rng.randint(0, 12)):
            done.update((f.request.request_id, f.request) for f in engine.step())
    done.update(_run(engine))
    for i, prompt in enumerate(prompts):
        tokens = done[str(i)].output_token_ids
        expected = expected_continuation(prompt, limits[i])
        stops = [j for j, token in enumerate(expected) if token % 7 == 0]
        assert tokens == expected[:stops[0] + 1 if stops else limits[i]], f"request {i}"
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    # The tightest pool may keep a row waiting (with a seat free) to the end: single steps throughout.
    assert engine.scheduler.stats.num_decode_bursts > 0 or num_blocks == 14


def test_bursts_run_while_the_waiting_rows_have_no_room(async_scheduling):
    """KV-aware admission keeps rows waiting, seats free, until a running row ends: bursts run meanwhile, each row
    ending admits the next at once, and the outputs are the fake model's."""
    engine, executor = _burst_engine(24, 8192, 4, async_scheduling)
    scheduler = engine.scheduler
    scheduler.config.admission_policy = "kv_aware"
    prompts = _prompts(10, seed=2, low=30, high=50)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12 + i, ignore_eos=True))
    waiting_during_bursts = []
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        if output.num_steps > 1:
            waiting_during_bursts.append(len(scheduler.waiting))
        return output

    scheduler.schedule = recording_schedule
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, 12 + i), f"request {i}"
    assert any(waiting_during_bursts), "no burst ran while rows waited for room"
    assert scheduler.stats.num_preemptions == 0
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.pool.num_blocks
