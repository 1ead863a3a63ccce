"""The hybrid KV cache (engine/kv_groups.py, engine/hybrid_kv_cache_manager.py), checked with a fake executor (no
torch) whose fake model reads every full-attention group's whole context and each window group's window back
through that group's block table.

So a window block freed while a query still sees it, then handed to another request, a stale or missing table
entry, or a prefix hit on a window block that no longer holds its tokens, changes the output; the expected
output is computed from the true token list.
"""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from batchllm.engine.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from batchllm.engine.kv_groups import KVGroupLayout, plan_kv_groups
from batchllm.engine.request import Request
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.test_scheduler import _max_tokens_stop, _NoDetokenizer, _run

BLOCK = 4
WINDOW = 6
# Gemma-like: full layers 0 and 3, window layers between: groups (full, window, window) of two layers each.
HYBRID = [None, WINDOW, WINDOW, None, WINDOW, WINDOW]
WINDOW_ONLY = [WINDOW] * 3  # Mistral-like: one window group


def next_token(tokens: list[int], windows: tuple[int | None, ...]) -> int:
    """The fake model: full groups see the whole context, window groups the last `window` tokens."""
    total = 0
    for window in windows:
        seen = tokens if window is None else tokens[-window:]
        total += sum(t * (i + 1) for i, t in enumerate(seen))
    return total % 997 + 3


def expected(prompt: list[int], num_tokens: int, windows: tuple[int | None, ...]) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens, windows))
    return tokens[len(prompt):]


