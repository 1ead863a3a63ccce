"""The layout that speculative decoding's verification CUDA graphs replay, checked on the CPU.

A verification graph runs every row as `1 + k` query tokens, the row's own first and inert ones after them,
with the batch padded to a captured size (`InputBatch.prepare(query_stride=..., pad_to=...)`). CUDA graphs
cannot run here, so a stand-in "replays" by running the model eagerly on whatever the input buffers hold,
exactly what a captured graph reads (`graph_replay.py`). Greedy outputs with the n-gram and draft-model
proposers must equal those without speculation (which test_spec_decode.py checks against HF transformers),
under preemption and a small budget, and the stand-in must have replayed verification steps. EAGLE-3's
drafts in this layout are checked against an independent reference in test_spec_eagle.py.

The target is test_spec_decode.py's tiny Llama whose greedy runs repeat (n-gram drafts accepted and rejected):
the layout, not the real weights, is the point.
"""

from __future__ import annotations

import pytest

from batchllm import LLM, SamplingParams
from tests.e2e.graph_replay import EagerReplay
from tests.e2e.test_spec_decode import COPY_PROMPT, MAX_NEW, _tight, write_repeating_target


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The target of every engine here (overrides e2e/conftest.py's default model)."""
    return write_repeating_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Rows of different lengths, one that copies (long accepted runs) and one too short to draft from."""
    texts = [COPY_PROMPT, "The capital of France is", "def fibonacci(n):\n    return"]
    return [tokenizer(text)["input_ids"] for text in texts] + [[1]]


@pytest.fixture(scope="module")
def reference(prompts, model_path):
    return _greedy(LLM(**_tight(prompts, model_path)), prompts)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_padded_verification_layout_keeps_greedy_outputs(method, prompts, reference, model_path):
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(model_path)  # the target itself: drafts of every depth are accepted
    llm = LLM(**_tight(prompts, model_path), speculative_config=spec)
    graphs = llm.runner.graphs = EagerReplay(llm.runner)
    assert _greedy(llm, prompts) == reference
    strides = {query_len for _, query_len in graphs.replayed}
    # Verification steps replayed (the draft model's rows near their ends draft fewer tokens: several strides).
    assert len(strides - {1}) >= (2 if method == "draft_model" else 1), graphs.replayed
    stats = llm.stats
    assert stats.num_preemptions >= 1 and stats.num_accepted_tokens > 0, stats
