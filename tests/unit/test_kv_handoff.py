"""Disaggregated prefill / decode through the real engine loop (engine/prefill_decode_core.py) and KV managers
(engine/kv_handoff.py), with two fake executors (no torch) that share a slot array standing in for the buffer.

The fake model derives every token from the context it reads back through the block table (fake_executor.py), so
a prompt whose K/V did not arrive, arrived in the wrong blocks or was overwritten before it was read gives wrong
tokens: the decode engine reads the prompt's first tokens only from what the prefill engine computed.
"""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.block_pool import BlockPool
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.interfaces import ModelRunnerOutput, SchedulerOutput
from batchllm.engine.kv_handoff import KV_LINK, DecodeKVCacheManager, PrefillKVCacheManager
from batchllm.engine.prefill_decode_core import DisaggregatedEngineCore
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import FakeExecutor, expected_continuation
from tests.unit.test_abort import _RecordingDetokenizer
from tests.unit.test_scheduler import BLOCK, _max_tokens_stop, _run


class LinkedFakeExecutor(FakeExecutor):
    """Runs a step's link copies (offloads into the shared slots, loads out of them) before the step."""

    def __init__(self, num_blocks: int, slots: list, budget: int, role: str) -> None:
        super().__init__(num_blocks, BLOCK, budget)
        self.link_slots, self.role = slots, role
        self.sent: list[tuple[int, int]] = []
        self.received: list[tuple[int, int]] = []

    def _execute(self, so: SchedulerOutput, grammar) -> ModelRunnerOutput:
        link = (so.kv_connector_metadata or {}).get(KV_LINK)
        if link is not None:
            assert not (link.offloads if self.role == "decode" else link.loads), "a copy in the wrong direction"
            for device, slot in link.offloads:
                self.link_slots[slot * BLOCK:(slot + 1) * BLOCK] = self.slots[device * BLOCK:(device + 1) * BLOCK]
            for slot, device in link.loads:
                self.slots[device * BLOCK:(device + 1) * BLOCK] = self.link_slots[slot * BLOCK:(slot + 1) * BLOCK]
                self.link_slots[slot * BLOCK:(slot + 1) * BLOCK] = [None] * BLOCK  # read once: a stale reuse shows
            self.sent += link.offloads
            self.received += link.loads
        return super()._execute(so, grammar)


def _engine(prefill_blocks: int = 64, decode_blocks: int = 64, buffer_blocks: int = 32, budget: int = 64,
            max_num_seqs: int = 8, caching: bool = True, async_decode: bool = True):
    slots: list = [None] * (buffer_blocks * BLOCK)
    link = BlockPool(buffer_blocks)
    prefill_kv = PrefillKVCacheManager(prefill_blocks, BLOCK, caching, link)
    decode_kv = DecodeKVCacheManager(decode_blocks, BLOCK, caching, link)
    prefill_exec = LinkedFakeExecutor(prefill_blocks, slots, budget, "prefill")
    decode_exec = LinkedFakeExecutor(decode_blocks, slots, budget, "decode")
    config = SchedulerConfig(max_num_seqs, budget, min(prefill_blocks, decode_blocks) * BLOCK)
    prefill = EngineCore(Scheduler(config, prefill_kv, _max_tokens_stop), prefill_exec, _RecordingDetokenizer(),
                         async_scheduling=True)
    decode = EngineCore(Scheduler(SchedulerConfig(max_num_seqs, budget, config.max_model_len), decode_kv,
                                  _max_tokens_stop), decode_exec, _RecordingDetokenizer(),
                        async_scheduling=async_decode)
    return DisaggregatedEngineCore(prefill, decode), prefill_exec, decode_exec


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 900) for _ in range(40)]
    return [shared[: rng.choice([0, 16, 40])] + [rng.randrange(5, 900) for _ in range(rng.randint(1, 50))]
            for _ in range(count)]


def _assert_nothing_held(engine: DisaggregatedEngineCore) -> None:
    for _ in range(4):  # the decode engine frees a load's slots a few steps after it
        engine.step()
    for name, kv in (("prefill", engine.prefill_kv), ("decode", engine.decode_kv)):
        assert kv.pool.num_free_blocks == kv.pool.num_blocks, f"{name} blocks leaked"
    assert engine.prefill_kv.link.num_free_blocks == engine.prefill_kv.link.num_blocks, "buffer slots leaked"


@pytest.mark.parametrize("async_decode", [False, True], ids=["sync-decode", "async-decode"])
def test_the_decode_engine_continues_from_the_prefill_engines_kv(async_decode):
    engine, prefill_exec, decode_exec = _engine(async_decode=async_decode)
    prompts = _prompts(20, seed=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12))
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, 12), i
    stats = engine.decode_kv.handoff
    assert stats.requests == sum(len(p) > 1 for p in prompts) and stats.recomputed == 0
    assert stats.blocks == len(prefill_exec.sent) == len(decode_exec.received) > 0
    # The decode engine computed each prompt's last token, and nothing else of it.
    decode_prefill = engine.decode.scheduler.stats.num_prefill_tokens
    assert decode_prefill == len(prompts), decode_prefill
    assert engine.prefill.scheduler.kv_cache.stats.hits > 0, "the shared prefixes never hit the prefill cache"
    _assert_nothing_held(engine)


def test_prompts_wait_for_slots_and_one_larger_than_the_buffer_is_computed_by_the_decode_engine():
    engine, _, _ = _engine(buffer_blocks=3)  # prompts of 1-90 tokens: up to 6 blocks
    prompts = _prompts(12, seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8))
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, 8), i
    assert engine.decode_kv.handoff.recomputed > 0 and engine.decode_kv.handoff.requests > 0
    _assert_nothing_held(engine)


def test_preemption_in_the_decode_engine():
    # 12 decode blocks for 8 rows growing to 3-6 blocks each: rows are preempted and recomputed there.
    engine, _, _ = _engine(decode_blocks=12, max_num_seqs=8)
    prompts = _prompts(16, seed=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=30))
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_token_ids == expected_continuation(prompt, 30), i
    assert engine.decode.scheduler.stats.num_preemptions > 0
    _assert_nothing_held(engine)


@pytest.mark.parametrize("when", range(8))
def test_abort_at_any_point_of_the_handoff(when):
    engine, _, _ = _engine()
    prompts = _prompts(6, seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=10))
    for _ in range(when):
        engine.step()
    aborted = engine.abort("2")
    assert aborted is None or aborted.status.finished
    done = _run(engine)
    assert "2" not in done or done["2"] is aborted
    for i, prompt in enumerate(prompts):
        if i != 2:
            assert done[str(i)].output_token_ids == expected_continuation(prompt, 10), i
    _assert_nothing_held(engine)
