"""Aborting requests (`EngineCore.abort` / `Scheduler.abort_request`) with the fake executor: the aborted request
disappears wherever it was (waiting, running, preempted, in a step still in flight), its blocks come back, the
runner is told, and every other request still produces exactly the fake model's tokens."""

from __future__ import annotations

import pytest

import batchllm.engine.structured.llguidance_backend as grammar_module
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.structured.manager import StructuredOutputManager
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams
from tests.unit.fake_executor import expected_continuation
from tests.unit.test_scheduler import _engine, _prompts, _run
from tests.unit.test_structured_engine import _FakeCompiler, _fill_bitmasks


class _RecordingDetokenizer:
    def __init__(self) -> None:
        self.released: list[str] = []

    def finish(self, request: Request) -> str:
        return ""

    def release(self, request_ids) -> None:
        self.released.extend(request_ids)


def _engine_with(num_blocks: int, budget: int, async_scheduling: bool, enable_caching: bool = False):
    engine, executor = _engine(num_blocks, budget, async_scheduling=async_scheduling, enable_caching=enable_caching)
    engine.detokenizer = _RecordingDetokenizer()
    return engine, executor


def _assert_pool_empty(engine: EngineCore) -> None:
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_used_blocks == 0, "blocks leaked"
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def _add(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens))


def _check_others(done: dict[str, Request], prompts: list[list[int]], max_tokens: int, aborted: set[str]) -> None:
    assert not aborted & set(done), "an aborted request was reported as finished"
    for i, prompt in enumerate(prompts):
        if str(i) not in aborted:
            assert done[str(i)].output_token_ids == expected_continuation(prompt, max_tokens), f"request {i}"


def test_abort_while_waiting(async_scheduling):
    engine, executor = _engine_with(200, 8192, async_scheduling)
    prompts = _prompts(4, seed=1)
    _add(engine, prompts, 8)
    aborted = engine.abort("2")
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert aborted.finish_reason == "abort"
    assert engine.detokenizer.released == ["2"]
    done = _run(engine)
    _check_others(done, prompts, 8, {"2"})
    assert not any(r.request_id == "2" for step in executor.steps for r in step.requests), "it was scheduled"
    _assert_pool_empty(engine)


def test_abort_while_running_frees_its_blocks_at_once(async_scheduling):
    engine, executor = _engine_with(200, 8192, async_scheduling)
    prompts = _prompts(5, seed=2, low=40, high=90)
    _add(engine, prompts, 30)
    for _ in range(4):
        engine.step()
    victim = engine.scheduler.requests["1"]
    assert victim.status is RequestStatus.RUNNING and victim.num_output_tokens > 0
    used = engine.scheduler.kv_cache.pool.num_used_blocks
    owned = len(engine.scheduler.kv_cache.block_ids(victim))
    assert engine.abort("1") is victim
    assert engine.scheduler.kv_cache.pool.num_used_blocks == used - owned
    assert victim not in engine.scheduler.running and "1" not in engine.scheduler.requests
    done = _run(engine)
    _check_others(done, prompts, 30, {"1"})
    assert "1" not in executor.block_tables, "the runner was not told to drop the aborted request"
    _assert_pool_empty(engine)


def test_abort_while_its_step_is_in_flight():
    """Asynchronous loop: the step launched last holds the request; its sampled token must be dropped."""
    engine, executor = _engine_with(200, 8192, async_scheduling=True)
    prompts = _prompts(3, seed=3, low=20, high=40)
    _add(engine, prompts, 12)
    engine.step()
    engine.step()
    assert len(engine._in_flight) == 1
    assert any(r.request_id == "0" for r in engine._in_flight[0][0].requests), "the request is not in flight"
    engine.abort("0")
    done = _run(engine)
    _check_others(done, prompts, 12, {"0"})
    assert "0" not in executor.block_tables
    _assert_pool_empty(engine)


def test_abort_a_preempted_request(async_scheduling):
    engine, _ = _engine_with(12, 16, async_scheduling)
    prompts = _prompts(6, seed=4, low=20, high=60)
    _add(engine, prompts, 20)
    preempted = None
    for _ in range(2000):
        engine.step()
        preempted = next((r for r in engine.scheduler.waiting if r.status is RequestStatus.PREEMPTED), None)
        if preempted is not None:
            break
    assert preempted is not None, "the small pool was meant to force preemption"
    engine.abort(preempted.request_id)
    assert preempted not in engine.scheduler.waiting
    done = _run(engine)
    _check_others(done, prompts, 20, {preempted.request_id})
    _assert_pool_empty(engine)


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])
def test_forked_sample_survives_its_aborted_parent(steps_before_abort, async_scheduling):
    """0 steps: the child has not forked yet; 1: it waits for the parent's prompt; 3: it shares its blocks."""
    engine, _ = _engine_with(200, 8192, async_scheduling, enable_caching=True)
    prompt = _prompts(1, seed=5, low=50, high=50)[0]
    engine.add_request("p.0", prompt, SamplingParams(max_tokens=10))
    engine.add_request("p.1", prompt, SamplingParams(max_tokens=10), fork_of="p.0")
    for _ in range(steps_before_abort):
        engine.step()
    engine.abort("p.0")
    done = _run(engine)
    assert set(done) == {"p.1"}
    assert done["p.1"].output_token_ids == expected_continuation(prompt, 10)
    _assert_pool_empty(engine)  # cached blocks sit in the free queue: they count as free


def test_abort_of_unknown_or_finished_ids_is_a_no_op(async_scheduling):
    engine, _ = _engine_with(100, 8192, async_scheduling)
    prompts = _prompts(2, seed=6)
    _add(engine, prompts, 4)
    assert engine.abort("nope") is None
    done = _run(engine)
    assert engine.abort("0") is None
    _check_others(done, prompts, 4, set())
    assert engine.detokenizer.released == []


def test_abort_of_a_rejected_request_before_it_is_reported():
    engine, _ = _engine_with(10, 8192, async_scheduling=False)
    engine.add_request("long", list(range(5, 5 + 10 * 16)), SamplingParams(max_tokens=4))  # over max_model_len
    assert engine.abort("long") is not None
    assert engine.step() == [] and not engine.has_unfinished()


def test_abort_releases_the_grammar_matcher(async_scheduling, monkeypatch):
    monkeypatch.setattr(grammar_module, "fill_bitmasks", _fill_bitmasks)
    engine, _ = _engine_with(200, 8192, async_scheduling)
    engine.structured = StructuredOutputManager(None, 1000, [2])
    engine.structured._compiler = _FakeCompiler()
    prompts = _prompts(3, seed=7, low=10, high=30)
    for i, prompt in enumerate(prompts):
        constraint = StructuredOutputsParams(regex="50") if i == 1 else None
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, structured_outputs=constraint))
    engine.step()
    engine.step()
    assert engine.structured.num_active == 1
    aborted = engine.abort("1")
    assert engine.structured.num_active == 0
    assert aborted.error is None, "an aborted request gets no 'incomplete' note"
    done = _run(engine)
    _check_others(done, prompts, 8, {"1"})
    _assert_pool_empty(engine)
