"""The runner's per-row sampling state (executor/sampling_table.py) follows each request through a batch whose
rows join, leave and reuse table rows: every row samples exactly as it does alone in the same engine.

Seeded random rows, penalties, min_tokens and logprobs all read per-request state, so a row that picked up
another request's parameters, generator or token history would differ from its solo run.
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from batchllm import LLM, SamplingParams
from tests.unit.test_model_vs_hf import TINY, save_tiny_checkpoint

ROWS = [
    SamplingParams(max_tokens=9, temperature=0),
    SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=3),
    SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5),
    SamplingParams(max_tokens=7, temperature=1.0, top_p=0.8, seed=11, frequency_penalty=1.0, presence_penalty=0.5),
    SamplingParams(max_tokens=6, temperature=0, logprobs=3, min_tokens=4, stop_token_ids=[5, 9, 17]),
    SamplingParams(max_tokens=10, temperature=0.7, min_p=0.1, seed=5, logprobs=1),
    SamplingParams(max_tokens=4, temperature=0, frequency_penalty=-1.5),
    SamplingParams(max_tokens=8, temperature=1.3, seed=8),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(LlamaConfig(**TINY, tie_word_embeddings=True), directory)
    return directory


def _rows(outputs):
    """Token ids and, per token, {token id: (logprob to 4 places, rank)}: batch shapes change float sums."""
    return [(o.outputs[0].token_ids,
             [{k: (round(v.logprob, 4), v.rank) for k, v in step.items()} for step in o.outputs[0].logprobs or []])
            for o in outputs]


def test_each_row_samples_as_it_does_alone(checkpoint, async_scheduling):
    # Three at a time: rows join as others leave, and reuse the rows of the runner's tables that they freed.
    llm = LLM(model=str(checkpoint), skip_tokenizer_init=True, device="cpu", max_num_seqs=3,
              async_scheduling=async_scheduling, enable_prefix_caching=False)
    prompts = [[(7 * i + j) % 120 + 3 for j in range(5 + 3 * i)] for i in range(len(ROWS))]
    together = _rows(llm.generate(prompts, ROWS, use_tqdm=False))
    alone = [_rows(llm.generate([prompt], params, use_tqdm=False))[0] for prompt, params in zip(prompts, ROWS)]
    assert together == alone
    assert all(p.min_tokens <= len(tokens) <= p.max_tokens for (tokens, _), p in zip(together, ROWS))
    assert sum(len(tokens) for tokens, _ in together) > 40
