"""The host KV tier (`swap_space`, `preemption_mode="swap"`) on the real default model, against HF transformers.

The reference is HF's own greedy `generate` on the same float32 weights, prompts of one length batched without
padding (it shares no code with batchllm's model, runner, scheduler or KV tiers), with EOS not stopping it, like
`ignore_eos=True` here.
A KV block of the default model is 2 * 30 layers * 16 tokens * 3 heads * 64 * 4 bytes = 737,280 bytes: 0.1 GiB of
swap space holds 145 of them, 0.001 GiB one.

One engine with a host tier (`tiered`) runs three calls, each test reading what it checks: a shared-prefix batch, a
batch of six stories in 10 device blocks, which keeps swapping requests out and back in and evicts (spills) the first
call's prefix to the host tier, and the shared-prefix batch again, which finds that prefix only there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchllm import LLM, SamplingParams

BLOCK = 16
MAX_NEW = 32
PREFIX_NEW = 8
# 22 tokens each: 54 with their 32 new tokens, 4 blocks; six of them do not fit in 10 blocks (2-3 run at a time).
STORIES = [f"Write a short story about a {animal} who lives in a lighthouse by the sea and dreams of learning to fly."
           for animal in ("cat", "dog", "fox", "owl", "pig", "cow")]
PREFIX_TEXT = ("The committee met on a grey Tuesday morning to review the harbour's accounts, the new crane, the "
               "fishermen's complaints about the tides, and the lighthouse keeper's request for more oil. ")
QUESTIONS = [" Who asked for more oil?", " What did the fishermen complain about?"]
NUM_PREFIX_BLOCKS = 3
TIERED = {"device": "cpu", "num_kv_blocks": 10, "swap_space": 0.1, "preemption_mode": "swap",
          "reorder_by_prefix": False, "admission_policy": "optimistic"}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def stories(tokenizer) -> list[list[int]]:
    prompts = [tokenizer(text)["input_ids"] for text in STORIES]
    assert all(len(p) >= 20 for p in prompts), "each story must pass swap_min_tokens (32) while it decodes"
    return prompts


@pytest.fixture(scope="module")
def prefixed(tokenizer) -> list[list[int]]:
    """Two prompts that share their first 3 full blocks (48 tokens), then differ."""
    prefix = tokenizer(PREFIX_TEXT * 2)["input_ids"][: NUM_PREFIX_BLOCKS * BLOCK]
    return [prefix + tokenizer(question, add_special_tokens=False)["input_ids"] for question in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(model_path, stories, prefixed):
    """Prompt (as a tuple) → HF's greedy new tokens (MAX_NEW of them for the stories, PREFIX_NEW for the others).
    Prompts of one length run as one batch, which needs no padding: the six stories cost one run's steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    reference = {}
    with torch.inference_mode():
        for prompts, max_new in ((stories, MAX_NEW), (prefixed, PREFIX_NEW)):
            by_length = {}
            for prompt in prompts:
                by_length.setdefault(len(prompt), []).append(prompt)
            for length, batch in by_length.items():
                ids = torch.tensor(batch)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                     do_sample=False, eos_token_id=None)
                assert out.shape[1] == length + max_new
                reference.update({tuple(prompt): row[length:].tolist() for prompt, row in zip(batch, out)})
    return reference


def _hf(hf_greedy, prompts) -> list[list[int]]:
    return [hf_greedy[tuple(p)] for p in prompts]


@dataclasses.dataclass
class TieredRuns:
    llm: LLM
    first_prefixed: list[list[int]]
    stories: list[list[int]]
    second_prefixed: list[list[int]]
    stats: dict  # call name → EngineStats


