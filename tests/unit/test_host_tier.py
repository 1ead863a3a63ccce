"""The host tier behind the device KV pool (engine/host_tier.py): swap preemption and the host level of the prefix
cache, checked through the Scheduler with a fake executor (no torch, milliseconds).

The fake executor below keeps a second slot array for the host pool and performs each step's transfers the way
the runner does (every offload, then every load, then the forward pass). Its fake model derives every token from
the context it reads back through the block table, so a missing, misdirected or mis-ordered copy changes the output
and fails the comparison with `expected_continuation`. The block ids the tests expect are worked out by hand from
the pools' LRU order: fresh pools hand out blocks 0, 1, 2, ...; a request frees its blocks tail first.
"""

from __future__ import annotations

import random

import pytest

from batchllm.config import SchedulerConfig
from batchllm.engine.block_hash import hash_block
from batchllm.engine.engine_core import EngineCore
from batchllm.engine.host_tier import HOST_TIER
from batchllm.engine.interfaces import BlockTransfers, GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.engine.request import Request, RequestStatus
from batchllm.engine.scheduler import Scheduler
from batchllm.sampling_params import SamplingParams
from tests.unit.fake_executor import FakeExecutor, expected_continuation
from tests.unit.test_scheduler import BLOCK, _max_tokens_stop, _NoDetokenizer, _run


def _transfers(so: SchedulerOutput) -> BlockTransfers | None:
    """The host tier's copies for the step (its connector metadata)."""
    return (so.kv_connector_metadata or {}).get(HOST_TIER)


def _swapped(kv: KVCacheManager, request: Request) -> bool:
    return request.request_id in kv.host._swapped


