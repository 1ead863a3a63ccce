"""`deterministic=True` on CUDA (GPU-marked: skipped without a device): a small random bfloat16 llama, written by
transformers, with CUDA graphs on. 16 rows (greedy and seeded sampling) give bit-identical tokens and logprobs
alone, inside a batch of 64 other rows, and under a 16-token step budget (their prompts in chunks, the shared
prefix cached). The reference is the same rows computed alone, one call each; the kernels behind it are checked
against float32 torch references in tests/kernels/test_invariant_kernels.py."""

from __future__ import annotations

import gc

import pytest
import torch

from batchllm import LLM, SamplingParams
from tests.e2e.test_deterministic import _in_batch as in_batch
from tests.e2e.test_deterministic import _results
from tests.tiny_models import write_random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 1024
MAX_TOKENS = 8
PREFIX = list(range(3, 40))  # 37 tokens: with prefix caching the later rows start from cached blocks
ROWS = [PREFIX + [(7 * i + j) % VOCAB for j in range(5 + 3 * i)] for i in range(16)]
OTHERS = [[(11 * i + 5 * j) % VOCAB for j in range(1 + (13 * i) % 90)] for i in range(64)]
ENGINE = dict(device="cuda", dtype="bfloat16", deterministic=True, skip_tokenizer_init=True, num_kv_blocks=4096)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    # head_dim 64 with 4 query heads per KV head (GQA as in llama3-8b); large weights: clear greedy choices.
    return write_random_llama(tmp_path_factory.mktemp("models") / "random-llama", seed=0, dtype=torch.bfloat16,
                              vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                              initializer_range=0.2, tie_word_embeddings=False)


def _params(i: int) -> SamplingParams:
    """Rows 0-7 greedy, 8-15 seeded sampling; two logprobs a token."""
    if i < 8:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, logprobs=2,
                          ignore_eos=True)


def _in_batch(llm: LLM) -> list[tuple]:
    """The 16 rows spread inside a batch of 64 others (greedy, of other lengths)."""
    return in_batch(llm, ROWS, OTHERS, _params, ignore_eos=True)


def test_rows_are_bit_identical_alone_in_a_batch_and_under_a_small_budget(random_llama):
    llm = LLM(random_llama, enable_prefix_caching=False, **ENGINE)
    alone = [_results(llm, [ROWS[i]], [_params(i)])[0] for i in range(len(ROWS))]
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in alone)
    assert _in_batch(llm) == alone
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    budget = LLM(random_llama, max_num_batched_tokens=16, max_num_seqs=16, enable_prefix_caching=True, **ENGINE)
    assert _results(budget, ROWS, [_params(i) for i in range(len(ROWS))]) == alone
    assert _in_batch(budget) == alone
    del budget  # the GPU tests after this one in the same process need the memory back
    gc.collect()
    torch.cuda.empty_cache()