@pytest.fixture(scope="module")
def tiered(stories, prefixed) -> TieredRuns:
    llm = LLM(**TIERED)
    stats = {}
    first = _generate(llm, prefixed, PREFIX_NEW)
    stats["first_prefixed"] = llm.stats
    story_outputs = _generate(llm, stories, MAX_NEW)
    stats["stories"] = llm.stats
    second = _generate(llm, prefixed, PREFIX_NEW)
    stats["second_prefixed"] = llm.stats
    return TieredRuns(llm, first, story_outputs, second, stats)


def _assert_pools_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache
    for name, pool in (("device", kv.pool), ("host", kv.host.pool)):
        assert pool.num_free_blocks == pool.num_blocks, f"{name} blocks leaked"
        assert all(block.ref_cnt == 0 for block in pool.blocks), f"a {name} block is still referenced"
    assert not kv.host._swapped, "a swapped-out request's host blocks are still recorded"


def test_swapping_greedy_outputs_equal_hf(tiered, stories, hf_greedy):
    assert tiered.stories == _hf(hf_greedy, stories)
    stats = tiered.stats["stories"]
    assert stats.num_host_kv_blocks == int(0.1 * (1 << 30)) // 737_280 == 145
    assert stats.swap_preemptions >= 3 and stats.num_preemptions >= stats.swap_preemptions, stats
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks, stats
    # Every copy moves one whole block: kv_transfer_bytes counts blocks times their size.
    assert stats.kv_transfer_bytes > 0 and stats.kv_transfer_bytes % 737_280 == 0, stats
    assert stats.kv_transfer_bytes >= (stats.swapped_out_blocks + stats.swapped_in_blocks) * 737_280
    assert stats.kv_transfer_seconds > 0


def test_a_prefix_spilled_to_the_host_tier_is_found_again(tiered, prefixed, hf_greedy, uncached):
    assert tiered.first_prefixed == _hf(hf_greedy, prefixed)
    assert tiered.second_prefixed == _hf(hf_greedy, prefixed)
    assert _generate(uncached, prefixed, PREFIX_NEW) == tiered.second_prefixed
    first, between, second = (tiered.stats[name] for name in ("first_prefixed", "stories", "second_prefixed"))
    assert first.prefix_cache_hits == NUM_PREFIX_BLOCKS * BLOCK, first  # the second prompt, on the device
    assert first.host_prefix_hits == 0 and first.spilled_blocks == 0, first
    assert between.spilled_blocks >= NUM_PREFIX_BLOCKS and between.evicted_blocks > 0, between
    # The first prompt finds the 3 prefix blocks only on the host; the second finds them on the device once the
    # first's copies are indexed there, or (when they are not yet, in the step that loads them) on the host too.
    assert NUM_PREFIX_BLOCKS <= second.host_tier_loaded_blocks <= 2 * NUM_PREFIX_BLOCKS, second
    assert second.host_prefix_hits == second.host_tier_loaded_blocks * BLOCK, second
    assert second.prefix_cache_hits == 2 * NUM_PREFIX_BLOCKS * BLOCK, second
    assert second.num_prefill_tokens == sum(len(p) for p in prefixed) - 2 * NUM_PREFIX_BLOCKS * BLOCK, second


def test_no_block_is_leaked_in_either_pool(tiered, uncached):
    _assert_pools_free(tiered.llm)
    _assert_pools_free(uncached)


@pytest.fixture(scope="module")
def uncached() -> LLM:
    """Prefix caching off and a host tier of one block: too small for any request, so nothing ever swaps."""
    return LLM(device="cpu", num_kv_blocks=8, swap_space=0.001, preemption_mode="swap", enable_prefix_caching=False,
               admission_policy="optimistic")


