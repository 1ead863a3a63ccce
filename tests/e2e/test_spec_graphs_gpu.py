"""Speculative decoding with CUDA graphs on CUDA (GPU-marked: skipped without a device): greedy outputs with n-gram
drafts equal those without speculation, a tiny float32 Llama written by transformers.

The verification graphs replay a padded layout (every row as `1 + k` query tokens, the batch padded to a captured
size) whose inert tokens and padding rows read K/V slots nothing wrote. Float32 leaves no near-ties: the outputs
must be equal, row for row. That those unwritten slots are zeros (executor/kv_cache.py's `zeroed_pool`: recycled
memory with NaN bits would reach `p @ V` as 0 x NaN) is tested on the CPU, tests/unit/test_kv_pool_zeroed.py: here
the runner empties the allocator's cache before it allocates, so NaN freed by the test never reaches the pool (on an
H100, a pool made with `torch.empty` after a freed 64 MB NaN tensor held no NaN, and this test passed with it)."""

from __future__ import annotations

import pytest
import torch

from batchllm import LLM, SamplingParams
from tests.tiny_models import write_random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 1024
# 2,048 blocks of 8 KiB (2 layers x K and V x 16 slots x 2 heads x 16 dims x 4 bytes): 16 MB, room for every row;
# sized, so that the second engine is not profiled against the first's pool of most of the device.
ENGINE = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              num_kv_blocks=2048)


@pytest.fixture(scope="module")
def repeating_llama(tmp_path_factory):
    """Small initial weights: greedy runs repeat tokens, so n-gram drafts are both accepted and rejected."""
    return write_random_llama(tmp_path_factory.mktemp("models") / "repeating-llama", seed=3, vocab_size=VOCAB,
                              hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                              tie_word_embeddings=True)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_ngram_verification_graphs_keep_greedy_outputs(repeating_llama):
    gen = torch.Generator().manual_seed(0)
    copy = torch.randint(10, VOCAB, (40,), generator=gen).tolist()
    prompts = [copy * 3, [1]] + [torch.randint(10, VOCAB, (int(n),), generator=gen).tolist()
                                 for n in torch.randint(5, 300, (30,), generator=gen)]
    plain = LLM(repeating_llama, **ENGINE)
    reference = _greedy(plain, prompts)
    spec = LLM(repeating_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "adaptive": False}, **ENGINE)
    assert spec.runner.graphs is not None, "CUDA graphs are the point: the verification layout is what they replay"
    outputs = _greedy(spec, prompts)
    assert spec.stats.num_accepted_tokens > 0
    assert outputs == reference
