"""HF transformers' greedy tokens, the independent reference of many engine tests: `generate` one prompt at a time,
no padding, float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_greedy_tokens(model: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt's greedy new tokens (up to `max_new`, fewer where EOS comes first). `model`: an HF causal LM, or
    a checkpoint directory loaded in float32."""
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens
