"""Which model class serves which HF architecture."""

from __future__ import annotations

import difflib

from torch import nn

from batchllm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from batchllm.model.gpt_oss import GptOssForCausalLM
from batchllm.model.llama import LlamaForCausalLM, LlamaForSequenceClassification
from batchllm.model.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from batchllm.model.phi3 import Phi3ForCausalLM
from batchllm.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

# Llama, Mistral, Qwen2 and Qwen3 share one implementation (their differences are ModelConfig flags); Phi-3 is
# Llama's with fused checkpoint tensors; Gemma 2 and 3 have their own.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": LlamaForSequenceClassification,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}

SUPPORTED_ARCHITECTURES = tuple(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an HF `architectures` entry; a ValueError names the supported ones otherwise."""
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        closest = difflib.get_close_matches(architecture, SUPPORTED_ARCHITECTURES, n=1, cutoff=0.5)
        hint = f" The closest supported one is {closest[0]!r}." if closest else ""
        raise ValueError(
            f"Model architecture {architecture!r} is not supported. Supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}.{hint} Use a checkpoint of one of these families "
            f"(its config.json 'architectures' field says which it is)."
        ) from None
