"""The model hyper-parameters we need, parsed once from an HF `config.json`."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchllm.model.moe_config import MoEConfig
    from batchllm.multimodal.spec import VisionSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Checkpoints converted from GGUF (the default model among them) carry `"architectures": null`.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Families whose config.json reads differently from Llama's: the module whose `parse_config(hf) -> ModelConfig`
# reads it (torch-free, like this one). Every other family is read here, the Llama way.
_FAMILY_CONFIG_PARSERS = {
    "Gemma2ForCausalLM": "batchllm.model.gemma_config",
    "Gemma3ForCausalLM": "batchllm.model.gemma_config",
    "Gemma3ForConditionalGeneration": "batchllm.model.gemma_config",
    "Phi3ForCausalLM": "batchllm.model.phi3_config",
    "MixtralForCausalLM": "batchllm.model.moe_config",
    "Qwen2MoeForCausalLM": "batchllm.model.moe_config",
    "Qwen3MoeForCausalLM": "batchllm.model.moe_config",
    "GptOssForCausalLM": "batchllm.model.gpt_oss_config",
    "Qwen2_5_VLForConditionalGeneration": "batchllm.model.qwen2_5_vl_config",
}


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """Frequency scaling on top of plain RoPE. `linear` uses only `factor`; `llama3` uses the low/high frequency
    factors; `longrope` (Phi-3's `su`) the per-dimension `short_factor` / `long_factor` and `attention_factor`;
    `yarn` (gpt-oss) `factor`, the original length, `beta_fast` / `beta_slow`, `truncate` and `attention_factor`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(slots=True)
class ModelConfig:
    """A decoder's shape and numerics (Llama, Mistral, Qwen2/3 read here; Gemma and Phi-3 by their own parsers).

    `max_model_len` is the longest sequence the model serves: `max_position_embeddings`.

    `sliding_window` is the configured window (None: none, or switched off) and `sliding_window_layers` the
    indices of the layers that use it, as HF reads them (`layer_sliding_window` gives one layer's window); the
    hybrid KV cache (engine/kv_groups.py) keeps only the blocks a window still sees.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    max_model_len: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    sliding_window: int | None = None
    sliding_window_layers: frozenset[int] = frozenset()
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str | None = None  # the checkpoint's dtype name, e.g. "bfloat16"
    num_labels: int = 0  # a sequence-classification model's classes (its `score` head's outputs); 0: a causal LM
    # Switches of the families beyond Llama's (Gemma, Phi-3); the defaults are Llama's behaviour.
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    attention_scale: float | None = None  # the score scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_logit_softcap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2)
    attention_sinks: bool = False  # a learned logit per head joins each attention softmax (gpt-oss)
    final_logit_softcap: float | None = None  # likewise the LM head's logits (Gemma 2)
    rotary_dim: int | None = None  # the rotated leading part of each head; None: all of head_dim (Phi-4-mini)
    local_rope_theta: float | None = None  # the RoPE base of windowed layers when it differs (Gemma 3)
    local_rope_scaling: RopeScaling | None = None
    moe: MoEConfig | None = None  # the experts of a Mixture-of-Experts family (moe_config.py); None: dense
    # Multimodal RoPE (Qwen2-VL): the rotated frequencies split into (temporal, height, width) sections, each
    # rotated by its own position component; () for plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # A vision-language model's image side (multimodal/spec.py); None: text only.
    vision: VisionSpec | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `<path>/config.json`."""
        return cls.from_hf_dict(read_hf_config(path))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict, written by transformers 4 (`rope_theta`/`rope_scaling`) or 5 (`rope_parameters`)."""
        architecture = architecture_of(hf)
        parser = _FAMILY_CONFIG_PARSERS.get(causal_lm_of(architecture))
        if parser is not None:
            return importlib.import_module(parser).parse_config(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{architecture}: only hidden_act='silu' is supported, got {hf['hidden_act']!r}")
        hidden_size, num_heads = required(hf, "hidden_size"), required(hf, "num_attention_heads")
        max_positions = required(hf, "max_position_embeddings")
        rope_theta, rope_scaling = parse_rope(hf)
        family = causal_lm_of(architecture)  # a *ForSequenceClassification model is its family's decoder
        num_layers = required(hf, "num_hidden_layers")
        sliding_window, sliding_window_layers = _sliding_window_of(hf, family, num_layers)
        is_qwen2 = family == "Qwen2ForCausalLM"
        attention_bias = True if is_qwen2 else bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=required(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden_size // num_heads,
            vocab_size=required(hf, "vocab_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            max_model_len=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,  # Qwen2 biases q/k/v only
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            sliding_window_layers=sliding_window_layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
            num_labels=(len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels") or 2))
            if family != architecture else 0,
        )


    def layer_sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window, None for full attention. A window no shorter than `max_model_len`
        never hides a key, so it is dropped: such a layer runs the plain kernels."""
        window = self.sliding_window
        if window is None or layer not in self.sliding_window_layers or window >= self.max_model_len:
            return None
        return window


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The raw `config.json` of a model directory."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a model directory must hold an HF config.json")
    return json.loads(config_file.read_text())


def architecture_of(hf: dict[str, Any]) -> str:
    """The HF architecture name (e.g. `LlamaForCausalLM`), inferred from `model_type` when not recorded."""
    architectures = hf.get("architectures")
    if architectures:
        return architectures[0]
    model_type = hf.get("model_type")
    if model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ValueError(f"config.json names no architecture (architectures={architectures!r}, model_type={model_type!r})")


def causal_lm_of(architecture: str) -> str:
    """`Qwen2ForSequenceClassification` → `Qwen2ForCausalLM`: the decoder family a classifier is built on."""
    return architecture.replace("ForSequenceClassification", "ForCausalLM")


def required(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json has no {key!r}; is this a Llama-family causal LM checkpoint?")
    return hf[key]


def check_window(window: object) -> None:
    """config.json's `sliding_window`, when set, is a positive number of positions (every family reads it)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json sliding_window must be a positive number of positions, got {window!r}")


def _sliding_window_of(hf: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, frozenset[int]]:
    """The window and the layers that use it, as transformers reads them (its configuration_*.py defaults
    included): Mistral windows every layer; Qwen2/Qwen3 only with `use_sliding_window`, then the layers that
    `layer_types` marks `sliding_attention` or, without `layer_types`, those from `max_window_layers` on."""
    if family == "MistralForCausalLM":
        window = hf.get("sliding_window", 4096)
    elif family in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    else:
        window = None  # Llama has no window
    if window is None:
        return None, frozenset()
    check_window(window)
    if family == "MistralForCausalLM":
        return window, frozenset(range(num_layers))
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return window, frozenset(range(int(hf.get("max_window_layers", 28)), num_layers))
    if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json layer_types must name 'full_attention' or 'sliding_attention' for each of "
                         f"the {num_layers} layers, got {layer_types!r}")
    return window, frozenset(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    # Older configs spell the type `type`.
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    return theta, RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf["max_position_embeddings"])
        ),
    )