class GroupedFakeExecutor:
    """Writes each scheduled token into every group's slot for its position; samples from what it reads back."""

    def __init__(self, num_blocks: int, layout: KVGroupLayout) -> None:
        self.windows, self.groups = layout.group_windows, layout.num_groups
        self.slots: list[int | None] = [None] * (num_blocks * BLOCK)
        self.tables: dict[str, list[int]] = {}

    def _slot(self, table: list[int], group: int, position: int) -> int:
        return table[(position // BLOCK) * self.groups + group] * BLOCK + position % BLOCK

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in so.finished_request_ids:
            self.tables.pop(request_id, None)
        for src, dst in so.block_copies:
            self.slots[dst * BLOCK : (dst + 1) * BLOCK] = self.slots[src * BLOCK : (src + 1) * BLOCK]
        sampled = {}
        for r in so.requests:
            if r.full_block_table:
                self.tables[r.request_id] = list(r.block_ids)
            else:
                self.tables[r.request_id].extend(r.block_ids)
            table, end = self.tables[r.request_id], r.num_computed_tokens + r.num_tokens
            assert len(table) % self.groups == 0 and len(table) // self.groups * BLOCK >= end
            for offset, token in enumerate(r.token_ids):
                for group in range(self.groups):
                    self.slots[self._slot(table, group, r.num_computed_tokens + offset)] = token
            if r.sample:
                total = 0
                for group, window in enumerate(self.windows):
                    seen = [self.slots[self._slot(table, group, p)] for p in range(max(0, end - (window or end)), end)]
                    assert None not in seen, f"{r.request_id} read a slot no step wrote"
                    total += sum(t * (i + 1) for i, t in enumerate(seen))
                sampled[r.request_id] = SampledToken(total % 997 + 3)
        return ModelRunnerOutput(sampled)


def _engine(layer_windows, num_blocks: int, budget: int, caching: bool, max_num_seqs: int = 16):
    layout = plan_kv_groups(layer_windows)
    kv = HybridKVCacheManager(num_blocks, BLOCK, layout, caching)
    config = SchedulerConfig(max_num_seqs, budget, kv.capacity_tokens)
    engine = EngineCore(Scheduler(config, kv, _max_tokens_stop), GroupedFakeExecutor(num_blocks, layout),
                        _NoDetokenizer(), False)
    return engine, kv, layout


def _rows(count: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 900) for _ in range(shared)]
    return [prefix + [rng.randrange(5, 900) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def test_layout_groups_layers_of_one_window_in_equal_groups():
    layout = plan_kv_groups(HYBRID)
    assert layout.group_windows == (None, WINDOW, WINDOW) and layout.num_slots == 2
    assert layout.layer_group == (0, 1, 1, 0, 2, 2) and layout.layer_slot == (0, 0, 1, 1, 0, 1)
    assert plan_kv_groups([None] * 3) == KVGroupLayout((None,), (0, 0, 0), (0, 1, 2))


@pytest.mark.parametrize("layer_windows", [HYBRID, WINDOW_ONLY], ids=["hybrid", "window-only"])
@pytest.mark.parametrize("num_blocks,budget,caching", [(400, 64, False), (400, 64, True), (40, 8, True),
                                                        (36, 5, False)], ids=["ample", "cached", "tight", "tighter"])
def test_outputs_equal_the_fake_model_and_no_block_leaks(layer_windows, num_blocks, budget, caching):
    engine, kv, layout = _engine(layer_windows, num_blocks, budget, caching)
    rows = _rows(12, seed=num_blocks, shared=10) + _rows(12, seed=budget)
    for i, row in enumerate(rows):
        engine.add_request(str(i), row, SamplingParams(max_tokens=12))
    done = _run(engine)
    for i, row in enumerate(rows):
        assert done[str(i)].output_token_ids == expected(row, 12, layout.group_windows), i
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and all(block.ref_cnt == 0 for block in kv.pool.blocks)
    if budget == 5 and layer_windows is HYBRID:
        assert engine.scheduler.stats.num_preemptions > 0  # the recompute path ran
    if caching:
        assert kv.stats.hits > 0


def test_window_blocks_are_freed_as_the_window_slides():
    kv = HybridKVCacheManager(100, BLOCK, plan_kv_groups(HYBRID))
    request = Request("a", list(range(5, 35)), SamplingParams(max_tokens=20))  # 30 tokens: blocks 0..7
    assert kv.allocate_slots(request, 30) is not None
    request.num_computed_tokens = 30
    for position in range(30, 45):
        kv.allocate_slots(request, 1)
        full, *windows = kv._tables["a"]
        assert all(block is not None for block in full)  # a full group keeps every block
        # A window group holds exactly the blocks with a position a query at `position` sees: k > position - 6.
        seen = {p // BLOCK for p in range(position - WINDOW + 1, position + 1)}
        for table in windows:
            assert {j for j, block in enumerate(table) if block is not None} == seen, position
        held = len(full) + sum(1 for table in windows for block in table if block is not None)
        assert kv.pool.num_used_blocks == held
        request.num_computed_tokens += 1
    kv.free(request)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_prefix_hit_needs_the_window_blocks_at_the_match_point():
    kv = HybridKVCacheManager(100, BLOCK, plan_kv_groups(HYBRID), enable_caching=True)
    first = Request("a", list(range(5, 45)), SamplingParams(max_tokens=1))  # 40 tokens, 10 blocks
    assert kv.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    kv.allocate_slots(first, 1)  # the next step: the windows let blocks 0..7 go (still cached in the pool)
    second = Request("b", list(range(5, 45)) + [1, 2, 3], SamplingParams(max_tokens=1))
    hit = kv.find_cached_prefix(second)
    assert hit.num_blocks == 10  # every full block, and each window group's blocks 8, 9 (positions 34..39)
    # Evict a window group's block 9 (its hash dropped): the hit must end where that window is whole again.
    block = kv._tables["a"][1][9]
    kv.free(first)
    del kv.pool.cached[block.block_hash]
    block.block_hash = None
    hit = kv.find_cached_prefix(second)
    assert hit.num_blocks < 10
    for group, table in enumerate(hit.tables):
        first_seen = 0 if group == 0 else max(0, hit.num_blocks * BLOCK - WINDOW + 1) // BLOCK
        assert all(b is not None for b in table[first_seen:]) and len(table) == hit.num_blocks
        assert all(b.block_hash is not None for b in table[first_seen:])
