"""The hybrid KV cache (engine/hybrid_kv_cache_manager.py) with the host tier (engine/host_tier.py): swap preemption
keeps only the blocks each group holds, and the host level of the prefix cache serves a hybrid prefix hit.

The engine tests run the grouped fake executor of test_hybrid_kv_cache (its fake model reads each full group's whole
context and each window group's window back through that group's table) with a host pool: each step's offloads, then
its loads, are copied as the runner copies them. A window block swapped or loaded into the wrong entry, or a block a
window still sees left behind, changes the output, which is computed from the true token list. The block counts of
the other tests are worked out by hand from the windows.
"""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.host_tier import HOST_TIER
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from batchllm.engine.interfaces import ModelRunnerOutput, SchedulerOutput
from batchllm.engine.kv_groups import KVGroupLayout, plan_kv_groups
from batchllm.engine.request import Request
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.test_hybrid_kv_cache import BLOCK, HYBRID, WINDOW_ONLY, GroupedFakeExecutor, expected
from tests.unit.test_scheduler import _max_tokens_stop, _NoDetokenizer, _run


class TieredGroupedExecutor(GroupedFakeExecutor):
    def __init__(self, num_blocks: int, num_host_blocks: int, layout: KVGroupLayout) -> None:
        super().__init__(num_blocks, layout)
        self.host_slots: list[int | None] = [None] * (num_host_blocks * BLOCK)
        self.loaded = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        transfers = (so.kv_connector_metadata or {}).get(HOST_TIER)
        if transfers is not None:
            for device, host in transfers.offloads:
                self.host_slots[host * BLOCK : (host + 1) * BLOCK] = self.slots[device * BLOCK : (device + 1) * BLOCK]
            for host, device in transfers.loads:
                self.slots[device * BLOCK : (device + 1) * BLOCK] = self.host_slots[host * BLOCK : (host + 1) * BLOCK]
            self.loaded += len(transfers.loads)
        return super().execute_model(so)


def _engine(layer_windows, num_blocks: int, num_host_blocks: int, budget: int, caching: bool, mode: str = "swap"):
    layout = plan_kv_groups(layer_windows)
    kv = HybridKVCacheManager(num_blocks, BLOCK, layout, caching, num_host_blocks)
    config = SchedulerConfig(16, budget, kv.capacity_tokens, preemption_mode=mode, swap_min_tokens=1)
    executor = TieredGroupedExecutor(num_blocks, num_host_blocks, layout)
    return EngineCore(Scheduler(config, kv, _max_tokens_stop), executor, _NoDetokenizer(), False), kv, executor


def _rows(count: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 900) for _ in range(shared)]
    return [prefix + [rng.randrange(5, 900) for _ in range(rng.randint(8, 24))] for _ in range(count)]


def _assert_all_free(kv: HybridKVCacheManager) -> None:
    for name, pool in (("device", kv.pool), ("host", kv.host.pool)):
        assert pool.num_free_blocks == pool.num_blocks, f"{name} blocks leaked"
        assert all(block.ref_cnt == 0 for block in pool.blocks), f"a {name} block is still referenced"
    assert not kv.host._swapped and not kv._tables and not kv._loading


# Pools that preempt (the window-only model's requests hold at most 3 blocks each) yet hold the longest row, 50 tokens.
@pytest.mark.parametrize("layer_windows,num_blocks", [(HYBRID, 45), (WINDOW_ONLY, 14)], ids=["hybrid", "window-only"])
@pytest.mark.parametrize("caching", [False, True], ids=["uncached", "cached"])
def test_swapping_outputs_equal_the_fake_model_and_no_block_leaks(layer_windows, num_blocks, caching):
    engine, kv, executor = _engine(layer_windows, num_blocks, num_host_blocks=200, budget=8, caching=caching)
    rows = _rows(10, seed=3, shared=10) + _rows(10, seed=4)
    for i, row in enumerate(rows):
        engine.add_request(str(i), row, SamplingParams(max_tokens=16))
    done = _run(engine)
    for i, row in enumerate(rows):
        assert done[str(i)].output_token_ids == expected(row, 16, kv.layout.group_windows), i
    tier = kv.host.stats
    assert tier.swap_preemptions > 0 and tier.swapped_out_blocks == tier.swapped_in_blocks > 0, tier
    assert executor.loaded == tier.swapped_in_blocks + tier.loaded_blocks
    if caching:
        assert tier.spilled_blocks > 0
    _assert_all_free(kv)


