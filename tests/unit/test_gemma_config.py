"""Gemma config.json spellings against transformers' own reading of them (its config classes: the reference),
and the switches we refuse, each named."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig

from batchllm.model.config import ModelConfig

# gemma-3-4b-it's text_config as released: everything else is a Gemma3TextConfig default.
RELEASED_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024}
# A transformers 4 Gemma 3 text config: flat rope_theta / rope_scaling, rope_local_base_freq, no layer_types.
GEMMA3_V4 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 32, "vocab_size": 100, "max_position_embeddings": 512, "query_pre_attn_scalar": 32,
             "rope_theta": 500_000.0, "rope_local_base_freq": 5_000.0, "sliding_window": 16,
             "sliding_window_pattern": 4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 100, "max_position_embeddings": 512, "sliding_window": 16}


def _windows_and_ropes(config: ModelConfig) -> tuple[list[int | None], list[tuple[float, float | None]]]:
    ropes = []
    for layer in range(config.num_layers):
        local = layer in config.sliding_window_layers and config.local_rope_theta is not None
        theta, scaling = ((config.local_rope_theta, config.local_rope_scaling) if local
                          else (config.rope_theta, config.rope_scaling))
        ropes.append((theta, None if scaling is None else scaling.factor))
    return [config.layer_sliding_window(i) for i in range(config.num_layers)], ropes


def _hf_windows_and_ropes(text) -> tuple[list[int | None], list[tuple[float, float | None]]]:
    """Per layer, transformers' window (`Gemma*Attention.sliding_window`) and RoPE base and linear factor."""
    windows, ropes = [], []
    for kind in text.layer_types:
        windows.append(text.sliding_window if kind == "sliding_attention" else None)
        params = text.rope_parameters.get(kind, text.rope_parameters)
        ropes.append((params["rope_theta"], params.get("factor") if params["rope_type"] == "linear" else None))
    return windows, ropes


@pytest.mark.parametrize("hf_dict,hf_text", [
    (GEMMA3_V4, lambda: Gemma3TextConfig(**GEMMA3_V4)),
    (GEMMA2, lambda: Gemma2Config(**GEMMA2)),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": RELEASED_4B_TEXT},
     lambda: Gemma3Config(text_config=RELEASED_4B_TEXT).text_config),
], ids=["gemma3-transformers4", "gemma2-without-layer-types", "gemma3-4b-it-text-config"])
def test_layers_windows_and_ropes_are_transformers(hf_dict, hf_text) -> None:
    config, text = ModelConfig.from_hf_dict(hf_dict), hf_text()
    assert _windows_and_ropes(config) == _hf_windows_and_ropes(text)
    assert (config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.max_model_len) == (
        text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim, text.vocab_size, text.max_position_embeddings)
    assert config.attention_scale == text.query_pre_attn_scalar**-0.5
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"


def test_gemma2_soft_caps_default_as_transformers_and_gemma3_has_none() -> None:
    gemma2 = ModelConfig.from_hf_dict(GEMMA2)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)  # Gemma2Config's defaults
    assert ModelConfig.from_hf_dict({**GEMMA2, "final_logit_softcapping": None}).final_logit_softcap is None
    gemma3 = ModelConfig.from_hf_dict(GEMMA3_V4)
    assert (gemma3.attn_logit_softcap, gemma3.final_logit_softcap, gemma3.qk_norm) == (None, None, True)
    assert not gemma2.qk_norm and gemma2.local_rope_theta is None


@pytest.mark.parametrize("change,named", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"head_dim": "256"}, "head_dim"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"model_type": "gemma3n_text"}, "model_type='gemma3n_text'"),
    ({"laurel_rank": 64}, "laurel_rank"),
])
def test_bad_values_are_refused_by_name(change, named) -> None:
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict({**GEMMA3_V4, **change})


def test_multimodal_config_needs_its_text_config() -> None:
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
