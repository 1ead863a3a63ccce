"""The default step budget (`max_num_batched_tokens=None`) by task, device and model size."""

from __future__ import annotations

import pytest

from batchllm.config import default_step_budget
from batchllm.model.config import ModelConfig
from batchllm.model.size import model_size


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                                     "intermediate_size": intermediate, "num_hidden_layers": layers,
                                     "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                     "vocab_size": 49152, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192})


# Decoder-layer parameters by hand: layers x (q, k, v, o projections + gate, up, down + two norms).
SMOLLM2_135M = 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576)  # ~106M
QWEN_05B_LIKE = 24 * (896 * 896 * 2 + 2 * 896 * 128 + 3 * 896 * 4864 + 2 * 896)  # ~358M
LLAMA3_8B = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)  # ~6.98B


def test_layer_parameters_match_a_hand_count():
    assert model_size(llama_config(576, 1536, 30, 9, 3)).layers == SMOLLM2_135M
    assert model_size(llama_config(4096, 14336, 32, 32, 8)).layers == LLAMA3_8B


@pytest.mark.parametrize("layers, expected", [(SMOLLM2_135M, 32768), (QWEN_05B_LIKE, 16384), (LLAMA3_8B, 8192),
                                              (500_000_000, 16384), (500_000_001, 8192)])
def test_generating_on_cuda_small_models_take_longer_steps(layers, expected):
    assert default_step_budget("generate", "cuda", layers) == expected


def test_cpu_and_pooling_budgets_do_not_depend_on_size():
    assert default_step_budget("generate", "cpu", SMOLLM2_135M) == 8192
    assert default_step_budget("embed", "cuda", LLAMA3_8B) == 32768
    assert default_step_budget("embed", "cpu", SMOLLM2_135M) == 32768