def test_a_swapped_request_keeps_only_the_blocks_each_group_holds():
    kv = HybridKVCacheManager(100, BLOCK, plan_kv_groups(HYBRID), num_host_blocks=50)
    request = Request("a", list(range(5, 35)), SamplingParams(max_tokens=20))  # 30 tokens: blocks 0..7
    assert kv.allocate_slots(request, 30) is not None
    request.num_computed_tokens = 30
    assert kv.pool.num_used_blocks == 3 * 8
    assert kv.swap_out(request)
    # By hand: the full group keeps blocks 0..7; a query at 30 sees positions 25..30 (window 6), so each window group
    # keeps blocks 6 and 7 only: 8 + 2 + 2 blocks go to the host, not 24.
    assert kv.host.stats.swapped_out_blocks == 12 and kv.pool.num_used_blocks == 0
    offloads = kv.host.take_transfers().offloads
    assert len(offloads) == 12 and len({h for _, h in offloads}) == 12
    swapped_ids = [device for device, _ in offloads]
    # Interleaved: block j of each group that holds it, then j + 1 (the full group's ids are 0, 3, 6, ...).
    assert swapped_ids == [0, 3, 6, 9, 12, 15, 18, 19, 20, 21, 22, 23]
    # Back in with 2 new tokens (positions 30, 31: still block 7): fresh blocks for those 12 entries only.
    assert kv.allocate_held(request, kv.host, 30, 2)
    full, first_window, second_window = kv._tables["a"]
    assert all(block is not None for block in full) and len(full) == 8
    for table in (first_window, second_window):
        assert [j for j, block in enumerate(table) if block is not None] == [6, 7]
    loads = kv.host.take_transfers().loads
    host_of = {device: host for device, host in offloads}
    new_ids = [block.block_id for row in zip(full, first_window, second_window) for block in row if block is not None]
    assert [host for host, _ in loads] == [host_of[device] for device in swapped_ids]
    assert [device for _, device in loads] == new_ids
    assert kv.is_loading(request)
    kv.free(request)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def _cached_then_evicted():
    """Prompt `a` (40 tokens, 10 blocks) computed and freed, then every device block evicted by another prompt
    (48 tokens, 12 blocks in each of the 3 groups: the whole pool): a's 30 cached blocks are spilled to the host."""
    kv = HybridKVCacheManager(36, BLOCK, plan_kv_groups(HYBRID), enable_caching=True, num_host_blocks=100)
    first = Request("a", list(range(5, 45)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    assert kv.allocate_slots(first, 1) is not None  # the windows let blocks 0..7 go (cached, in the free queue)
    kv.free(first)
    other = Request("c", list(range(100, 148)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(other, 48) is not None
    assert kv.host.stats.spilled_blocks == 30 and len(kv.host.take_transfers().offloads) == 30
    kv.free(other)
    return kv, Request("b", list(range(5, 45)) + [1, 2, 3], SamplingParams(max_tokens=1))


def test_a_prefix_spilled_to_the_host_is_loaded_per_group():
    kv, second = _cached_then_evicted()
    hit = kv.find_cached_prefix(second)
    assert hit.num_blocks == 10
    # By hand: a query at 40 sees 35..40, blocks 8 and 9 of a window group. The full group's 10 blocks and the two
    # window groups' blocks 8, 9 come from the host: 14 loads, none of the window blocks 0..7.
    assert sorted((group, index) for group, index, _ in hit.host_loads) == (
        [(0, j) for j in range(10)] + [(1, 8), (1, 9), (2, 8), (2, 9)])
    assert kv.allocate_slots(second, 3, hit) is not None
    assert kv.is_loading(second)
    loads = kv.host.take_transfers().loads
    assert len(loads) == 14 and kv.host.stats.host_prefix_hits == 40
    tables = kv._tables["b"]
    loaded = {device for _, device in loads}
    assert all(tables[0][j].block_id in loaded for j in range(10))
    for table in tables[1:]:
        assert table[:8] == [None] * 8 and {table[8].block_id, table[9].block_id} <= loaded
    kv.free(second)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_host_hit_without_the_window_blocks_at_the_match_point_is_shorter():
    kv, second = _cached_then_evicted()
    kv.find_cached_prefix(second)  # fills the prompt's block hashes
    block = kv.host.pool.cached.pop(kv._key(1, second.block_hashes[9]))  # the host loses window group 1's block 9
    block.block_hash = None
    hit = kv.find_cached_prefix(second)
    # A hit of 10 blocks needs that block; one of 9 needs the window groups' blocks 7 and 8 (a query at 36 sees
    # 31..36), which the host has: every block of `a` was cached before its windows let any go.
    assert hit.num_blocks == 9
    assert sorted((group, index) for group, index, _ in hit.host_loads) == (
        [(0, j) for j in range(9)] + [(1, 7), (1, 8), (2, 7), (2, 8)])