def test_a_host_tier_too_small_falls_back_to_recompute(uncached, stories, hf_greedy):
    kv = uncached.engine.scheduler.kv_cache
    refused = []
    swap_out = kv.swap_out

    def recording_swap_out(request):
        swapped = swap_out(request)
        refused.append(not swapped)
        return swapped

    kv.swap_out = recording_swap_out  # the scheduler asks only for victims with >= swap_min_tokens computed
    try:
        outputs = _generate(uncached, stories[:4], MAX_NEW)
    finally:
        del kv.swap_out
    assert outputs == _hf(hf_greedy, stories[:4])
    stats = uncached.stats
    assert stats.num_host_kv_blocks == 1
    assert stats.num_preemptions > 0 and stats.swap_preemptions == 0, stats
    assert refused and all(refused), "no victim was long enough to swap: the fallback was not exercised"
    assert stats.swapped_out_blocks == stats.swapped_in_blocks == stats.kv_transfer_bytes == 0, stats
    _assert_pools_free(uncached)


@pytest.mark.parametrize("kwargs,argument", [
    ({"preemption_mode": "swap"}, "swap_space"),
    ({"preemption_mode": "swap", "swap_space": 0}, "swap_space"),
    ({"preemption_mode": "bogus", "swap_space": 1}, "preemption_mode"),
    ({"swap_space": -1}, "swap_space"),
    ({"swap_space": True}, "swap_space"),
    ({"swap_space": "1"}, "swap_space"),
])
def test_bad_tier_arguments_are_rejected_before_the_model_loads(kwargs, argument, monkeypatch):
    import batchllm.model.loader as loader

    def no_load(*args, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "resolve_model_path", no_load)
    with pytest.raises(ValueError, match=argument):
        LLM(device="cpu", **kwargs)


# ---- CUDA: the copy stream (executor/kv_transfer.py) ------------------------------------------------------------
# The default model's shape with random weights, so the test needs no checkpoint on the GPU machine. The reference
# is the same CUDA engine with a pool that never preempts nor evicts: it shares the device's arithmetic (HF's is
# another), and float32 keeps greedy ties apart.
GPU_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
             "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
             "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def _gpu_engine(shape_dir, async_scheduling: bool, **options) -> LLM:
    return LLM(str(shape_dir), device="cuda", dtype="float32", load_format="dummy", skip_tokenizer_init=True,
               reorder_by_prefix=False, async_scheduling=async_scheduling, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_swapping_and_the_prefix_tier_on_cuda_change_no_output(tmp_path, async_scheduling):
    import json
    import random

    (tmp_path / "config.json").write_text(json.dumps(GPU_SHAPE))
    rng = random.Random(0)
    stories = [[rng.randrange(100, 49000) for _ in range(22)] for _ in range(6)]
    prefix = [rng.randrange(100, 49000) for _ in range(NUM_PREFIX_BLOCKS * BLOCK)]
    prefixed = [prefix + [rng.randrange(100, 49000) for _ in range(5)] for _ in range(2)]
    reference = _gpu_engine(tmp_path, async_scheduling, num_kv_blocks=64)
    expected = [_generate(reference, prefixed, PREFIX_NEW), _generate(reference, stories, MAX_NEW)]
    assert reference.stats.num_preemptions == 0
    del reference
    llm = _gpu_engine(tmp_path, async_scheduling, num_kv_blocks=10, swap_space=0.1, preemption_mode="swap",
                      admission_policy="optimistic")
    # The stories swap in and out of 10 blocks and evict the prefix to the host tier, where the second call finds it.
    assert _generate(llm, prefixed, PREFIX_NEW) == expected[0]
    assert _generate(llm, stories, MAX_NEW) == expected[1]
    stats = llm.stats
    assert stats.swap_preemptions > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks > 0, stats
    assert stats.spilled_blocks >= NUM_PREFIX_BLOCKS, stats
    assert _generate(llm, prefixed, PREFIX_NEW) == expected[0]
    stats = llm.stats
    assert stats.host_tier_loaded_blocks >= NUM_PREFIX_BLOCKS and stats.host_prefix_hits > 0, stats
    assert stats.kv_transfer_bytes > 0 and stats.kv_transfer_seconds > 0, stats
    _assert_pools_free(llm)
