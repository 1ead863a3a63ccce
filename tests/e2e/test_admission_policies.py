"""The real default model's greedy outputs under both admission policies equal HF transformers `generate`, on a pool
so small that the optimistic policy preempts (and recomputes) where KV-aware admission does not."""

from __future__ import annotations

import pytest

from batchllm import LLM, SamplingParams
from tests.hf_greedy import hf_greedy_tokens

MAX_NEW = 16
TEXTS = ["The capital of France is", "The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4, 5,",
         "Once upon a time, in a village by the mountains,"]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def hf_greedy(model_path, prompts) -> list[list[int]]:
    outputs = hf_greedy_tokens(model_path, prompts, MAX_NEW)
    # No EOS within MAX_NEW tokens: the reference is what `ignore_eos=True` (a forced output) generates too.
    assert all(len(output) == MAX_NEW for output in outputs)
    return outputs


@pytest.mark.parametrize("policy", ["kv_aware", "optimistic"])
def test_greedy_equals_hf_under_both_policies(policy, prompts, hf_greedy):
    # Every row fits 2 blocks of 16 to its end (prompts of 4-14 tokens + 16 forced); 5 blocks hold 2 rows at once.
    assert all(len(p) + MAX_NEW <= 32 for p in prompts)
    llm = LLM(num_kv_blocks=5, max_model_len=32, enable_prefix_caching=False, admission_policy=policy)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    stats = llm.stats
    if policy == "kv_aware":
        assert (stats.num_preemptions, stats.num_recomputed_tokens) == (0, 0), stats
    else:
        assert stats.num_preemptions > 0 and stats.num_recomputed_tokens > 0, stats
