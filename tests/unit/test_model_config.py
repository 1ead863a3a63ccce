"""Parsing HF config.json files into ModelConfig."""

from __future__ import annotations

import pytest

from batchllm.model.config import ModelConfig, RopeScaling

BASE = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 4096,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_transformers_4_and_5_rope_spellings_agree() -> None:
    v4 = ModelConfig.from_hf_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}})
    v5 = ModelConfig.from_hf_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}
    )
    assert v4 == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling == RopeScaling("llama3", **LLAMA3)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_defaults_and_derived_fields() -> None:
    config = ModelConfig.from_hf_dict({**BASE, "eos_token_id": [7, 9], "bos_token_id": 1})
    assert config.head_dim == 16 and config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.eos_token_ids == [7, 9] and config.bos_token_id == 1
    assert config.max_model_len == 4096 and not config.attention_bias and not config.qk_norm


def test_architecture_falls_back_to_model_type() -> None:
    config = ModelConfig.from_hf_dict({**BASE, "architectures": None, "model_type": "llama"})
    assert config.architecture == "LlamaForCausalLM"


def test_mistral_sliding_window_applies_to_every_layer_without_capping_model_length() -> None:
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 1024})
    assert config.sliding_window == 1024 and config.max_model_len == 4096
    assert [config.layer_sliding_window(i) for i in range(2)] == [1024, 1024]


def test_a_window_no_shorter_than_the_model_is_dropped() -> None:
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert config.layer_sliding_window(0) is None  # no sequence is longer than the window: full attention


@pytest.mark.parametrize("max_window_layers", [0, 3, 6])
def test_qwen_windowed_layers_without_layer_types_follow_transformers(max_window_layers) -> None:
    # Configs written by transformers 4 have no layer_types: HF's own Qwen2Config derives them.
    from transformers import Qwen2Config

    hf = {**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 6, "use_sliding_window": True,
          "sliding_window": 16, "max_window_layers": max_window_layers}
    reference = Qwen2Config(**{k: v for k, v in hf.items() if k != "architectures"}).layer_types
    config = ModelConfig.from_hf_dict(hf)
    assert [config.layer_sliding_window(i) for i in range(6)] == [
        16 if kind == "sliding_attention" else None for kind in reference]


def test_bad_window_fields_are_named() -> None:
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**qwen, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict({**qwen, "sliding_window": 0})


def test_qwen_sliding_window_switched_off_is_ignored() -> None:
    config = ModelConfig.from_hf_dict(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 1024, "use_sliding_window": False}
    )
    assert config.sliding_window is None and config.max_model_len == 4096 and config.layer_sliding_window(1) is None
    assert config.attention_bias and not config.o_proj_bias


def test_qwen3_uses_qk_norm() -> None:
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert config.qk_norm and config.head_dim == 32
