"""FP8 weights and the FP8 KV cache on the real default model, against HF transformers in float32.

Teacher-forced over held-out texts (each fed in two chunks, so the second half reads the first half's K/V
back from the cache): the next-token distributions of our model with `quantization="fp8"`, with an FP8 KV
cache, and with both, against HF's float32 logits. Measured on the CPU (torch 2.13), 2026-12-05, 144 tokens:

| configuration | mean KL | max KL | top-1 agreement |
|---|---|---|---|
| FP8 weights + per-token FP8 activations | 0.041 | 0.41 | 0.896 |
| FP8 KV cache (scales 1.0) | 0.0066 | 0.04 | 0.965 |
| both | 0.062 | 0.46 | 0.875 |

On 2026-12-02 the top-1 column read 0.910 / 0.951 / 0.896, with the same FP8 code: FP8 rounding turns any
float-rounding change elsewhere in the model or its dependencies into a few different tokens (see
test_fp8_vs_simulation.py), so these figures are statistics of the FP8 noise, good to a few tokens of 144.

SmolLM2-135M is small and sensitive: with FP8 weights alone (activations unquantized; measured on 4 of
these texts) the mean KL is about 2/3 of the full FP8 figure, so most of the loss is the weights' 3-bit
mantissa. The bounds sit about 1.5x above the measured values: loose enough for BLAS differences across
machines, tight enough that a wrong scale (KL in the units) or a mis-rounded cast fails. (Our float32 model against the
same HF logits: KL below 1e-6, top-1 1.000; tests/unit/test_model_vs_hf.py holds that equality.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchllm.model.default_model import default_model_path
from batchllm.model.loader import load_model
from tests.unit.test_model_vs_hf import PagedRunner, hf_logits

FP8 = torch.float8_e4m3fn
HELD_OUT = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and "
    "release oxygen.",
    "In 1969, Apollo 11 landed on the Moon, and Neil Armstrong became the first person to walk on its surface.",
    "To make a simple vinaigrette, whisk three parts olive oil with one part vinegar, a pinch of salt and a "
    "spoonful of mustard.",
]
# (quantization, kv dtype) → (max mean KL, min top-1 agreement)
BOUNDS = {
    "fp8-weights": ("fp8", None, 0.06, 0.83),
    "fp8-kv": (None, FP8, 0.01, 0.92),
    "fp8-both": ("fp8", FP8, 0.09, 0.84),
}


@pytest.fixture(scope="module")
def held_out():
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    token_ids = [tokenizer(text)["input_ids"] for text in HELD_OUT]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return token_ids, [hf_logits(hf_model, ids) for ids in token_ids]


def teacher_forced(quantization: str | None, kv_dtype: torch.dtype | None, token_ids: list[list[int]]):
    model, config = load_model(default_model_path(), "cpu", torch.float32, quantization=quantization)
    logits = []
    for seq_id, ids in enumerate(token_ids):
        runner = PagedRunner(model, config, num_blocks=32, block_size=16, kv_dtype=kv_dtype)
        half = len(ids) // 2
        first = runner.step([(seq_id, ids[:half], 0)])[0]
        second = runner.step([(seq_id, ids[half:], half)])[0]
        logits.append(torch.cat([first, second]))
    return logits


@pytest.mark.parametrize("config", BOUNDS)
def test_fp8_against_float32_hf(config: str, held_out) -> None:
    quantization, kv_dtype, max_kl, min_top1 = BOUNDS[config]
    token_ids, expected = held_out
    ours = teacher_forced(quantization, kv_dtype, token_ids)
    reference = torch.cat(expected).log_softmax(-1)
    logprobs = torch.cat(ours).log_softmax(-1)
    kl = (reference.exp() * (reference - logprobs)).sum(-1)
    top1 = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
    print(f"{config}: {kl.numel()} tokens, mean KL {kl.mean():.5f}, max KL {kl.max():.4f}, top-1 {top1:.4f}")
    assert kl.mean().item() <= max_kl
    assert top1 >= min_top1
