"""Block pool and free-queue invariants."""

from __future__ import annotations

import random

import pytest

from batchllm.engine.block_pool import BlockPool
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.request import Request
from batchllm.sampling_params import SamplingParams


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(6)
    assert _ids(pool.allocate(3)) == [0, 1, 2]
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 3


def test_freed_blocks_are_reused_last_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    pool.free(a[::-1])  # freed in order 1, 0: they join the tail behind 2, 3
    assert _ids(pool.free_queue) == [2, 3, 1, 0]
    assert _ids(pool.allocate(4)) == [2, 3, 1, 0]


def test_remove_from_middle_is_constant_time_and_consistent():
    pool = BlockPool(5)
    pool.free_queue.remove(pool.blocks[2])
    assert _ids(pool.free_queue) == [0, 1, 3, 4] and pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.free_queue.remove(pool.blocks[2])


def test_first_out_frees_join_the_head_the_last_freed_first():
    pool = BlockPool(5)
    blocks = pool.allocate(3)  # 0, 1, 2; free queue [3, 4]
    pool.free(blocks, first_out=True)
    assert _ids(pool.free_queue) == [2, 1, 0, 3, 4]


def test_free_uncached_count_matches_the_free_queue_under_random_operations():
    """`num_free_uncached` (free blocks whose allocation evicts nothing) against a count of the free queue."""
    rng = random.Random(0)
    pool = BlockPool(12, enable_caching=True)
    owned: list = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            owned += pool.allocate(rng.randint(1, pool.num_free_blocks))
        elif op < 0.6 and owned:
            block = rng.choice(owned)
            pool.cache(block, bytes([rng.randrange(40)]))
        elif op < 0.7 and pool.cached:
            hit = rng.choice(list(pool.cached.values()))
            pool.touch([hit])
            owned.append(hit)
        elif owned:
            rng.shuffle(owned)
            count = rng.randint(1, len(owned))
            pool.free(owned[:count], first_out=rng.random() < 0.5)
            owned = owned[count:]
        expected = sum(1 for block in pool.free_queue if block.block_hash is None)
        assert pool.num_free_uncached == expected, step


def test_ref_counts_never_negative():
    pool = BlockPool(2)
    block = pool.allocate(1)
    pool.free(block)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(block)
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_shared_block_returns_to_queue_only_at_zero():
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    block.ref_cnt += 1  # a second owner
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([block])
    assert pool.num_free_blocks == 3


def test_over_allocation_raises_without_side_effects():
    pool = BlockPool(3)
    with pytest.raises(RuntimeError):
        pool.allocate(4)
    assert pool.num_free_blocks == 3


def test_kv_manager_allocates_on_demand_and_frees_everything():
    manager = KVCacheManager(num_blocks=10, block_size=16)
    rng = random.Random(0)
    requests = [Request(str(i), list(range(rng.randint(1, 40))), SamplingParams()) for i in range(4)]
    for r in requests:
        assert manager.allocate_slots(r, r.num_tokens) is not None
        assert len(manager.block_ids(r)) == -(-r.num_tokens // 16)
        r.num_computed_tokens = r.num_tokens
    grow = requests[0]
    before = len(manager.block_ids(grow))
    needed = 16 * before - grow.num_tokens + 1  # one token past the last block's end
    assert len(manager.allocate_slots(grow, needed).new_block_ids) == 1
    assert manager.allocate_slots(grow, 10_000) is None  # too big: nothing changes
    assert len(manager.block_ids(grow)) == before + 1
    for r in requests:
        manager.free(r)
    assert manager.pool.num_free_blocks == 10
    assert manager.peak_used_blocks <= 10
