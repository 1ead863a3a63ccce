"""Prefix caching, forked samples and copy-on-write, checked with the fake executor (no torch).

The fake executor derives every token from the K/V it reads back through the block table, so a wrong
cache hit, a missed copy or a write into a shared block changes the output.
"""

from __future__ import annotations

import random

import pytest

from batchllm.engine.block_hash import extend_block_hashes, hash_block
from batchllm.engine.block_pool import BlockPool
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import expected_continuation
from tests.unit.test_scheduler import BLOCK, _engine, _run


def _shared_prefix_rows(count: int, prefix_len: int, suffix_len: int, num_prefixes: int, seed: int):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 900) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(5, 900) for _ in range(suffix_len)] for i in range(count)]


def test_hash_chain_depends_on_history_and_content():
    a = hash_block(None, [1, 2, 3])
    assert a == hash_block(None, [1, 2, 3])
    assert a != hash_block(None, [1, 2, 4])
    assert hash_block(a, [5, 6]) != hash_block(hash_block(None, [9, 9, 9]), [5, 6])  # same block, other prefix
    assert hash_block(None, [1, 2, 3], ("adapter-1",)) != a
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(40)), 16)
    assert len(hashes) == 2 and hashes[1] == hash_block(hashes[0], list(range(16, 32)))


@pytest.mark.parametrize("num_blocks", [400, 24])
def test_caching_on_and_off_give_identical_outputs(num_blocks, async_scheduling):
    rows = _shared_prefix_rows(30, prefix_len=70, suffix_len=20, num_prefixes=3, seed=1)
    results = {}
    for caching in (False, True):
        engine, _ = _engine(num_blocks, budget=128, enable_caching=caching, async_scheduling=async_scheduling)
        for i, row in enumerate(rows):
            engine.add_request(str(i), row, SamplingParams(max_tokens=10))
        done = _run(engine)
        results[caching] = [done[str(i)].output_token_ids for i in range(len(rows))]
        pool = engine.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
        assert all(pool.cached[b.block_hash] is b for b in pool.blocks if b.block_hash is not None)
        stats = engine.scheduler.kv_cache.stats
        if caching:
            assert stats.hits > 0
            if num_blocks == 24:
                assert pool.num_evictions > 0, "the small pool was meant to force eviction"
        else:
            assert stats.hits == 0 and not pool.cached
    assert results[True] == results[False]
    assert results[True] == [expected_continuation(row, 10) for row in rows]


def test_hit_rate_on_shared_prefix_matches_the_arithmetic():
    # 20 rows, one 64-token system prompt (4 full blocks) + 8 unique tokens. The first row misses; every
    # later row hits the 4 prefix blocks: hits = 19 * 64 of 20 * 72 query tokens.
    rows = _shared_prefix_rows(20, prefix_len=64, suffix_len=8, num_prefixes=1, seed=2)
    engine, _ = _engine(200, budget=4096, enable_caching=True)
    for i, row in enumerate(rows):
        engine.add_request(str(i), row, SamplingParams(max_tokens=2))
    _run(engine)
    stats = engine.scheduler.kv_cache.stats
    assert stats.queries == 20 * 72 and stats.hits == 19 * 64
    assert engine.scheduler.stats.num_prefill_tokens == 72 + 19 * 8


def test_last_prompt_token_is_always_recomputed():
    prompt = list(range(5, 5 + 3 * BLOCK))  # exactly three full blocks
    engine, executor = _engine(50, budget=4096, enable_caching=True)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    _run(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=3))
    done = _run(engine)
    first_b = next(r for step in executor.steps for r in step.requests if r.request_id == "b")
    assert first_b.num_computed_tokens == 2 * BLOCK  # the third block holds the last token: recomputed
    assert done["b"].output_token_ids == expected_continuation(prompt, 3)


def test_freed_cached_blocks_are_evicted_lru_suffix_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    for i, block in enumerate(blocks):
        pool.cache(block, bytes([i]))
    pool.free(blocks[::-1])  # a request frees its tail first
    assert [b.block_id for b in pool.free_queue] == [2, 3, 1, 0]
    pool.allocate(3)  # takes 2, 3, then evicts block 1 (the suffix) and keeps the prefix block 0
    assert pool.lookup(bytes([1])) is None and pool.lookup(bytes([0])) is blocks[0]
    assert pool.num_evictions == 1


@pytest.mark.parametrize("prompt_len", [40, 48])  # partial last block, and an exactly full last block
def test_n_samples_share_prompt_blocks_with_copy_on_write(prompt_len, async_scheduling):
    prompt = list(range(7, 7 + prompt_len))
    n = 4
    engine, executor = _engine(100, budget=4096, enable_caching=False, async_scheduling=async_scheduling)
    engine.add_request("p.0", prompt, SamplingParams(max_tokens=5))
    for j in range(1, n):
        engine.add_request(f"p.{j}", prompt, SamplingParams(max_tokens=5), fork_of="p.0")
    done = _run(engine)
    for j in range(n):
        assert done[f"p.{j}"].output_token_ids == expected_continuation(prompt, 5)
    kv = engine.scheduler.kv_cache
    prompt_blocks = -(-prompt_len // BLOCK)
    assert kv.stats.shared_blocks == (n - 1) * prompt_blocks
    # Each writer of the shared last block but the last one copies it: n - 1 copies.
    assert kv.stats.cow_copies == n - 1
    # Prompt K/V computed once (plus one recomputed last token per extra sample), never n times.
    assert engine.scheduler.stats.num_prefill_tokens == prompt_len + (n - 1)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert sum(len(s.block_copies) for s in executor.steps) == n - 1


def test_forked_samples_survive_preemption(async_scheduling):
    prompt = list(range(7, 7 + 40))
    # 144 tokens: the samples cannot all grow.
    engine, _ = _engine(9, budget=64, enable_caching=True, async_scheduling=async_scheduling)
    engine.add_request("p.0", prompt, SamplingParams(max_tokens=30))
    for j in range(1, 4):
        engine.add_request(f"p.{j}", prompt, SamplingParams(max_tokens=30), fork_of="p.0")
    done = _run(engine)
    assert all(done[f"p.{j}"].output_token_ids == expected_continuation(prompt, 30) for j in range(4))
    assert engine.scheduler.stats.num_preemptions > 0
    pool = engine.scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
