"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) config.json, read as transformers' Phi3Config reads it (torch-free).

What differs from Llama's reading: LongRoPE scaling (`longrope`; older configs say `su`, and transformers also
renames `yarn` to it for this family) with per-dimension `short_factor` / `long_factor`, the pretraining length
`original_max_position_embeddings` beside the config's top level, a rotated fraction of each head
(`partial_rotary_factor`, Phi-4-mini: 0.75), one `sliding_window` on every layer when set, no biases.
"""

from __future__ import annotations

import math
from typing import Any

from batchllm.model.config import ModelConfig, RopeScaling, check_window, parse_rope, required

# Phi3Config's defaults for the keys a config.json may leave out.
_DEFAULT_ORIGINAL_MAX_POSITIONS = 4096
_DEFAULT_RMS_NORM_EPS = 1e-5
_LONGROPE_SPELLINGS = ("longrope", "su", "yarn")


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    architecture = (hf.get("architectures") or ["Phi3ForCausalLM"])[0]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{architecture}: only hidden_act='silu' is supported, got {hf['hidden_act']!r}")
    hidden_size, num_heads = required(hf, "hidden_size"), required(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or hidden_size // num_heads
    num_layers = required(hf, "num_hidden_layers")
    max_positions = required(hf, "max_position_embeddings")
    rotary_dim = _rotary_dim(hf, head_dim)
    rope_theta, rope_scaling = _parse_rope(hf, rotary_dim, max_positions)
    window = hf.get("sliding_window")
    if window is not None:
        check_window(window)
    eos = hf.get("eos_token_id", 32000)
    return ModelConfig(
        architecture=architecture,
        hidden_size=hidden_size,
        intermediate_size=required(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        vocab_size=required(hf, "vocab_size"),
        rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        max_model_len=max_positions,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # transformers' Phi-3 windows every layer with the one `sliding_window` when the config sets it.
        sliding_window=window,
        sliding_window_layers=frozenset(range(num_layers)) if window is not None else frozenset(),
        bos_token_id=hf.get("bos_token_id", 1),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        dtype=hf.get("dtype") or hf.get("torch_dtype"),
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
    )


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def _rotary_dim(hf: dict[str, Any], head_dim: int) -> int:
    """`int(head_dim * partial_rotary_factor)`; transformers 5 moves the factor into `rope_parameters`."""
    factor = _rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"config.json partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"config.json partial_rotary_factor={factor} rotates {rotary_dim} of head_dim={head_dim} "
                         f"dimensions; rotary embedding needs a positive even number")
    return rotary_dim


def _parse_rope(hf: dict[str, Any], rotary_dim: int, max_positions: int) -> tuple[float, RopeScaling | None]:
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return parse_rope(hf)
    if rope_type not in _LONGROPE_SPELLINGS:
        raise ValueError(f"Phi3ForCausalLM: rope type {rope_type!r} is not supported (supported: default, longrope, "
                         f"su)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    # Like transformers: the top-level original length wins over the one in the rope parameters.
    original = hf.get("original_max_position_embeddings",
                      params.get("original_max_position_embeddings", _DEFAULT_ORIGINAL_MAX_POSITIONS))
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:
        raise ValueError(f"config.json original_max_position_embeddings must be a number of positions > 1, "
                         f"got {original!r}")
    short, long = (_factor_list(params, key, rotary_dim) for key in ("short_factor", "long_factor"))
    # Without `factor`, transformers scales by the context extension; the attention factor follows from it.
    factor = _positive_number(params, "factor", max_positions / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _positive_number(params, "attention_factor", None)
    return theta, RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                              short_factor=short, long_factor=long, attention_factor=attention_factor)


def _factor_list(params: dict[str, Any], key: str, rotary_dim: int) -> tuple[float, ...]:
    values = params.get(key)
    if (not isinstance(values, list) or len(values) != rotary_dim // 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)):
        got = f"{len(values)} values" if isinstance(values, list) else repr(values)
        raise ValueError(f"config.json rope_scaling {key} must be a list of {rotary_dim // 2} positive numbers "
                         f"(one per rotated frequency: rotary dims / 2), got {got}")
    return tuple(float(v) for v in values)


def _positive_number(params: dict[str, Any], key: str, default: float | None) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json rope_scaling {key} must be a positive number, got {value!r}")
    return float(value)
