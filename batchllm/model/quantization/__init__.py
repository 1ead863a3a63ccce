"""Which quantization a model runs with: asked for by the user, or detected from a checkpoint's config.json.

One method today, FP8 (E4M3) weights with per-output-channel scales and activations quantized per token on
the fly (`fp8.py`). Checkpoints already quantized to FP8 are read in the formats users have:

- llm-compressor / compressed-tensors `float-quantized` (e.g. FP8_DYNAMIC): `weight` E4M3 and `weight_scale`
  per channel `[out, 1]` or per tensor;
- HF / vLLM `quant_method: "fp8"` with a per-tensor `weight_scale`;
- HF fine-grained `quant_method: "fp8"` with `weight_block_size` (128 x 128 blocks), `weight_scale_inv` per
  block: dequantized and quantized again per output channel on load.

The layers read the configuration while the model is built (`building_with`), the way they read the
tensor-parallel group: the model classes stay free of quantization arguments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# checkpoint_format values
ON_LOAD, COMPRESSED_TENSORS, FP8_PER_TENSOR, FP8_BLOCK = None, "compressed-tensors", "fp8-per-tensor", "fp8-block"
_SUPPORTED = ("fp8 (quantize a bf16/fp16/fp32 checkpoint on load), and FP8 checkpoints in the compressed-tensors "
              "'float-quantized' format (8-bit float weights, channel or tensor strategy) or HF's quant_method "
              "'fp8' (per-tensor weight_scale or weight_block_size blocks)")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: str  # "fp8"
    checkpoint_format: str | None = ON_LOAD  # how quantized tensors are stored; None: the checkpoint is not
    block_shape: tuple[int, int] | None = None  # FP8_BLOCK: (rows, cols) of one weight_scale_inv entry


def resolve_quantization(hf_config: Mapping[str, Any], requested: str | None) -> QuantConfig | None:
    """The quantization for `LLM(quantization=requested)` on a checkpoint with this config.json; a clear
    ValueError naming what is supported for anything else."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {_SUPPORTED}")
    stored = hf_config.get("quantization_config")
    if stored is None:
        return QuantConfig(requested) if requested else None
    return _checkpoint_quantization(stored)


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """'auto' (the model dtype) or 'fp8' (E4M3 with per-layer scales); 'fp8_e4m3' is an alias of 'fp8'."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; supported: 'auto' (the model "
                         f"dtype) and 'fp8' (alias 'fp8_e4m3': E4M3 with per-layer scales)")
    return "auto" if kv_cache_dtype == "auto" else "fp8"


def _checkpoint_quantization(stored: Mapping[str, Any]) -> QuantConfig:
    method = stored.get("quant_method")
    if method == "fp8":
        block = stored.get("weight_block_size")
        if block is None:
            return QuantConfig("fp8", FP8_PER_TENSOR)
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                           for b in block)):
            raise ValueError(f"config.json quantization_config.weight_block_size={block!r} must be two positive ints")
        return QuantConfig("fp8", FP8_BLOCK, (block[0], block[1]))
    if method == "compressed-tensors":
        _check_compressed_tensors(stored)
        return QuantConfig("fp8", COMPRESSED_TENSORS)
    raise ValueError(f"the checkpoint's config.json has quantization_config.quant_method={method!r}, which batchllm "
                     f"does not read; supported: {_SUPPORTED}")


def _check_compressed_tensors(stored: Mapping[str, Any]) -> None:
    kv_scheme = stored.get("kv_cache_scheme")
    if kv_scheme is not None and (kv_scheme.get("type") != "float" or kv_scheme.get("num_bits") != 8):
        raise ValueError(f"compressed-tensors kv_cache_scheme has {kv_scheme.get('num_bits')}-bit "
                         f"{kv_scheme.get('type')} KV; supported: 8-bit float (E4M3) KV scales, used with "
                         f"kv_cache_dtype='fp8'")
    groups = stored.get("config_groups") or {}
    if not groups:
        raise ValueError(f"compressed-tensors quantization_config has no config_groups; supported: {_SUPPORTED}")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or stored.get("format")
        problems = []
        if fmt != "float-quantized":
            problems.append(f"format {fmt!r}")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            problems.append(f"{weights.get('num_bits')}-bit {weights.get('type')} weights")
        if weights.get("strategy") not in ("channel", "tensor"):
            problems.append(f"weight strategy {weights.get('strategy')!r}")
        if not weights.get("symmetric", True):
            problems.append("asymmetric weights")
        activations = group.get("input_activations")
        if activations is not None and (activations.get("type") != "float" or activations.get("num_bits") != 8):
            problems.append(f"{activations.get('num_bits')}-bit {activations.get('type')} activations")
        if problems:
            raise ValueError(f"compressed-tensors config group {name!r} has {', '.join(problems)}; supported: "
                             f"{_SUPPORTED}")


_building: QuantConfig | None = None


@contextmanager
def building_with(config: QuantConfig | None) -> Iterator[None]:
    """Layers constructed inside take `config` (see `current_quantization`)."""
    global _building
    previous, _building = _building, config
    try:
        yield
    finally:
        _building = previous


def current_quantization() -> QuantConfig | None:
    return _building
