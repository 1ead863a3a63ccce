"""Reading FP8 checkpoint tensors: every format becomes an E4M3 weight with one float32 scale per output row.

The FP8 linear method (`fp8_method.py`) asks `fp8_weight` for each weight of an FP8 linear layer, whole, with a
reader for the checkpoint's other tensors (the scales may sit in another file). Scales themselves (`weight_scale`,
`weight_scale_inv`, `input_scale`) are consumed here, never loaded as parameters: activations are always
quantized per token on the fly, so a static `input_scale` is not used. KV-cache scales go to the attention
layers (`kv_scale_target`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchllm.model.quantization import COMPRESSED_TENSORS, FP8_BLOCK, FP8_PER_TENSOR, QuantConfig
from batchllm.model.quantization.fp8 import FP8_DTYPE, dequantize_blocks, quantize_fp8_per_channel

# Checkpoint name endings of per-layer KV-cache scales (vLLM / HF, and older llm-compressor) → our attribute.
_KV_SCALES = {
    "self_attn.k_scale": "k_scale", "self_attn.v_scale": "v_scale",
    "self_attn.k_proj.output_scale": "k_scale", "self_attn.v_proj.output_scale": "v_scale",
}


def fp8_weight(name: str, weight: torch.Tensor, read: Callable[[str], torch.Tensor],
               config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [out, in] E4M3, scale [out] float32)` for the checkpoint weight `name`. A weight stored unquantized
    (a bf16 checkpoint with `quantization="fp8"`, or a layer a quantized checkpoint left out) is quantized
    here; `read(tensor_name)` returns another checkpoint tensor or raises KeyError naming it."""
    if weight.dtype != FP8_DTYPE:
        # Integer or other 8-bit codes (an INT8 or E5M2 tensor) are no values to quantize: their scales are not read.
        if not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
            raise ValueError(f"is {str(weight.dtype).removeprefix('torch.')}; an FP8 checkpoint's weights are read "
                             f"as float8_e4m3fn, or as bf16/fp16/fp32 for a layer it left unquantized")
        return quantize_fp8_per_channel(weight)
    prefix = name.removesuffix("weight")
    if config.checkpoint_format == FP8_BLOCK:
        assert config.block_shape is not None
        return quantize_fp8_per_channel(dequantize_blocks(weight, read(prefix + "weight_scale_inv"),
                                                          config.block_shape))
    if config.checkpoint_format not in (COMPRESSED_TENSORS, FP8_PER_TENSOR):
        raise ValueError("holds an FP8 tensor, but config.json has no quantization_config saying how it is scaled")
    scale = read(prefix + "weight_scale").float().reshape(-1)
    rows = weight.shape[0]
    if scale.numel() == 1:  # per tensor: the same scale on every row is exactly the same arithmetic
        scale = scale.expand(rows)
    elif scale.numel() != rows:
        raise ValueError(f"weight_scale has {scale.numel()} values; expected 1 (per tensor) or {rows} (per channel)")
    return weight, scale.contiguous()


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """`model.layers.3.self_attn.k_scale` → (`model.layers.3.self_attn.attn`, "k_scale"); None for other names."""
    for ending, attribute in _KV_SCALES.items():
        if name.endswith("." + ending):
            return name[: -len(ending)] + "self_attn.attn", attribute
    return None
