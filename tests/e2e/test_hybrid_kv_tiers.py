"""The hybrid KV cache (window layers' blocks freed) with the host tier and with disaggregated prefill / decode, end
to end against HF transformers: swap preemption, host prefix hits and the P/D handoff on the tiny Mistral (every
layer windowed: one window group) and Gemma 3 (two local layers to one global: a full and two window groups)
checkpoints of test_sliding_window and test_gemma.

The reference is HF `generate` with eager attention in float32 (its masks apply the window), one prompt at a time.
In one process both pools are filled with NaN first: a block swapped or loaded into the wrong entry of a group's
table, or a window block left behind while a query still sees it, reads a slot no step or copy wrote and turns the
output into garbage. (The P/D engines' pools live in their worker processes: there the handed-over block count,
worked out by hand, and HF's tokens are the checks.)
"""

from __future__ import annotations

import pytest

from batchllm import LLM
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from tests.e2e.test_gemma import FAMILIES as GEMMA_FAMILIES
from tests.e2e.test_sliding_window import ENGINE, _greedy, _hf_greedy, _prompts
from tests.e2e.test_sliding_window import FAMILIES as WINDOW_FAMILIES
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

FAMILIES = {"mistral": WINDOW_FAMILIES["mistral"], "gemma3": GEMMA_FAMILIES["gemma3"]}
NO_WINDOW = {"mistral": {"sliding_window": None}, "gemma3": {"sliding_window": 256}}
# Pools that hold one or two of the prompts with their outputs (as test_sliding_window's and test_gemma's preemption
# tests), so that requests are preempted: those with 32 tokens computed (swap_min_tokens) swap. Optimistic admission
# (vLLM's): every prompt that fits now is admitted and the pool runs dry as they decode.
PREEMPTING_BLOCKS = {"mistral": 8, "gemma3": 28}
TIER = dict(swap_space=0.01, preemption_mode="swap", admission_policy="optimistic")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint directory, HF greedy tokens of `_prompts()`)."""
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(FAMILIES[request.param](), directory)
    expected = _hf_greedy(directory, _prompts())[0]
    # The window must matter on these prompts, or an engine ignoring it would pass.
    assert _hf_greedy(directory, _prompts(), **NO_WINDOW[request.param])[0] != expected
    return request.param, directory, expected


def _poisoned(llm: LLM) -> LLM:
    assert isinstance(llm.engine.scheduler.kv_cache, HybridKVCacheManager), "the hybrid KV cache was switched off"
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    for host in llm.runner.host_kv._host:
        host.fill_(0xFF)  # every byte 0xFF: a NaN in float32
    return llm


def _assert_pools_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache
    for name, pool in (("device", kv.pool), ("host", kv.host.pool)):
        assert pool.num_free_blocks == pool.num_blocks, f"{name} blocks leaked"
        assert all(block.ref_cnt == 0 for block in pool.blocks), f"a {name} block is still referenced"


def test_greedy_equals_hf_under_swap_preemption(family) -> None:
    name, directory, expected = family
    llm = _poisoned(LLM(str(directory), enable_prefix_caching=False,
                        **{**ENGINE, **TIER, "num_kv_blocks": PREEMPTING_BLOCKS[name]}))
    assert _greedy(llm, _prompts()) == expected
    stats = llm.stats
    assert stats.swap_preemptions > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks > 0, stats
    _assert_pools_free(llm)


def test_greedy_equals_hf_with_a_prefix_found_in_the_host_tier(family) -> None:
    # Prompts 2 and 3 share a 33-token prefix (4 blocks of 8, longer than either window). Prompts 0 and 1, run
    # between them in a small pool, evict prompt 2's cached blocks, which spill to the host tier.
    name, directory, expected = family
    llm = _poisoned(LLM(str(directory), enable_prefix_caching=True,
                        **{**ENGINE, **TIER, "num_kv_blocks": PREEMPTING_BLOCKS[name]}))
    prompts = _prompts()
    outputs = _greedy(llm, prompts[2:3]) + _greedy(llm, prompts[:2])
    assert llm.stats.spilled_blocks > 0
    outputs += _greedy(llm, prompts[3:])
    assert llm.stats.host_prefix_hits > 0 and llm.stats.host_tier_loaded_blocks > 0, llm.stats
    assert outputs == expected[2:3] + expected[:2] + expected[3:]
    _assert_pools_free(llm)


def test_nan_poisoning_catches_a_window_block_left_behind_by_a_swap(family, monkeypatch) -> None:
    # The check above can fail: a swap-out that lets go of a window's oldest block (one a query at the computed
    # position still sees) brings the request back without its K/V.
    name, directory, expected = family
    held = HybridKVCacheManager.held_blocks

    def one_block_short(self, request):
        tables = self._tables[request.request_id]
        self._release_unseen(request.request_id, tables, request.num_computed_tokens + ENGINE["block_size"])
        return held(self, request)

    monkeypatch.setattr(HybridKVCacheManager, "held_blocks", one_block_short)
    llm = _poisoned(LLM(str(directory), enable_prefix_caching=False,
                        **{**ENGINE, **TIER, "num_kv_blocks": PREEMPTING_BLOCKS[name]}))
    assert _greedy(llm, _prompts()) != expected


def test_greedy_equals_hf_with_disaggregated_prefill_and_decode(family) -> None:
    # Two worker processes; the prefill engine hands each prompt's K/V less its last token to the decode engine.
    name, directory, expected = family
    llm = LLM(str(directory), disaggregated={"prefill": 1, "decode": 1}, enable_prefix_caching=True, **ENGINE)
    try:
        engine = llm.engine
        assert all(isinstance(kv, HybridKVCacheManager) for kv in (engine.prefill_kv, engine.decode_kv))
        prompts = _prompts()
        assert _greedy(llm, prompts) == expected
        # By hand: of a prompt of n tokens, the first n - 1 are handed over: ceil((n - 1) / 8) blocks of a full
        # group, and of a window group those from the block of the first position a query at n - 1 sees.
        windows = engine.prefill_kv.layout.group_windows
        block = ENGINE["block_size"]

        def held(n: int) -> int:
            count = -(-(n - 1) // block)
            return sum(count - (0 if window is None else max(0, n - window) // block) for window in windows)

        stats = llm.stats
        assert stats.kv_handoffs == len(prompts) and stats.kv_handoffs_recomputed == 0, stats
        assert stats.kv_handoff_blocks == sum(held(len(p)) for p in prompts), stats
        for _ in range(4):  # the decode engine frees a load's slots a few steps after it
            engine.step()
        for kv in (engine.prefill_kv, engine.decode_kv):
            assert kv.pool.num_free_blocks == kv.pool.num_blocks
        assert engine.prefill_kv.link.num_free_blocks == engine.prefill_kv.link.num_blocks
    finally:
        llm.shutdown()
