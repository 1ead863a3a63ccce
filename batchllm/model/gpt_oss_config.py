"""gpt-oss (`GptOssForCausalLM`) config.json, read as transformers' GptOssConfig reads it (torch-free).

What differs from Llama's reading: q/k/v/o biases always, `layer_types` alternating sliding (`sliding_window`,
128 in the released models) and full attention, YaRN RoPE (`rope_type: "yarn"`), and a MoE MLP in every layer
(`num_local_experts`, top-`num_experts_per_tok` of the router's logits then a softmax over those k) whose experts
apply the clamped SwiGLU (`swiglu_limit`). The experts of MXFP4 checkpoints (the released ones, `quantization_config`
read by quantization/formats.py) load through gpt_oss_mxfp4.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchllm.model.config import ModelConfig, RopeScaling, check_window, required
from batchllm.model.moe_config import MoEConfig

# GptOssConfig's defaults for the keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
    "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "rope_theta": 150000.0,
}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# The SwiGLU gain the experts' kernels apply (kernels/moe_reference.py's SWIGLUOAI_ALPHA).
_SUPPORTED_SWIGLU_ALPHA = 1.702


@dataclass(frozen=True, slots=True)
class GptOssMoEConfig(MoEConfig):
    """gpt-oss's experts: MoEConfig's, plus the clamp of their SwiGLU (gate above, up on both sides)."""

    swiglu_limit: float | None = 7.0


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    architecture = (hf.get("architectures") or ["GptOssForCausalLM"])[0]
    hf = {**_DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{architecture}: only hidden_act='silu' is supported, got {hf['hidden_act']!r}")
    if float(hf["swiglu_alpha"]) != _SUPPORTED_SWIGLU_ALPHA:
        raise ValueError(f"config.json swiglu_alpha={hf['swiglu_alpha']!r}: only {_SUPPORTED_SWIGLU_ALPHA} "
                         f"(gpt-oss's) is supported")
    num_layers = required(hf, "num_hidden_layers")
    num_heads, max_positions = required(hf, "num_attention_heads"), required(hf, "max_position_embeddings")
    window, window_layers = _windows(hf, num_layers)
    rope_theta, rope_scaling = _parse_rope(hf, max_positions)
    num_experts, top_k = hf["num_local_experts"], hf["num_experts_per_tok"]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"config.json num_experts_per_tok={top_k} must be in [1, num_local_experts={num_experts}]")
    limit = hf["swiglu_limit"]
    moe = GptOssMoEConfig(num_experts=num_experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=required(hf, "intermediate_size"), norm_topk_prob=True,
                          router_bias=True, expert_bias=True,
                          swiglu_limit=None if limit is None else float(limit))
    eos = hf.get("eos_token_id")
    return ModelConfig(
        architecture=architecture,
        hidden_size=required(hf, "hidden_size"),
        intermediate_size=required(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf["head_dim"],
        vocab_size=required(hf, "vocab_size"),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        max_model_len=max_positions,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", True)),
        o_proj_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=window,
        sliding_window_layers=window_layers,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        dtype=hf.get("dtype") or hf.get("torch_dtype"),
        moe=moe,
    )


def _windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, frozenset[int]]:
    """The window and its layers: `layer_types`, or GptOssConfig's default (even layers sliding, odd full)."""
    window = hf["sliding_window"]
    check_window(window)
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                            for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json layer_types must name 'full_attention' or 'sliding_attention' for each of "
                         f"the {num_layers} layers, got {layer_types!r}")
    return window, frozenset(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def _parse_rope(hf: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """RoPE base and YaRN scaling, with the attention factor (mscale) computed as transformers'
    `_compute_yarn_parameters` does."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or _DEFAULT_ROPE)
    theta = float(params.get("rope_theta", hf["rope_theta"]))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"GptOssForCausalLM: rope type {rope_type!r} is not supported (supported: default, yarn)")
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:
        raise ValueError(f"config.json rope_parameters original_max_position_embeddings must be a number of "
                         f"positions > 1, got {original!r}")
    factor = params.get("factor")
    factor = max_positions / original if factor is None else _positive(params, "factor")
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _positive(params, "attention_factor")
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention_factor = _mscale(factor, float(params["mscale"])) / _mscale(factor, float(params["mscale_all_dim"]))
    else:
        attention_factor = _mscale(factor, 1.0)
    # Like transformers: a missing or zero beta takes the YaRN paper's 32 (fast) / 1 (slow).
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    return theta, RopeScaling("yarn", factor=float(factor), original_max_position_embeddings=original,
                              attention_factor=attention_factor, beta_fast=beta_fast, beta_slow=beta_slow,
                              truncate=bool(params.get("truncate", True)))


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature, Eq. 21 of the paper: `0.1 * mscale * ln(factor) + 1` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _positive(params: dict[str, Any], key: str) -> float:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"config.json rope_parameters {key} must be a positive number, got {value!r}")
    return float(value)
