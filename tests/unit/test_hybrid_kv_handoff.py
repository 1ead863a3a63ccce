"""Disaggregated prefill / decode with the hybrid KV cache (engine/kv_handoff.py's hybrid managers): the prefill
engine hands over only the blocks each group holds, and the decode engine continues from them.

Two grouped fake executors (test_hybrid_kv_cache's: the fake model reads each full group's whole context and each
window group's window back through that group's table) share a slot array standing in for the buffer; a slot is
cleared once loaded, so a stale reuse shows. A window block missing from the handoff, or loaded into another group's
entry, changes the decode engine's tokens, which are computed from the true token list.
"""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.block_pool import BlockPool
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.interfaces import ModelRunnerOutput, ReadyOutput, SchedulerOutput
from batchllm.engine.kv_groups import KVGroupLayout, plan_kv_groups
from batchllm.engine.kv_handoff import KV_LINK, HybridDecodeKVCacheManager, HybridPrefillKVCacheManager
from batchllm.engine.prefill_decode_core import DisaggregatedEngineCore
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.test_abort import _RecordingDetokenizer
from tests.unit.test_hybrid_kv_cache import BLOCK, HYBRID, WINDOW, WINDOW_ONLY, GroupedFakeExecutor, expected
from tests.unit.test_scheduler import _max_tokens_stop, _run


class LinkedGroupedExecutor(GroupedFakeExecutor):
    def __init__(self, num_blocks: int, layout: KVGroupLayout, link_slots: list, role: str) -> None:
        super().__init__(num_blocks, layout)
        self.link_slots, self.role = link_slots, role
        self.copies = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        link = (so.kv_connector_metadata or {}).get(KV_LINK)
        if link is not None:
            assert not (link.offloads if self.role == "decode" else link.loads), "a copy in the wrong direction"
            for device, slot in link.offloads:
                self.link_slots[slot * BLOCK : (slot + 1) * BLOCK] = self.slots[device * BLOCK : (device + 1) * BLOCK]
            for slot, device in link.loads:
                self.slots[device * BLOCK : (device + 1) * BLOCK] = self.link_slots[slot * BLOCK : (slot + 1) * BLOCK]
                self.link_slots[slot * BLOCK : (slot + 1) * BLOCK] = [None] * BLOCK
            self.copies += len(link.offloads) + len(link.loads)
        return super().execute_model(so)

    def execute_model_async(self, so: SchedulerOutput) -> ReadyOutput:
        return ReadyOutput(self.execute_model(so))


def _engine(layer_windows, num_blocks: int = 120, buffer_blocks: int = 40, budget: int = 32):
    layout = plan_kv_groups(layer_windows)
    slots: list = [None] * (buffer_blocks * BLOCK)
    link = BlockPool(buffer_blocks)
    prefill_kv = HybridPrefillKVCacheManager(num_blocks, BLOCK, layout, True, link)
    decode_kv = HybridDecodeKVCacheManager(num_blocks, BLOCK, layout, True, link)
    prefill_exec = LinkedGroupedExecutor(num_blocks, layout, slots, "prefill")
    decode_exec = LinkedGroupedExecutor(num_blocks, layout, slots, "decode")
    config = SchedulerConfig(8, budget, prefill_kv.capacity_tokens)
    prefill = EngineCore(Scheduler(config, prefill_kv, _max_tokens_stop), prefill_exec, _RecordingDetokenizer(),
                         async_scheduling=True)
    decode = EngineCore(Scheduler(SchedulerConfig(8, budget, config.max_model_len), decode_kv, _max_tokens_stop),
                        decode_exec, _RecordingDetokenizer(), async_scheduling=False)
    return DisaggregatedEngineCore(prefill, decode), prefill_exec, decode_exec


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 900) for _ in range(20)]
    return [shared[: rng.choice([0, 8, 20])] + [rng.randrange(5, 900) for _ in range(rng.randint(2, 30))]
            for _ in range(count)]


@pytest.mark.parametrize("layer_windows", [HYBRID, WINDOW_ONLY], ids=["hybrid", "window-only"])
def test_the_decode_engine_continues_from_each_groups_held_blocks(layer_windows):
    engine, prefill_exec, decode_exec = _engine(layer_windows)
    layout = engine.prefill_kv.layout
    prompts = _prompts(16, seed=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=10))
    done = _run(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].output_token_ids == expected(prompt, 10, layout.group_windows), i
    # By hand: a prompt of n tokens hands over its first n - 1 tokens' blocks: ceil((n - 1) / 4) of a full group,
    # and of a window group those from the block of position n - 1 - 6 + 1 on (what a query at n - 1 sees).
    def held(n: int) -> int:
        count = -(-(n - 1) // BLOCK)
        return sum(count - (0 if window is None else max(0, n - 1 - WINDOW + 1) // BLOCK)
                   for window in layout.group_windows)
    stats = engine.decode_kv.handoff
    assert stats.requests == len(prompts) and stats.recomputed == 0
    assert stats.blocks == sum(held(len(p)) for p in prompts) == prefill_exec.copies == decode_exec.copies
    assert stats.blocks < len(layout.group_windows) * sum(-(-(len(p) - 1) // BLOCK) for p in prompts)
    for _ in range(4):  # the decode engine frees a load's slots a few steps after it
        engine.step()
    for name, kv in (("prefill", engine.prefill_kv), ("decode", engine.decode_kv)):
        assert kv.pool.num_free_blocks == kv.pool.num_blocks, f"{name} blocks leaked"
    assert engine.prefill_kv.link.num_free_blocks == engine.prefill_kv.link.num_blocks, "buffer slots leaked"
