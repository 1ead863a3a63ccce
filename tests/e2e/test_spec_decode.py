"""Speculative decoding: greedy outputs with every proposer equal HF transformers' greedy outputs token for token,
under preemption and a tiny token budget; the accounting of drafted and accepted tokens is checked where the
acceptance is known (the target as its own draft: ~100 %; random weights: ~0 %).

The target is a tiny random Llama (tests/tiny_models.py) and the drafts and heads are made for it: the point is
the proposers' bookkeeping (drafts, rollbacks, preemption, chunking), which the 135M default model's weights only
make slower; HF loads the same tiny checkpoint, so the reference stays independent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from batchllm import LLM, SamplingParams
from tests.e2e.test_generate_vs_hf import _prompts
from tests.hf_greedy import hf_greedy_tokens
from tests.tiny_models import TINY_LLAMA, write_tiny_llama

MAX_NEW = 24
COPY_PROMPT = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank. "
               "Repeat it again:")


def spec_prompts(tokenizer) -> list[list[int]]:
    """test_generate_vs_hf.py's prompts but its 650-token one, and a prompt to copy from (the n-gram proposer's
    case). The 650-token prompt would size the pool and take 20 chunked steps, more each time it is recomputed,
    for no property of its own: the 333-token prompt still prefills in 11 chunks, the smaller pool still preempts,
    and test_generate_vs_hf.py runs the 650-token prompt under preemption and chunking."""
    return [p for p in _prompts(tokenizer) if len(p) < 600] + [tokenizer(COPY_PROMPT)["input_ids"]]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return spec_prompts(tokenizer)


def write_repeating_target(directory: Path) -> Path:
    """A tiny Llama whose greedy runs repeat tokens (small initial weights: ~60 % of its new tokens repeat the
    last one), so that n-gram drafts are sometimes accepted and sometimes not, as the real model's are; with this
    seed no greedy choice on these prompts is closer than 3e-3 in logits (of ~5), far above float32 rounding."""
    return write_tiny_llama(directory, seed=3, **{**TINY_LLAMA, "initializer_range": 0.1})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The target of every engine and HF reference here (overrides e2e/conftest.py's default model)."""
    return write_repeating_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def hf_greedy(model_path, prompts):
    return hf_greedy_tokens(model_path, prompts, MAX_NEW)


SHORT_NEW = 12


def _short(prompts, hf_greedy) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts of at most 64 tokens and the first SHORT_NEW of their HF tokens (a greedy run's prefix is the
    shorter run): the proposers' own checks need no 600-token prompt chunked 32 tokens a step, nor 24 new tokens
    (the n-gram test keeps every prompt and all 24)."""
    rows = [i for i, prompt in enumerate(prompts) if len(prompt) <= 64]
    return [prompts[i] for i in rows], [hf_greedy[i][:SHORT_NEW] for i in rows]


def _tight(prompts, model) -> dict:
    """An engine of `model` with a pool that holds the longest request and a little more, and a 32-token budget:
    preemption (rows admitted optimistically) and chunking."""
    num_blocks = -(-(max(len(p) for p in prompts) + MAX_NEW + 8) // 16) + 2
    return dict(model=str(model), device="cpu", num_kv_blocks=num_blocks, max_num_batched_tokens=32,
                enable_prefix_caching=False, admission_policy="optimistic")


def _greedy(llm: LLM, prompts, max_new: int = MAX_NEW) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, model_path):
    """A 2-layer Llama with random weights (not the target's: another initialisation) and its vocabulary and
    tokenizer."""
    path = tmp_path_factory.mktemp("random-draft")
    config = json.loads((model_path / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, path / name)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)  # the tiny target's config with seed 0 would be the target itself
    model = LlamaForCausalLM(LlamaConfig(**config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def medusa_heads(tmp_path_factory, model_path):
    """Random Medusa heads in FasterDecoding's layout (medusa_lm_head.safetensors), 2 blocks per head."""
    config = json.loads((model_path / "config.json").read_text())
    path = tmp_path_factory.mktemp("medusa")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2,
                                                  "hidden_size": hidden, "vocab_size": vocab}))
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(3):
        for layer in range(2):
            tensors[f"{i}.{layer}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.02
            tensors[f"{i}.{layer}.linear.bias"] = torch.zeros(hidden)
        tensors[f"{i}.2.weight"] = torch.randn(vocab, hidden, generator=generator) * 0.02
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    return path


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_greedy_equals_hf_under_preemption(model_path, prompts, hf_greedy, async_scheduling):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "adaptive": False}
    llm = LLM(speculative_config=spec, async_scheduling=async_scheduling, **_tight(prompts, model_path))
    assert _greedy(llm, prompts) == hf_greedy
    stats = llm.stats
    assert stats.num_preemptions >= 1 and stats.num_chunked_prefills >= 1, stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, stats
    assert stats.num_generated_tokens == sum(map(len, hf_greedy))


def test_draft_model_itself_accepts_everything(model_path, prompts, hf_greedy):
    prompts, hf_greedy = _short(prompts, hf_greedy)
    spec = {"method": "draft_model", "model": str(model_path), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(speculative_config=spec, **_tight(prompts, model_path))
    assert _greedy(llm, prompts, SHORT_NEW) == hf_greedy
    stats = llm.stats
    assert stats.num_draft_tokens > 0 and stats.draft_acceptance_rate > 0.95, stats
    # Every verifying row-step yields its accepted drafts plus one token.
    assert stats.num_generated_tokens == sum(map(len, hf_greedy))


def test_random_draft_model_is_rolled_back(model_path, random_draft, prompts, hf_greedy):
    prompts, hf_greedy = _short(prompts, hf_greedy)
    spec = {"method": "draft_model", "model": str(random_draft), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(speculative_config=spec, **_tight(prompts, model_path))
    assert _greedy(llm, prompts, SHORT_NEW) == hf_greedy
    stats = llm.stats
    assert stats.num_draft_tokens > 100 and stats.draft_acceptance_rate < 0.1, stats
    assert stats.num_preemptions >= 1, stats


def test_medusa_heads(model_path, medusa_heads, prompts, hf_greedy):
    prompts, hf_greedy = _short(prompts, hf_greedy)
    spec = {"method": "medusa", "model": str(medusa_heads), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(speculative_config=spec, **_tight(prompts, model_path))
    assert _greedy(llm, prompts, SHORT_NEW) == hf_greedy
    assert llm.stats.num_draft_tokens > 100, llm.stats