class TieredFakeExecutor(FakeExecutor):
    """The fake executor with a host pool: it copies slots as the host tier's metadata says, before the step,
    and checks that each step's copies are well formed."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, budget: int) -> None:
        super().__init__(num_blocks, block_size, budget)
        self.host_slots: list[int | None] = [None] * (num_host_blocks * block_size)
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        # Host blocks a step both wrote (offload) and read (load): legal only for the same contents (host_tier.py:
        # a prefix spilled and found again within one step), since the offloads run first.
        self.written_and_read: list[set[int]] = []

    def _execute(self, so: SchedulerOutput, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        transfers = _transfers(so)
        if transfers is not None:
            assert transfers.offloads or transfers.loads, "an empty BlockTransfers: None was expected"
            offload_src = [d for d, _ in transfers.offloads]
            offload_dst = [h for _, h in transfers.offloads]
            load_src = [h for h, _ in transfers.loads]
            load_dst = [d for _, d in transfers.loads]
            assert all(0 <= d < self.num_blocks for d in offload_src + load_dst)
            assert all(0 <= h < self.num_host_blocks for h in offload_dst + load_src)
            assert len(set(offload_dst)) == len(offload_dst), f"a host block written twice in one step: {offload_dst}"
            assert len(set(load_dst)) == len(load_dst), f"a device block loaded twice in one step: {load_dst}"
            assert len(set(offload_src)) == len(offload_src), f"a device block offloaded twice: {offload_src}"
            self.written_and_read.append(set(offload_dst) & set(load_src))
            size = self.block_size
            for device, host in transfers.offloads:
                self.host_slots[host * size : (host + 1) * size] = self.slots[device * size : (device + 1) * size]
            for host, device in transfers.loads:
                self.slots[device * size : (device + 1) * size] = self.host_slots[host * size : (host + 1) * size]
        return super()._execute(so, grammar)


def _engine(num_blocks: int, num_host_blocks: int, *, mode: str = "swap", caching: bool = False,
            budget: int = 8192, max_num_seqs: int = 64, async_scheduling: bool = False):
    kv = KVCacheManager(num_blocks, BLOCK, caching, num_host_blocks)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=num_blocks * BLOCK, preemption_mode=mode)
    scheduler = Scheduler(config, kv, _max_tokens_stop)
    executor = TieredFakeExecutor(num_blocks, num_host_blocks, BLOCK, budget)
    return EngineCore(scheduler, executor, _NoDetokenizer(), async_scheduling), executor


def _tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 900) for _ in range(count)]


def _assert_all_free(engine: EngineCore) -> None:
    kv = engine.scheduler.kv_cache
    for name, pool in (("device", kv.pool), ("host", kv.host.pool)):
        assert pool.num_free_blocks == pool.num_blocks, f"{name} blocks leaked"
        assert all(block.ref_cnt == 0 for block in pool.blocks), f"{name} block still referenced"
        assert all(pool.cached[b.block_hash] is b for b in pool.blocks if b.block_hash is not None)
    assert not kv.host._swapped, "a swapped-out request's host blocks are still recorded"
    assert not kv._blocks


def _step(engine: EngineCore, executor: TieredFakeExecutor) -> SchedulerOutput:
    """One synchronous step; returns what the runner was handed."""
    count = len(executor.steps)
    engine.step()
    assert len(executor.steps) == count + 1
    return executor.steps[-1]


def _loads_then_schedule(engine: EngineCore, executor: TieredFakeExecutor, request_id: str):
    """Step until `request_id` is scheduled; returns (the one step whose loads bring its K/V back, its first
    ScheduledRequest). It may compute in the loading step, or in the next one while the copies land."""
    load_steps = []
    for _ in range(50):
        so = _step(engine, executor)
        if _transfers(so) is not None and _transfers(so).loads:
            load_steps.append(so)
        scheduled = [r for r in so.requests if r.request_id == request_id]
        if scheduled:
            assert len(load_steps) == 1, "its K/V was loaded more than once"
            assert load_steps[0] is so or load_steps[0] is executor.steps[-2], "it computed long after its loads"
            return load_steps[0], scheduled[0]
    raise AssertionError(f"{request_id} was never scheduled")


# ---- two 40-token prompts in a 6-block pool: the older one's 4th block forces out the newer one ----------------
#
# Step 1 computes both prompts: A gets device blocks [0, 1, 2], B [3, 4, 5]. Steps 2..9 decode one token each,
# inside the third blocks. After step 9 each has 49 tokens, 48 computed. Step 10: A's position 48 needs a 4th block,
# the pool is empty, so B (the newest) is preempted. It has 48 >= swap_min_tokens computed tokens: its 3 blocks go to
# the fresh host pool's blocks [0, 1, 2] and are freed tail first (free queue [5, 4, 3]); A takes block 5.
# B needs 4 blocks to resume (49 tokens) and only 2 are free until A, max_tokens=12, ends in step 12.
# Step 13: B takes the free queue's head, [4, 3, 5, 2] (A freed [5, 2, 1, 0] behind [4, 3]), and its 3 host blocks
# are loaded into the first three of them.

PROMPT_A, PROMPT_B = _tokens(40, seed=1), _tokens(40, seed=2)


def _two_requests(num_host_blocks: int, mode: str = "swap"):
    engine, executor = _engine(6, num_host_blocks, mode=mode)
    engine.add_request("A", PROMPT_A, SamplingParams(max_tokens=12))
    engine.add_request("B", PROMPT_B, SamplingParams(max_tokens=12))
    return engine, executor, engine.scheduler.requests["B"]


def _run_to_the_preemption(engine, executor, b: Request) -> SchedulerOutput:
    for _ in range(9):
        assert _transfers(_step(engine, executor)) is None
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 48 and b.num_tokens == 49
    assert engine.scheduler.kv_cache.block_ids(b) == [3, 4, 5]
    so = _step(engine, executor)
    assert b.status is RequestStatus.PREEMPTED and engine.scheduler.stats.num_preemptions == 1
    assert [(r.request_id, r.block_ids) for r in so.requests] == [("A", [5])]
    return so


def _check_outputs(done: dict[str, Request], prompts: dict[str, list[int]], max_tokens: int) -> None:
    assert set(done) == set(prompts)
    for request_id, prompt in prompts.items():
        assert done[request_id].output_token_ids == expected_continuation(prompt, max_tokens), request_id


def test_swap_out_and_back_in_round_trip():
    engine, executor, b = _two_requests(num_host_blocks=8)
    kv = engine.scheduler.kv_cache

    so = _run_to_the_preemption(engine, executor, b)
    assert b.num_computed_tokens == 48, "a swapped request keeps its computed tokens"
    assert _swapped(kv, b) and kv.block_ids(b) == []
    # ceil(48 / 16) = 3 device blocks, each to its own host block.
    assert _transfers(so).offloads == [(3, 0), (4, 1), (5, 2)] and _transfers(so).loads == []
    assert kv.host.pool.num_free_blocks == 8 - 3
    tier = kv.host.stats
    assert (tier.swap_preemptions, tier.swapped_out_blocks, tier.swapped_in_blocks) == (1, 3, 0)

    for _ in range(2):  # steps 11, 12: no room for B's 4 blocks yet
        so = _step(engine, executor)
        assert _transfers(so) is None and [r.request_id for r in so.requests] == ["A"]
    assert b.status is RequestStatus.PREEMPTED and "A" not in engine.scheduler.requests

    # Step 13: B comes back, computing in the step that loads its K/V or in the next one.
    load_step, resumed = _loads_then_schedule(engine, executor, "B")
    assert _transfers(load_step).loads == [(0, 4), (1, 3), (2, 5)] and _transfers(load_step).offloads == []
    assert resumed.new is not None and resumed.full_block_table
    assert resumed.block_ids == [4, 3, 5, 2]
    assert resumed.num_computed_tokens == 48 and resumed.token_ids == b.token_ids[48:49]
    assert not _swapped(kv, b)
    assert (tier.swap_preemptions, tier.swapped_out_blocks, tier.swapped_in_blocks) == (1, 3, 3)
    assert tier.copied_blocks == 6

    _run(engine)
    _assert_all_free(engine)
    assert b.output_token_ids == expected_continuation(PROMPT_B, 12)
    # Nothing recomputed: 2 prompts of 40 once each, then one token per step.
    assert engine.scheduler.stats.num_prefill_tokens + engine.scheduler.stats.num_decode_tokens == 80 + 11 + 11


def test_swap_round_trip_outputs_equal_the_fake_model():
    engine, _, _ = _two_requests(num_host_blocks=8)
    done = _run(engine)
    _check_outputs(done, {"A": PROMPT_A, "B": PROMPT_B}, 12)
    assert engine.scheduler.kv_cache.host.stats.swap_preemptions == 1
    _assert_all_free(engine)


@pytest.mark.parametrize("num_host_blocks", [1, 2])
def test_host_tier_too_small_for_the_victim_falls_back_to_recompute(num_host_blocks):
    engine, executor, b = _two_requests(num_host_blocks)  # B needs 3 host blocks
    kv = engine.scheduler.kv_cache
    so = _run_to_the_preemption(engine, executor, b)
    assert b.num_computed_tokens == 0 and not _swapped(kv, b)
    assert _transfers(so) is None
    assert kv.host.stats.swap_preemptions == 0 and kv.host.stats.swapped_out_blocks == 0
    assert kv.host.pool.num_free_blocks == num_host_blocks
    done = _run(engine)
    _check_outputs(done, {"A": PROMPT_A, "B": PROMPT_B}, 12)
    assert all(_transfers(s) is None for s in executor.steps)
    # B's prompt and its 9 tokens are computed again: 40 + 9 more prefill tokens than without the preemption.
    assert engine.scheduler.stats.num_prefill_tokens == 80 + 49
    _assert_all_free(engine)


def test_victim_shorter_than_swap_min_tokens_is_recomputed_despite_room():
    # A: 30 tokens (2 blocks), B: 10 (1 block), a 3-block pool. A's position 32, in step 4, needs a 3rd block;
    # B then has 10 + 2 = 12 computed tokens, fewer than swap_min_tokens (32).
    prompts = {"A": _tokens(30, seed=3), "B": _tokens(10, seed=4)}
    engine, executor = _engine(3, 8)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8))
    b = engine.scheduler.requests["B"]
    kv = engine.scheduler.kv_cache
    for _ in range(3):
        _step(engine, executor)
    assert b.num_computed_tokens == 12 < engine.scheduler.config.swap_min_tokens == 32
    so = _step(engine, executor)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and not _swapped(kv, b)
    assert _transfers(so) is None
    assert kv.host.stats.swap_preemptions == 0 and kv.host.pool.num_free_blocks == 8
    done = _run(engine)
    _check_outputs(done, prompts, 8)
    assert engine.scheduler.stats.num_preemptions == 1
    assert all(_transfers(s) is None for s in executor.steps)
    _assert_all_free(engine)


def test_abort_of_a_swapped_out_request_frees_its_host_blocks():
    engine, executor, b = _two_requests(num_host_blocks=8)
    kv = engine.scheduler.kv_cache
    _run_to_the_preemption(engine, executor, b)
    assert _swapped(kv, b) and kv.host.pool.num_free_blocks == 5
    aborted = engine.scheduler.abort_request("B")
    assert aborted is b and b.status is RequestStatus.FINISHED_ABORTED
    assert not kv.host._swapped and kv.host.pool.num_free_blocks == 8
    assert b not in engine.scheduler.waiting
    done = _run(engine)
    _check_outputs(done, {"A": PROMPT_A}, 12)
    assert all(_transfers(s) is None for s in executor.steps[10:]), "nothing of B's comes back"
    _assert_all_free(engine)


# ---- spill: a 4-block device pool with prefix caching, three prompts run one after the other -------------------
#
# P1 (33 tokens) takes device blocks [0, 1, 2] and caches [0, 1] (hashes h0, h1); freed tail first, the free
# queue is [3, 2, 1, 0]. P2 (49 unrelated tokens) takes all four, evicting 1 (h1) then 0 (h0): they spill to the
# fresh host pool's blocks 0 and 1. P2 caches its own 3 full blocks 3, 2, 1 and frees [0, 1, 2, 3].
# P3 = P1's first 32 tokens + 5 more: h0, h1 are not on the device but on the host (host blocks 1 and 0). It needs
# 3 device blocks: 0 (P2's partial block), 1 and 2, whose P2 contents spill to host blocks 2 and 3; host blocks 1
# and 0 are loaded into device blocks 0 and 1, and P3 is computed from token 32.

P1 = _tokens(33, seed=10)
P2 = _tokens(49, seed=11)
P3 = P1[:32] + _tokens(5, seed=12)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_evicted_prefix_spills_to_the_host_and_loads_back(mode):
    engine, executor = _engine(4, 4, mode=mode, caching=True)
    kv = engine.scheduler.kv_cache
    h0 = hash_block(None, P1[:16])
    h1 = hash_block(h0, P1[16:32])
    done = {}

    engine.add_request("P1", P1, SamplingParams(max_tokens=3))
    done |= _run(engine)
    assert all(_transfers(s) is None for s in executor.steps)
    assert kv.pool.lookup(h0).block_id == 0 and kv.pool.lookup(h1).block_id == 1

    first = len(executor.steps)
    engine.add_request("P2", P2, SamplingParams(max_tokens=3))
    done |= _run(engine)
    so = executor.steps[first]
    assert so.requests[0].block_ids == [3, 2, 1, 0]
    assert _transfers(so).offloads == [(1, 0), (0, 1)] and _transfers(so).loads == []
    assert all(_transfers(s) is None for s in executor.steps[first + 1:])
    assert kv.pool.lookup(h0) is None and kv.pool.lookup(h1) is None
    assert kv.host.lookup(h0).block_id == 1 and kv.host.lookup(h1).block_id == 0
    assert kv.host.stats.spilled_blocks == 2 and kv.stats.hits == 0

    engine.add_request("P3", P3, SamplingParams(max_tokens=3))
    cached = kv.find_cached_prefix(engine.scheduler.waiting[0])
    assert cached.device == [] and cached.connector is kv.host
    assert [b.block_id for b in kv.host._matched["P3"]] == [1, 0]
    so, p3 = _loads_then_schedule(engine, executor, "P3")
    assert _transfers(so).loads == [(1, 0), (0, 1)]
    assert _transfers(so).offloads == [(1, 2), (2, 3)]  # P2's blocks 2 and 1, evicted for P3
    # Within the step, the host blocks written (2, 3) and those read (1, 0) are distinct.
    assert p3.block_ids == [0, 1, 2] and p3.num_computed_tokens == 32 and p3.token_ids == P3[32:]
    done |= _run(engine)
    assert kv.stats.hits == 32 and kv.stats.queries == 33 + 49 + 37
    tier = kv.host.stats
    assert (tier.spilled_blocks, tier.loaded_blocks, tier.host_prefix_hits) == (4, 2, 32)
    assert (tier.swap_preemptions, tier.swapped_out_blocks, tier.swapped_in_blocks) == (0, 0, 0)
    assert kv.pool.lookup(h0).block_id == 0 and kv.pool.lookup(h1).block_id == 1  # on the device again
    _check_outputs(done, {"P1": P1, "P2": P2, "P3": P3}, 3)
    _assert_all_free(engine)


def _shared_prefix_workload(engine: EngineCore, count: int, seed: int, max_tokens: int) -> dict[str, list[int]]:
    """Prompts over 3 prefixes of 2-4 full blocks, each with a unique tail: the small pools keep evicting,
    spilling, swapping and loading them."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng.choice([32, 48, 64]), seed=100 + seed * 10 + i) for i in range(3)]
    prompts = {}
    for i in range(count):
        prompts[str(i)] = rng.choice(prefixes) + _tokens(rng.randint(1, 40), seed=1000 + seed * 100 + i)
        engine.add_request(str(i), prompts[str(i)], SamplingParams(max_tokens=max_tokens))
    return prompts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stress_swap_and_spill_copies_are_well_formed(seed, async_scheduling):
    engine, executor = _engine(14, 10, caching=True, budget=96, max_num_seqs=6, async_scheduling=async_scheduling)
    prompts = _shared_prefix_workload(engine, 24, seed, max_tokens=40)
    done = _run(engine)
    _check_outputs(done, prompts, 40)
    tier = engine.scheduler.kv_cache.host.stats
    assert tier.swap_preemptions > 0 and tier.swapped_in_blocks > 0, tier
    assert tier.spilled_blocks > 0 and tier.loaded_blocks > 0, tier
    _assert_all_free(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_step_never_reuses_a_host_block_for_other_contents(mode):
    """A host block a step loads from is never overwritten with other contents by the same step's offloads (the
    runner runs every offload first). The one host block a step may both write and read is a prefix spilled and
    found again within the step (host_tier.py): a cached block, whose K/V the load then reads (the fake model's
    outputs prove it)."""
    num_mixed = 0
    for seed in range(4):
        engine, executor = _engine(14, 10, mode=mode, caching=True, budget=96, max_num_seqs=6)
        kv = engine.scheduler.kv_cache
        prompts = _shared_prefix_workload(engine, 24, seed, max_tokens=40)
        done = {}
        while engine.has_unfinished():
            count = len(executor.steps)
            done |= {f.request.request_id: f.request for f in engine.step()}
            transfers = _transfers(executor.steps[-1]) if len(executor.steps) > count else None
            if transfers is None:
                continue
            num_mixed += bool(transfers.offloads and transfers.loads)
            written = {h for _, h in transfers.offloads}
            for host, _ in transfers.loads:
                if host in written:
                    assert kv.host.pool.blocks[host].block_hash is not None, "a swap copy reused in its step"
        _check_outputs(done, prompts, 40)
        _assert_all_free(engine)
    assert num_mixed > 0, "no step both offloaded and loaded: the test checks nothing"


def test_swap_only_steps_never_mix_offloads_and_loads():
    """Without prefix caching the tier only swaps; a step that preempts admits nobody, so no step both swaps a
    request out and another in, and no host block is ever written and read in one step."""
    engine, executor = _engine(14, 10, caching=False, budget=96, max_num_seqs=6)
    prompts = _shared_prefix_workload(engine, 24, 0, max_tokens=40)
    done = _run(engine)
    _check_outputs(done, prompts, 40)
    assert engine.scheduler.kv_cache.host.stats.swap_preemptions > 0
    assert not any(_transfers(s).offloads and _transfers(s).loads for s in executor.steps if _transfers(s))
    assert not any(executor.written_and_read)
    _assert_all_free(engine)


def test_async_swap_out_in_an_otherwise_empty_step_reaches_the_runner():
    """Regression: EngineCore launched no step that scheduled no request (`SchedulerOutput.is_empty` looked at the
    requests only), so the offloads of a swap-out that emptied the step never reached the runner, and the request's
    later loads read host blocks nobody wrote (commit 7a005ab)."""
    # Asynchronously, at the scheduling of step 10, A's 9th and last token is still pending (A surely finishes: it
    # is skipped) and B's position 48 needs a 4th block of a full pool: B preempts itself and swaps out, and the step
    # schedules nothing. Its transfers (offloads [(3, 0), (4, 1), (5, 2)]) must still be run before B's loads.
    engine, executor = _engine(6, 8, async_scheduling=True)
    engine.add_request("A", PROMPT_A, SamplingParams(max_tokens=9))
    engine.add_request("B", PROMPT_B, SamplingParams(max_tokens=12))
    done = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        try:
            done |= {f.request.request_id: f.request for f in engine.step()}
        except TypeError:  # the fake model summing None: slots the lost offloads never filled
            break
    offloads = [pair for s in executor.steps if _transfers(s) for pair in _transfers(s).offloads]
    assert offloads == [(3, 0), (4, 1), (5, 2)], "the swap-out's offloads never reached the runner"
    assert done["A"].output_token_ids == expected_continuation(PROMPT_A, 9)
    assert done["B"].output_token_ids == expected_continuation(PROMPT_B, 12)


def test_a_request_whose_kv_is_loading_does_not_deadlock_the_queue():
    """Regression (found by the stress tests on a working tree where a swapped-in request computes only from the
    step after its loads): in step 8 request 1 is swapped in (6 of the 10 blocks) and put back at the head of the
    queue while request 2 is admitted behind it; in step 9 request 2 needs a 5th block, preempts itself and is
    queued ahead of request 1, and then can never fit beside request 1's 6 blocks: "scheduler made no progress"."""
    engine, executor = _engine(10, 16, budget=64)
    prompts = {str(i): _tokens(length, seed=i) for i, length in enumerate((74, 80, 77))}
    for (request_id, prompt), max_tokens in zip(prompts.items(), (6, 38, 24)):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
    done = _run(engine)
    for (request_id, prompt), max_tokens in zip(prompts.items(), (6, 38, 24)):
        assert done[request_id].output_token_ids == expected_continuation(prompt, max_tokens), request_id
    assert engine.scheduler.kv_cache.host.stats.swap_preemptions >= 2
    _assert_all_free(engine)


def test_recompute_mode_with_a_host_tier_spills_and_loads_but_never_swaps(async_scheduling):
    engine, executor = _engine(14, 10, mode="recompute", caching=True, budget=96, max_num_seqs=6,
                               async_scheduling=async_scheduling)
    prompts = _shared_prefix_workload(engine, 24, 0, max_tokens=40)
    done = _run(engine)
    _check_outputs(done, prompts, 40)
    kv = engine.scheduler.kv_cache
    tier = kv.host.stats
    assert engine.scheduler.stats.num_preemptions > 0
    assert (tier.swap_preemptions, tier.swapped_out_blocks, tier.swapped_in_blocks) == (0, 0, 0)
    assert tier.spilled_blocks > 0 and tier.loaded_blocks > 0 and tier.host_prefix_hits > 0, tier
    assert tier.host_prefix_hits == tier.loaded_blocks * BLOCK
    _assert_all_free(engine)


# ---- what a full tier keeps (HostTier alone, told of evicted device blocks by id) ----------------------------------

def _device_block(block_id: int):
    from batchllm.engine.block_pool import KVCacheBlock

    return KVCacheBlock(block_id)


def _full_tier():
    """A 2-block tier holding a (host block 0) and b (host block 1), both spilled unused in one step and freed tail
    first: b is the least recently used."""
    from batchllm.engine.host_tier import HostTier

    tier = HostTier(2, enable_caching=True)
    tier.on_evict(10, b"a", reused=False)
    tier.on_evict(11, b"b", reused=False)
    assert tier.take_transfers().offloads == [(10, 0), (11, 1)], "a tier with room takes every block"
    assert [block.block_id for block in tier.pool.free_queue] == [1, 0] and tier.pool.num_free_uncached == 0
    return tier


def test_a_full_tier_takes_an_unused_block_only_at_its_second_eviction():
    tier = _full_tier()
    tier.on_evict(12, b"c", reused=False)  # never hit since it was computed: likely one row's own suffix
    assert tier.take_transfers() is None and tier.lookup(b"b") is not None
    tier.on_evict(13, b"c", reused=False)  # evicted again: it was computed twice, so it is shared after all
    assert tier.take_transfers().offloads == [(13, 1)]  # in b's place, the least recently used
    assert tier.lookup(b"b") is None and tier.lookup(b"c").block_id == 1 and tier.lookup(b"a") is not None


def test_a_full_tier_takes_a_reused_block_at_once():
    tier = _full_tier()
    tier.on_evict(12, b"c", reused=True)
    assert tier.take_transfers().offloads == [(12, 1)] and tier.lookup(b"b") is None


def _load(tier, name: bytes, device_id: int):
    block = tier.lookup(name)
    tier.hold([block])
    tier.load([block], [_device_block(device_id)])
    return tier.take_transfers()


def test_a_block_loaded_back_is_the_first_a_full_tier_evicts():
    tier = _full_tier()
    assert _load(tier, b"a", 20).loads == [(0, 20)]
    # a's K/V is on the device now: a new block evicts a, the more recently used, rather than b.
    tier.on_evict(12, b"c", reused=True)
    assert tier.take_transfers().offloads == [(12, 0)]
    assert tier.lookup(b"a") is None and tier.lookup(b"b") is not None


def test_a_loaded_block_the_device_evicts_again_becomes_the_most_recent():
    tier = _full_tier()
    _load(tier, b"b", 20)
    tier.on_evict(20, b"b", reused=True)  # the device evicts its copy: the tier has it, no copy
    assert tier.take_transfers() is None
    tier.on_evict(12, b"c", reused=True)
    assert tier.take_transfers().offloads == [(12, 0)]  # a, now the least recently used, makes room
    assert tier.lookup(b"a") is None and tier.lookup(b"b").block_id == 1


def test_a_tier_with_room_keeps_a_loaded_block_as_recently_used():
    from batchllm.engine.host_tier import HostTier

    tier = HostTier(3, enable_caching=True)
    tier.on_evict(10, b"a", reused=False)
    tier.on_evict(11, b"b", reused=False)
    tier.take_transfers()
    _load(tier, b"b", 20)
    assert [block.block_id for block in tier.pool.free_queue] == [2, 0, 1]  # the empty block first, b last
