"""Prefix caching, n > 1 block sharing and beam search on the real default model.

References: the same engine with caching off (greedy outputs must not change), arithmetic on block counts,
separately seeded requests, and HF transformers' own beam search.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from batchllm import LLM, BeamSearchParams, SamplingParams

BLOCK = 16
EOS = 2
SYSTEM = ("You are a meticulous assistant for a data pipeline. Answer every question briefly, in plain "
          "English, without lists, and say when you are unsure. ")


@pytest.fixture(scope="module")
def async_scheduling() -> bool:
    """One engine mode here: both modes equal HF in test_generate_vs_hf.py, and the scheduler's prefix caching,
    forks and copy-on-write are checked in both modes with the fake executor (tests/unit/test_prefix_cache.py): a
    second mode would repeat those at the cost of two more default-model engines."""
    return False


@pytest.fixture(scope="module")
def llm(async_scheduling):
    return LLM(max_model_len=1024, async_scheduling=async_scheduling)


def _rows(llm, count: int, system_tokens: int) -> list[list[int]]:
    rng = random.Random(5)
    system = llm.tokenizer(SYSTEM * 8)["input_ids"][:system_tokens]
    return [system + llm.tokenizer(f" Question {i}: what is {rng.randint(2, 99)} times {i}?")["input_ids"]
            for i in range(count)]


def _greedy(llm, prompts, max_tokens=8):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def uncached():
    """The engine with caching off that computes every reference of this module (one load, not one per test)."""
    return LLM(num_kv_blocks=40, max_num_batched_tokens=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def eviction_rows(uncached):
    """Two system prompts alternating, and their greedy outputs with caching off: the reference, which does not
    depend on the scheduling mode, so it is computed once for both."""
    # 6 of each (12 rows of 11 blocks): three times the pool, so it evicts; more rows would only repeat the cycle.
    rows = _rows(uncached, 6, 150)
    other = [uncached.tokenizer(f"A different preamble number {i} " * 20)["input_ids"][:170] + [300 + i]
             for i in range(6)]
    prompts = [p for pair in zip(rows, other) for p in pair]
    outputs = _greedy(uncached, prompts)
    assert uncached.stats.prefix_cache_hits == 0
    return prompts, outputs


def test_caching_on_off_identical_with_eviction(async_scheduling, eviction_rows):
    # Two system prompts alternate in a pool too small to keep both: blocks are evicted and recomputed.
    prompts, uncached = eviction_rows
    cached = LLM(num_kv_blocks=40, max_num_batched_tokens=256, async_scheduling=async_scheduling)
    assert _greedy(cached, prompts) == uncached
    assert cached.stats.prefix_cache_hits > 0 and cached.stats.evicted_blocks > 0, cached.stats


def test_shared_system_prompt_hit_rate(llm):
    # 40 rows share a 200-token system prompt: 12 full blocks = 192 tokens are shareable. The first row
    # misses; a row admitted in the same step as the first hits the blocks that row is computing, so at
    # worst 39 rows hit 192 tokens each. Bound: hits >= 39 * 192 = 7,488 tokens, i.e. a token hit rate of
    # 7,488 / total prompt tokens (each row is ~200 + ~15 tokens, so the rate is above 0.85).
    rows = _rows(llm, 40, 200)
    total = sum(len(r) for r in rows)
    _greedy(llm, rows, max_tokens=2)
    stats = llm.stats
    assert stats.prefix_cache_queries == total
    assert stats.prefix_cache_hits >= 39 * 192
    assert stats.prefix_cache_hit_rate >= 39 * 192 / total
    # Prefill work drops by exactly the hits (the rows' prompts are computed once, nothing is preempted).
    assert stats.num_prefill_tokens == total - stats.prefix_cache_hits
    assert stats.num_preemptions == 0


def test_n4_shares_prompt_blocks_and_matches_separate_seeds(llm, uncached):
    # 4 full blocks + 11 tokens in a partial block, shared with no earlier prompt of this module.
    prompt = llm.tokenizer("Write a short poem about rivers and stones. " * 10)["input_ids"][:75]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    together = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = llm.stats
    prompt_blocks = -(-len(prompt) // BLOCK)
    # Samples 2..4 share all 5 prompt blocks; the partial block is copied when a sample first writes it.
    assert stats.shared_blocks == 3 * prompt_blocks
    assert stats.cow_copies == 3
    # The prompt is computed once; each extra sample recomputes only the last prompt token.
    assert stats.num_prefill_tokens == len(prompt) + 3
    # Peak: 5 prompt blocks + 3 copies, and no sample grew past its block (75 + 6 < 96).
    assert stats.peak_used_blocks == prompt_blocks + 3
    for j, completion in enumerate(together.outputs):  # each sample alone, on an engine that shares nothing
        alone = uncached.generate([prompt], SamplingParams(temperature=1.0, seed=11 + j, max_tokens=6,
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == alone.token_ids


BEAM_PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def hf_beams(model_path, tokenizer):
    """HF beam search per beam width: (token lists, scores) per prompt, computed once per module."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    @functools.cache
    def search(k: int) -> list[tuple[list[list[int]], list[float]]]:
        results = []
        for prompt in BEAM_PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.inference_mode():
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k,
                                  do_sample=False, max_new_tokens=12, length_penalty=1.0, early_stopping=False,
                                  output_scores=True, return_dict_in_generate=True)
            results.append(([_until_eos(seq[ids.shape[1]:].tolist(), EOS) for seq in ref.sequences],
                            [round(x, 3) for x in ref.sequences_scores.tolist()]))
        return results

    return search


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_equals_hf(llm, hf_beams, k):
    ours = llm.beam_search(BEAM_PROMPTS, BeamSearchParams(beam_width=k, max_tokens=12, length_penalty=1.0))
    for prompt, out, (ref_tokens, ref_scores) in zip(BEAM_PROMPTS, ours, hf_beams(k)):
        assert [s.token_ids for s in out.sequences] == ref_tokens, prompt
        assert [round(s.score, 3) for s in out.sequences] == ref_scores


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
