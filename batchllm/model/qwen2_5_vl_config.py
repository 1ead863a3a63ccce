"""Qwen2.5-VL hyper-parameters from an HF `config.json`: the language model is Qwen2's with multimodal RoPE.

transformers 5 writes the language model's settings under `text_config` and the vision tower's under
`vision_config`; checkpoints written by transformers 4 (the released ones) keep the text settings at the top level
and spell the RoPE `rope_scaling: {"type": "mrope", "mrope_section": [...]}`. Both read the same.
`VisionTowerConfig`: the vision tower's settings (model/qwen2_5_vl_vision.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchllm.model.config import ModelConfig, required
from batchllm.multimodal.spec import VisionSpec

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
_TEXT_ONLY_KEYS = ("architectures", "text_config", "vision_config", "model_type")


def parse_config(hf: dict[str, Any]) -> ModelConfig:
    text = {k: v for k, v in hf.items() if k not in _TEXT_ONLY_KEYS}
    nested = hf.get("text_config") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"config.json text_config must be an object, got {nested!r}")
    text.update(nested)
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    section = rope.pop("mrope_section", None)
    if rope.get("rope_type", rope.get("type")) == "mrope":  # transformers 4's name for default RoPE + sections
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text["rope_parameters"] = rope
    config = ModelConfig.from_hf_dict({**text, "architectures": ["Qwen2ForCausalLM"]})
    head_half = (config.rotary_dim or config.head_dim) // 2
    if not section or sum(section) != head_half or any(not isinstance(s, int) or s < 0 for s in section):
        raise ValueError(f"config.json rope mrope_section must be non-negative integers summing to head_dim / 2 = "
                         f"{head_half}, got {section!r}")
    vision = required(hf, "vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"config.json vision_config must be an object, got {vision!r}")
    spec = VisionSpec("qwen2_5_vl", int(required(hf, "image_token_id")), vision,
                      int(vision.get("spatial_merge_size", 2)))
    return dataclasses.replace(config, architecture=ARCHITECTURE, mrope_section=tuple(section), vision=spec)


@dataclasses.dataclass(frozen=True)
class VisionTowerConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, vision_config: dict[str, Any]) -> VisionTowerConfig:
        """Defaults are transformers' `Qwen2_5_VLVisionConfig`'s; the released checkpoints spell the channel
        count `in_chans`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vision_config.items() if k in fields}
        if "in_channels" not in values and "in_chans" in vision_config:
            values["in_channels"] = vision_config["in_chans"]
        missing = [name for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
                   if name not in values]
        if missing:
            raise ValueError(f"config.json vision_config lacks {', '.join(missing)}")
        if "fullatt_block_indexes" in values:
            values["fullatt_block_indexes"] = tuple(int(i) for i in values["fullatt_block_indexes"])
        config = cls(**values)
        if config.hidden_act != "silu":
            raise ValueError(f"config.json vision_config hidden_act must be 'silu', got {config.hidden_act!r}")
        if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
            raise ValueError(f"config.json vision_config hidden_size {config.hidden_size} must split into "
                             f"num_heads {config.num_heads} heads of a size divisible by 4 (2-D rotary)")
        if config.window_size % (config.patch_size * config.spatial_merge_size):
            raise ValueError(f"config.json vision_config window_size {config.window_size} must be a multiple of "
                             f"patch_size * spatial_merge_size")
        return config
