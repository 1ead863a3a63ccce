"""Shared settings and references for the connector tests."""

from __future__ import annotations

from batchllm import SamplingParams

# Tiny greedy settings: the real model on 2 CPU cores.
GREEDY = {"max_tokens": 4, "temperature": 0}


def reference_texts(llm, prompts: list[str], **fields) -> list[str]:
    """The facade's greedy text for each prompt: the ground truth for the connectors."""
    params = SamplingParams(**{**GREEDY, **fields})
    return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]
