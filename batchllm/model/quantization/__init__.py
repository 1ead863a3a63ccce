"""Which quantization a model runs with: asked for by the user, or detected from a checkpoint's config.json.

Three kinds of quantized weights:

- FP8 (E4M3) weights with per-output-channel scales and activations quantized per token on the fly
  (`fp8.py`): quantized on load from a bf16/fp16/fp32 checkpoint (`quantization="fp8"`), or read from
  llm-compressor / compressed-tensors `float-quantized` (e.g. FP8_DYNAMIC), HF / vLLM `quant_method: "fp8"`
  with a per-tensor `weight_scale`, or HF fine-grained FP8 with 128 x 128 `weight_scale_inv` blocks
  (dequantized and quantized again per output channel on load).
- 4- and 8-bit integer weights with 16-bit activations (W4A16, `int_packed.py`), read from GPTQ (AutoGPTQ /
  GPTQModel), AWQ (AutoAWQ GEMM) and compressed-tensors `pack-quantized` checkpoints (`formats.py` parses
  their quantization_config, `int_checkpoint.py` their tensors).
- MXFP4 MoE experts (E2M1 codes, one E8M0 scale per 32 weights; `mxfp4.py`, `experts.py`): gpt-oss's
  checkpoints, or quantized on load (`quantization="mxfp4"`); the model's other layers stay unquantized.

The model constructor takes the resolved `QuantConfig` and passes it to each linear layer it builds, which takes
its `QuantMethod` from `registry.py` (`method.py` is the interface; `unquantized.py`, `fp8_method.py` and
`int_method.py` the methods; `formats.py`, `checkpoint.py` and `int_checkpoint.py` the checkpoint readers).
This module stays free of torch: the CLI and job previews resolve configurations without loading a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchllm.model.quantization.config import (
    AWQ,
    COMPRESSED_TENSORS,
    FP8,
    FP8_BLOCK,
    FP8_PER_TENSOR,
    GPTQ,
    INT,
    KV_CACHE_DTYPES,
    MXFP4,
    ON_LOAD,
    QuantConfig,
)
from batchllm.model.quantization.formats import FORMATS, QUANTIZATION_METHODS, SUPPORTED, checkpoint_quantization

__all__ = ["AWQ", "COMPRESSED_TENSORS", "FP8", "FP8_BLOCK", "FP8_PER_TENSOR", "GPTQ", "INT", "KV_CACHE_DTYPES",
           "MXFP4", "ON_LOAD", "QUANTIZATION_METHODS", "SUPPORTED", "QuantConfig", "check_on_load",
           "check_expert_split", "pinned_quantization", "resolve_kv_cache_dtype", "resolve_quantization"]

_MXFP4_BLOCK = 32  # input features per E8M0 scale (kernels/moe_reference.py's MXFP4_BLOCK; this module is torch-free)


def resolve_quantization(hf_config: Mapping[str, Any], requested: str | None) -> QuantConfig | None:
    """The quantization for `LLM(quantization=requested)` on a checkpoint with this config.json; a clear
    ValueError naming what is supported for anything else."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {SUPPORTED}")
    stored = hf_config.get("quantization_config")
    if stored is None:
        # Only random weights can be "quantized" as GPTQ etc. without a checkpoint (benchmarks): real weights
        # need the producer's calibration, so `check_on_load` refuses this for load_format="auto".
        return None if requested is None else FORMATS[requested].unquantized_checkpoint
    quant = checkpoint_quantization(stored)
    stored_method = stored.get("quant_method")
    if requested not in (None, stored_method) and not _converts_to(requested, quant):
        raise ValueError(f"quantization={requested!r}, but the checkpoint's config.json says quant_method="
                         f"{stored_method!r}; pass quantization=None (detected) or {stored_method!r}")
    return quant


def _converts_to(requested: str, quant: QuantConfig) -> bool:
    """A quantization that converts weights on load may be named for a checkpoint already stored in its method
    (quantization='fp8' for a compressed-tensors FP8 checkpoint)."""
    named = FORMATS[requested]
    return named.quantizes_on_load and named.unquantized_checkpoint.method == quant.method


def check_on_load(quant: QuantConfig | None, requested: str | None, load_format: str) -> None:
    """Integer weights come from a quantized checkpoint (or are random, for benchmarks): never from a bf16 one."""
    if (quant is not None and quant.checkpoint_format is ON_LOAD and not FORMATS[requested].quantizes_on_load
            and load_format != "dummy"):
        on_load = " and ".join(f"quantization={name!r}" for name, fmt in FORMATS.items() if fmt.quantizes_on_load)
        raise ValueError(f"quantization={requested!r} reads {requested} checkpoints (config.json with a "
                         f"quantization_config), and this checkpoint is not quantized; quantizing on load is "
                         f"supported for {on_load} only")


def check_expert_split(quant: QuantConfig | None, intermediate_size: int, tensor_parallel_size: int) -> None:
    """MXFP4 experts split over tensor-parallel ranks in whole blocks of 32 of each expert's intermediate features
    (the down projection's input): refused before any process starts otherwise."""
    if quant is not None and quant.method == MXFP4 and (intermediate_size // tensor_parallel_size) % _MXFP4_BLOCK:
        raise ValueError(f"MXFP4 experts split over tensor_parallel_size={tensor_parallel_size} in whole blocks of "
                         f"{_MXFP4_BLOCK}: each rank's share of the experts' {intermediate_size} intermediate "
                         f"features must be a multiple of {_MXFP4_BLOCK} (use a smaller tensor_parallel_size, or "
                         f"enable_expert_parallel=True)")


def pinned_quantization(hf_config: Mapping[str, Any], requested: str | None) -> str | None:
    """What a job manifest pins of `quantization=requested`: the method that quantizes on load, or None for a
    quantized checkpoint (its config.json, which the manifest hashes, says how; naming it changes nothing)."""
    return None if hf_config.get("quantization_config") is not None else requested


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """'auto' (the model dtype) or 'fp8' (E4M3 with per-layer scales); 'fp8_e4m3' is an alias of 'fp8'."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; supported: 'auto' (the model "
                         f"dtype) and 'fp8' (alias 'fp8_e4m3': E4M3 with per-layer scales)")
    return "auto" if kv_cache_dtype == "auto" else "fp8"

