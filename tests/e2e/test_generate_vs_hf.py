"""End to end on the real default model: batchllm greedy output equals HF transformers `generate`.

The reference is HF's own Llama implementation on the same converted float32 weights, run one prompt at a
time (no padding), so it shares no code with batchllm's model, runner or scheduler.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from batchllm import LLM, SamplingParams

MAX_NEW = 32  # two blocks of output past every prompt (a block boundary crossed in decode); more only lengthens the run


def _prompts(tokenizer) -> list[list[int]]:
    """12 prompts from 1 token to over 600 tokens: chat-templated questions, plain text, random ids."""
    rng = random.Random(0)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain recursion to a child in two sentences.", "List three prime numbers."]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False) for q in questions]
    prompts = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chat]
    story = "Once upon a time, in a village by the mountains, there lived an old clockmaker. " * 40
    prompts += [
        [1],
        tokenizer("The")["input_ids"],
        tokenizer("def fibonacci(n):")["input_ids"],
        tokenizer(story)["input_ids"][:650],
        tokenizer(story)["input_ids"][:333],
        [rng.randrange(100, 49000) for _ in range(97)],
        [rng.randrange(100, 49000) for _ in range(17)],
        tokenizer("1, 2, 3, 4, 5,")["input_ids"],
    ]
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > 600
    return prompts


@pytest.fixture(scope="module")
def llm_default(async_scheduling):
    return LLM(async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return _prompts(tokenizer)


@pytest.fixture(scope="module")
def hf_greedy(hf_default_greedy, prompts):
    return hf_default_greedy(prompts, MAX_NEW)  # e2e/conftest.py: computed once, shared with test_spec*.py


def _greedy_ids(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_hf(llm_default, prompts, hf_greedy):
    assert _greedy_ids(llm_default, prompts) == hf_greedy
    assert llm_default.stats.max_running == len(prompts), "the prompts were meant to run as one batch"


def test_greedy_equals_hf_under_preemption_with_every_prompt_chunked(prompts, hf_greedy, async_scheduling):
    # One engine for both properties: room for the longest request plus two blocks, and a 16-token budget that
    # chunks every prompt longer than 16 tokens; the medium prompts' chunks are admitted beside the longest one, so
    # their growth keeps preempting (11 times on the real model, greedy, sync). Rows are admitted optimistically
    # (KV-aware admission avoids most of these preemptions: test_admission_policies.py); prefix caching stays on,
    # as by default: the chat prompts' shared system prompt is hit while chunked and recomputed after preemption.
    num_blocks = -(-(max(len(p) for p in prompts) + MAX_NEW) // 16) + 2
    llm = LLM(num_kv_blocks=num_blocks, max_num_batched_tokens=16, async_scheduling=async_scheduling,
              admission_policy="optimistic")
    assert _greedy_ids(llm, prompts) == hf_greedy
    assert llm.stats.num_preemptions >= 5, llm.stats
    chunkable = sum(len(p) > 16 for p in prompts)
    assert llm.stats.num_chunked_prefills >= chunkable, llm.stats
    assert llm.stats.max_step_tokens <= 16


def test_seeded_sample_independent_of_batch(llm_default):
    # ignore_eos keeps all 24 draws in play: a first-token EOS would make any two seeds look alike.
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = "Tell me a short story about a robot."
    alone = llm_default.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    # 16 others that end at different steps (8 to 23 tokens), so the batch around the seeded row keeps changing.
    others = [f"Question {i}: name a color and a number bigger than {i}." for i in range(16)]
    other_params = [SamplingParams(temperature=1.0, max_tokens=8 + i) for i in range(16)]
    batch = llm_default.generate(others[:13] + [prompt] + others[13:], other_params[:13] + [params] + other_params[13:],
                                 use_tqdm=False)
    assert batch[13].outputs[0].text == alone.text
    assert batch[13].outputs[0].token_ids == alone.token_ids
    different_seed = llm_default.generate([prompt], dataclasses.replace(params, seed=99), use_tqdm=False)[0]
    assert different_seed.outputs[0].token_ids != alone.token_ids, "the seed had no effect"
