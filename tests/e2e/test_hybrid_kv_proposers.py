"""Proposers with K/V of their own (a draft model, an EAGLE head) on a target with a hybrid KV cache: the proposer's
K/V gets a full-attention group of its own (`KVGroupLayout.drafter_group`), while the target's window groups free
their blocks. Tiny Mistral (one window group) and Gemma 3 (a full and two window groups) targets, as in
test_hybrid_kv_tiers.

Greedy outputs must equal HF transformers' whatever the drafts are (the rejection sampler verifies them), so the
drafts are checked too: a target drafting for itself proposes exactly its own greedy tokens, so every draft is
accepted, with both pools filled with NaN first. A proposer that reads a slot nobody wrote (its K/V written through
another group's table) proposes garbage, which a test shows is caught. An EAGLE head (random weights, the authors'
layout, as test_spec_eagle writes it) must propose exactly what it proposes with every block kept, the layout whose
drafts test_spec_eagle checks against the head's equations written out in torch.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from batchllm import LLM
from batchllm.engine.build import hybrid_kv_layout
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from batchllm.engine.kv_cache_manager import KVCacheManager
from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.model_runner import ModelRunner
from tests.e2e.test_hybrid_kv_tiers import family  # noqa: F401 (the module-scoped fixture)
from tests.e2e.test_sliding_window import ENGINE, _greedy, _prompts
from tests.e2e.test_spec_eagle import _layer_tensors

NUM_DRAFTS = 3


@pytest.mark.parametrize("method,own_group", [("ngram", False), ("medusa", False), ("draft_model", True),
                                              ("eagle", True), ("eagle3", True)])
def test_only_a_proposer_with_kv_of_its_own_gets_a_group(method, own_group) -> None:
    windows = [8, None, 8, None]  # groups of 2 layers: (window, full)
    model = SimpleNamespace(num_layers=4, layer_sliding_window=windows.__getitem__)
    config = SimpleNamespace(cache=SimpleNamespace(hybrid_kv_cache=True), speculative=SimpleNamespace(method=method))
    layout = hybrid_kv_layout(config, model)
    assert layout.group_windows == ((8, None, None) if own_group else (8, None))
    assert layout.drafter_group == (2 if own_group else None)
    assert layout.layer_group == (0, 1, 0, 1)


def _self_drafting(directory) -> LLM:
    spec = {"method": "draft_model", "model": str(directory), "num_speculative_tokens": NUM_DRAFTS,
            "adaptive": False}
    llm = LLM(str(directory), enable_prefix_caching=False, speculative_config=spec, **ENGINE)
    kv = llm.engine.scheduler.kv_cache
    assert isinstance(kv, HybridKVCacheManager), "the hybrid KV cache was switched off"
    layout = kv.layout
    assert layout.drafter_group == layout.num_groups - 1 and layout.group_windows[-1] is None
    assert any(window is not None for window in layout.group_windows)
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    llm.runner.drafter.kv_cache.tensor.fill_(float("nan"))
    return llm


def test_a_draft_model_in_its_own_group_drafts_the_targets_greedy_tokens(family) -> None:  # noqa: F811
    _, directory, expected = family
    llm = _self_drafting(directory)
    assert _greedy(llm, _prompts()) == expected
    stats = llm.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens, stats


def test_a_draft_pass_writing_into_another_groups_slots_is_caught(family, monkeypatch) -> None:  # noqa: F811
    # The check above can fail: the draft passes' K/V written at the first group's slots, read at the proposer's.
    _, directory, expected = family
    build = AttentionMetadataBuilder.for_rows

    def first_groups_slots(self, *args):
        metadata = build(self, *args)
        metadata.groups = [dataclasses.replace(group, slot_mapping=metadata.groups[0].slot_mapping)
                           for group in metadata.groups]
        return metadata

    monkeypatch.setattr(AttentionMetadataBuilder, "for_rows", first_groups_slots)
    llm = _self_drafting(directory)
    assert _greedy(llm, _prompts()) == expected  # drafts are verified: the outputs stay right
    stats = llm.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens / 2, stats


def _eagle_head(directory, tmp_path):
    """A one-layer EAGLE head for the checkpoint in `directory`, random weights in the authors' tensor names."""
    config = json.loads((directory / "config.json").read_text())
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    hidden, generator = config["hidden_size"], torch.Generator().manual_seed(7)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    tensors = _layer_tensors("layers.0", config, hidden, generator)
    tensors |= {"fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.05,
                "fc.bias": torch.zeros(hidden)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_an_eagle_head_in_its_own_group_proposes_what_it_does_with_every_block_kept(family, tmp_path,  # noqa: F811
                                                                                    monkeypatch) -> None:
    _, directory, expected = family
    spec = {"method": "eagle", "model": str(_eagle_head(directory, tmp_path)), "num_speculative_tokens": NUM_DRAFTS,
            "adaptive": False}
    proposals: list[dict[str, list[list[int]]]] = []  # per engine: request id → its drafts, step by step
    propose = ModelRunner._propose

    def recording(self, rows, sampled):
        drafts = propose(self, rows, sampled)
        for request_id, tokens in drafts.items():
            proposals[-1].setdefault(request_id, []).append(tokens)
        return drafts

    monkeypatch.setattr(ModelRunner, "_propose", recording)
    for hybrid in (True, False):
        proposals.append({})
        # A pool that never preempts: a row back from preemption starts its head's entries one token later.
        llm = LLM(str(directory), enable_prefix_caching=False, speculative_config=spec,
                  disable_hybrid_kv_cache_manager=not hybrid, **{**ENGINE, "num_kv_blocks": 160})
        kv = llm.engine.scheduler.kv_cache
        assert type(kv) is (HybridKVCacheManager if hybrid else KVCacheManager)
        llm.runner.kv_cache.tensor.fill_(float("nan"))
        llm.runner.drafter.kv_cache.tensor.fill_(float("nan"))
        assert _greedy(llm, _prompts()) == expected
        assert llm.stats.num_draft_tokens > 0 and llm.stats.num_preemptions == 0
    assert len(proposals[0]) == len(_prompts()) and proposals[0] == proposals[1]
