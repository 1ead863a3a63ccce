"""Proposers with K/V of their own (a draft model, an EAGLE head) on a target with a hybrid KV cache: the proposer's
K/V gets a full-attention group of its own (`KVGroupLayout.drafter_group`), while the target's window groups free
their blocks. Tiny Mistral (one window group) and Gemma 3 (a full and two window groups) targets, as in
test_hybrid_kv_tiers.

Greedy outputs must equal HF transformers' whatever the drafts are (the rejection sampler verifies them), so the
drafts are checked too: a target drafting for itself proposes exactly its own greedy tokens, so every draft is
accepted, with both pools filled with NaN first. A proposer that reads a slot nobody wrote (its K/V written through
another group's table) proposes garbage, which the last test shows is caught.
"""

from __future__ import annotations

import dataclasses

from batchllm import LLM
from batchllm.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from tests.e2e.test_hybrid_kv_tiers import family  # noqa: F401 (the module-scoped fixture)
from tests.e2e.test_sliding_window import ENGINE, _greedy, _prompts

NUM_DRAFTS = 3


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
