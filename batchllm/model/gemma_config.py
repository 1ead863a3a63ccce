"""Gemma 2 and Gemma 3 (text) hyper-parameters from an HF `config.json`, read as transformers reads them.

Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`) keep the language model's settings in
`text_config`, and the released ones leave most of them out (gemma-3-4b-it names only the hidden sizes, the
layer count, the window and the RoPE scaling): the rest are transformers' `Gemma3TextConfig` defaults, which
`_GEMMA3_TEXT_DEFAULTS` repeats. Only the text model is served; the vision tower is not read.
"""

from __future__ import annotations

from typing import Any

from batchllm.model.config import ModelConfig, RopeScaling, check_window, parse_rope, required
from batchllm.multimodal.spec import VisionSpec

_GEMMA2 = "Gemma2ForCausalLM"
_GEMMA3 = "Gemma3ForCausalLM"
_GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"
_MODEL_TYPES = {_GEMMA2: ("gemma2",), _GEMMA3: ("gemma3_text", "gemma3"), _GEMMA3_MULTIMODAL: ("gemma3_text",)}

# transformers' Gemma2Config / Gemma3TextConfig defaults for the switches a config.json may leave out.
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "rope_theta": 10000.0,
}
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6, "eos_token_id": 1, "bos_token_id": 2,
}
# Switches of Gemma 3n (altup, laurel, per-layer inputs, KV sharing) and of encoder variants, which this model
# does not implement: a config that sets one is refused rather than served wrongly.
_UNSUPPORTED_SWITCHES = ("use_bidirectional_attention", "altup_num_inputs", "laurel_rank",
                         "hidden_size_per_layer_input", "num_kv_shared_layers", "activation_sparsity_pattern")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a Gemma2ForCausalLM, Gemma3ForCausalLM or Gemma3ForConditionalGeneration config."""
    architecture = (hf.get("architectures") or [None])[0]
    if architecture not in _MODEL_TYPES:
        raise ValueError(f"config.json architectures={hf.get('architectures')!r}: the Gemma family serves "
                         f"{', '.join(_MODEL_TYPES)}")
    multimodal = architecture == _GEMMA3_MULTIMODAL
    text = required(hf, "text_config") if multimodal else hf
    if not isinstance(text, dict):
        raise ValueError(f"config.json text_config must be an object, got {text!r}")
    model_type = text.get("model_type", _MODEL_TYPES[architecture][0])
    if model_type not in _MODEL_TYPES[architecture]:
        raise ValueError(f"config.json {'text_config.' if multimodal else ''}model_type={model_type!r} is not "
                         f"{architecture}'s text model ({' or '.join(map(repr, _MODEL_TYPES[architecture]))})")
    is_gemma2 = architecture == _GEMMA2
    text = {**(_GEMMA2_DEFAULTS if is_gemma2 else _GEMMA3_TEXT_DEFAULTS), **text}
    for switch in _UNSUPPORTED_SWITCHES:
        if text.get(switch):
            raise ValueError(f"config.json {switch}={text[switch]!r} is not supported for {architecture}")
    activation = text.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"config.json hidden_activation={activation!r}: {architecture} supports only "
                         f"'gelu_pytorch_tanh'")
    num_layers = _positive_int(text, "num_hidden_layers")
    max_positions = _positive_int(text, "max_position_embeddings")
    sliding_window, sliding_window_layers = _sliding_windows(text, is_gemma2, num_layers)
    rope_theta, rope_scaling = parse_rope(text) if is_gemma2 else _global_rope(text)
    local_rope_theta, local_rope_scaling = (rope_theta, rope_scaling) if is_gemma2 else _local_rope(text)
    local_differs = (local_rope_theta, local_rope_scaling) != (rope_theta, rope_scaling)
    num_heads = _positive_int(text, "num_attention_heads")
    attention_bias = bool(text.get("attention_bias", False))
    eos = hf.get("eos_token_id", text.get("eos_token_id"))
    return ModelConfig(
        architecture=architecture,
        hidden_size=_positive_int(text, "hidden_size"),
        intermediate_size=_positive_int(text, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=text.get("num_key_value_heads") or num_heads,
        head_dim=_positive_int(text, "head_dim"),
        vocab_size=_positive_int(text, "vocab_size"),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        max_model_len=max_positions,
        # transformers ties a multimodal model's head by the outer config's flag.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,  # Gemma biases o_proj together with q/k/v
        qk_norm=not is_gemma2,
        sliding_window=sliding_window,
        sliding_window_layers=sliding_window_layers,
        bos_token_id=hf.get("bos_token_id", text.get("bos_token_id")),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        dtype=text.get("dtype") or text.get("torch_dtype") or hf.get("dtype") or hf.get("torch_dtype"),
        hidden_act=activation,
        attention_scale=_positive_number(text, "query_pre_attn_scalar") ** -0.5,
        # transformers applies the attention soft-cap in Gemma 2 only (its Gemma 3 attention never passes it on),
        # and the final-logit soft-cap in the causal LMs only (not in Gemma3ForConditionalGeneration): served
        # as transformers serves them, which is what the checkpoints were evaluated with.
        attn_logit_softcap=_optional_positive(text, "attn_logit_softcapping") if is_gemma2 else None,
        final_logit_softcap=None if multimodal else _optional_positive(text, "final_logit_softcapping"),
        local_rope_theta=local_rope_theta if local_differs else None,
        local_rope_scaling=local_rope_scaling if local_differs else None,
        vision=_vision_spec(hf) if multimodal and "vision_config" in hf else None,
    )


def _vision_spec(hf: dict[str, Any]) -> VisionSpec:
    """Gemma 3's image side: SigLIP + the projector read the whole config; each `<start_of_image>` in a prompt becomes
    start, `mm_tokens_per_image` image tokens, end; image tokens attend to each other both ways (transformers'
    `token_type_ids` mask)."""
    def token(*names: str, default: int) -> int:
        return int(next((hf[name] for name in names if hf.get(name) is not None), default))

    return VisionSpec("gemma3", token("image_token_index", "image_token_id", default=262_144), hf,
                      start_token_id=token("boi_token_index", "boi_token_id", default=255_999),
                      end_token_id=token("eoi_token_index", "eoi_token_id", default=256_000),
                      tokens_per_image=int(hf.get("mm_tokens_per_image", 256)), bidirectional=True)


def _sliding_windows(text: dict[str, Any], is_gemma2: bool, num_layers: int) -> tuple[int | None, frozenset[int]]:
    """The window and its layers: those `layer_types` marks `sliding_attention`; without `layer_types`, Gemma 2
    windows the even layers and Gemma 3 every layer but each `sliding_window_pattern`-th (transformers' rule)."""
    window = text["sliding_window"]
    if window is None:
        return None, frozenset()
    check_window(window)
    layer_types = text.get("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != num_layers
                or not set(layer_types) <= set(_LAYER_TYPES)):
            raise ValueError(f"config.json layer_types must name 'full_attention' or 'sliding_attention' for each "
                             f"of the {num_layers} layers, got {layer_types!r}")
        return window, frozenset(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if is_gemma2:
        return window, frozenset(range(0, num_layers, 2))
    pattern = text["sliding_window_pattern"]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"config.json sliding_window_pattern must be a positive number of layers, got {pattern!r}")
    return window, frozenset(i for i in range(num_layers) if (i + 1) % pattern)


def _rope_by_layer_type(text: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5's `rope_parameters` keyed by layer type, or None for the older flat spelling."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(_LAYER_TYPES):
        return params
    return None


def _global_rope(text: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Gemma 3's full-attention layers: `rope_theta` and `rope_scaling`, or `rope_parameters["full_attention"]`."""
    by_type = _rope_by_layer_type(text)
    if by_type is None:
        return parse_rope(text)
    return _parse_layer_type_rope(text, by_type, "full_attention", text["rope_theta"])


def _local_rope(text: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Gemma 3's windowed layers: `rope_local_base_freq` and no scaling, or `rope_parameters["sliding_attention"]`."""
    by_type = _rope_by_layer_type(text)
    if by_type is None:
        return float(_positive_number(text, "rope_local_base_freq")), None
    return _parse_layer_type_rope(text, by_type, "sliding_attention", text["rope_local_base_freq"])


def _parse_layer_type_rope(text: dict[str, Any], by_type: dict[str, Any], layer_type: str,
                           default_theta: float) -> tuple[float, RopeScaling | None]:
    params = by_type.get(layer_type) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json rope_parameters[{layer_type!r}] must be an object, got {params!r}")
    return parse_rope({"rope_parameters": params, "rope_theta": default_theta,
                       "max_position_embeddings": text["max_position_embeddings"]})


def _positive_int(text: dict[str, Any], key: str) -> int:
    value = required(text, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _positive_number(text: dict[str, Any], key: str) -> float:
    value = required(text, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config.json {key} must be a positive number, got {value!r}")
    return float(value)


def _optional_positive(text: dict[str, Any], key: str) -> float | None:
    return None if text.get(key) is None else _positive_number(text, key)
