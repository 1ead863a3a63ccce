"""A quantized checkpoint's `quantization_config` (config.json) → `QuantConfig`, refusing what we do not read.

Each producer's keys, as written:
- HF / vLLM FP8: `quant_method: "fp8"`, optional `weight_block_size`.
- GPTQ (AutoGPTQ, GPTQModel, optimum): `bits`, `group_size` (-1: per channel), `desc_act`, `sym`,
  `checkpoint_format` ("gptq": zero points stored minus one, the default of older checkpoints; "gptq_v2").
- AWQ (AutoAWQ): `bits` / `w_bit`, `group_size` / `q_group_size`, `zero_point`, `version` ("gemm").
- compressed-tensors (llm-compressor): `config_groups` of `weights` / `input_activations` schemes, a `format`
  per group or for all; `float-quantized` (FP8) or `pack-quantized` (integer, weight-only).
- MXFP4 (gpt-oss, as transformers' Mxfp4Config writes it): `quant_method: "mxfp4"`, `modules_to_not_convert`
  (the released checkpoints: attention, router, embeddings, lm_head). Only MoE experts are ever MXFP4.

`FORMATS` maps each `quant_method` to its reader; its keys are also the names users pass as `quantization=`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from batchllm.model.quantization.config import (
    AWQ,
    COMPRESSED_TENSORS,
    FP8,
    FP8_BLOCK,
    FP8_PER_TENSOR,
    GPTQ,
    INT,
    MXFP4,
    QuantConfig,
)

SUPPORTED = ("quantization='fp8' (quantize a bf16/fp16/fp32 checkpoint on load); FP8 checkpoints: compressed-tensors "
             "'float-quantized' (8-bit float weights, channel or tensor strategy) or HF quant_method 'fp8' (per-tensor "
             "weight_scale or weight_block_size blocks); 4- and 8-bit integer weight-only checkpoints: GPTQ "
             "(checkpoint_format 'gptq' or 'gptq_v2', any group size, desc_act), AWQ version 'gemm' (4-bit), and "
             "compressed-tensors 'pack-quantized' (group or channel strategy, symmetric or not); MXFP4 MoE experts "
             "(4-bit E2M1 in blocks of 32 with an E8M0 scale): gpt-oss's own checkpoints (quant_method 'mxfp4'), or "
             "quantization='mxfp4' (a bf16/fp16/fp32 MoE checkpoint's experts quantized on load, the other layers "
             "unquantized)")

_INT_BITS = (4, 8)


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """How batchllm reads one config.json `quant_method`, and what `quantization=<that name>` means."""

    read: Callable[[Mapping[str, Any]], QuantConfig]  # its quantization_config → QuantConfig, or ValueError
    unquantized_checkpoint: QuantConfig  # the quantization asked for on a checkpoint without a quantization_config
    # Whether that quantization converts real weights on load; if not (it needs the producer's calibration), it
    # serves random weights only (`load_format="dummy"`, benchmarks).
    quantizes_on_load: bool = False


def checkpoint_quantization(stored: Mapping[str, Any]) -> QuantConfig:
    method = stored.get("quant_method")
    if not isinstance(method, str) or method not in FORMATS:
        raise ValueError(f"the checkpoint's config.json has quantization_config.quant_method={method!r}, which "
                         f"batchllm does not read; supported: {SUPPORTED}")
    return FORMATS[method].read(stored)


def _fp8(stored: Mapping[str, Any]) -> QuantConfig:
    block = stored.get("weight_block_size")
    if block is None:
        return QuantConfig(FP8, FP8_PER_TENSOR)
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"config.json quantization_config.weight_block_size={block!r} must be two positive ints")
    return QuantConfig(FP8, FP8_BLOCK, (block[0], block[1]))


def _refuse(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{what} has {', '.join(problems)}; supported: {SUPPORTED}")


def _int_problems(bits: Any, group_size: Any) -> list[str]:
    problems = []
    if bits not in _INT_BITS:
        problems.append(f"bits={bits!r} (4 and 8 are read)")
    if not (isinstance(group_size, int) and (group_size == -1 or (group_size > 0 and group_size % 8 == 0))):
        problems.append(f"group_size={group_size!r} (-1 or a positive multiple of 8)")
    return problems


def _gptq(stored: Mapping[str, Any]) -> QuantConfig:
    bits, group_size = stored.get("bits"), stored.get("group_size", -1)
    problems = _int_problems(bits, group_size)
    layout = stored.get("checkpoint_format", "gptq")
    if layout not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format={layout!r} (an exllama / marlin / bitblas-only layout)")
    if stored.get("lm_head"):
        problems.append("a quantized lm_head")
    if stored.get("dynamic"):
        problems.append("per-module 'dynamic' overrides")
    _refuse("the GPTQ quantization_config", problems)
    return QuantConfig(INT, GPTQ, bits=bits, group_size=group_size, act_order=bool(stored.get("desc_act")),
                       zero_plus_one=layout == "gptq")


def _awq(stored: Mapping[str, Any]) -> QuantConfig:
    bits = stored.get("bits", stored.get("w_bit"))
    group_size = stored.get("group_size", stored.get("q_group_size", -1))
    problems = _int_problems(bits, group_size)
    if bits == 8:
        problems.append("8-bit weights (AutoAWQ's GEMM layout is 4-bit)")
    version = str(stored.get("version", "gemm")).lower()
    if version != "gemm":
        problems.append(f"version={version!r} (only the 'gemm' packing is read)")
    if not stored.get("zero_point", True):
        problems.append("zero_point=false")
    _refuse("the AWQ quantization_config", problems)
    return QuantConfig(INT, AWQ, bits=bits, group_size=group_size)


def _compressed_tensors(stored: Mapping[str, Any]) -> QuantConfig:
    kv_scheme = stored.get("kv_cache_scheme")
    if kv_scheme is not None and (kv_scheme.get("type") != "float" or kv_scheme.get("num_bits") != 8):
        raise ValueError(f"compressed-tensors kv_cache_scheme has {kv_scheme.get('num_bits')}-bit "
                         f"{kv_scheme.get('type')} KV; supported: 8-bit float (E4M3) KV scales, used with "
                         f"kv_cache_dtype='fp8'")
    groups = stored.get("config_groups") or {}
    if not groups:
        raise ValueError(f"compressed-tensors quantization_config has no config_groups; supported: {SUPPORTED}")
    configs = {_compressed_tensors_group(name, group, group.get("format") or stored.get("format"))
               for name, group in groups.items()}
    if len(configs) > 1:
        raise ValueError(f"compressed-tensors config_groups {sorted(groups)} quantize layers differently; supported: "
                         f"one scheme for every quantized layer")
    return configs.pop()


def _compressed_tensors_group(name: str, group: Mapping[str, Any], fmt: Any) -> QuantConfig:
    weights = group.get("weights") or {}
    activations = group.get("input_activations")
    what = f"compressed-tensors config group {name!r}"
    if fmt == "pack-quantized":
        strategy = weights.get("strategy")
        group_size = weights.get("group_size") if strategy == "group" else -1
        problems = _int_problems(weights.get("num_bits"), group_size)
        if weights.get("type") != "int":
            problems.append(f"{weights.get('type')} weights")
        if strategy not in ("group", "channel"):
            problems.append(f"weight strategy {strategy!r}")
        if activations is not None:
            problems.append("quantized activations (weight-only schemes such as W4A16 are read)")
        actorder = weights.get("actorder")
        if actorder not in (None, "static", "weight", "group", "dynamic"):
            problems.append(f"actorder={actorder!r}")
        _refuse(what, problems)
        # Only "group" (alias "dynamic") act-order stores a per-feature g_idx; "weight" keeps groups contiguous.
        return QuantConfig(INT, COMPRESSED_TENSORS, bits=weights["num_bits"], group_size=group_size,
                           act_order=actorder in ("group", "dynamic"))
    problems = []
    if fmt != "float-quantized":
        problems.append(f"format {fmt!r}")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        problems.append(f"{weights.get('num_bits')}-bit {weights.get('type')} weights")
    if weights.get("strategy") not in ("channel", "tensor"):
        problems.append(f"weight strategy {weights.get('strategy')!r}")
    if not weights.get("symmetric", True):
        problems.append("asymmetric weights")
    if activations is not None and (activations.get("type") != "float" or activations.get("num_bits") != 8):
        problems.append(f"{activations.get('num_bits')}-bit {activations.get('type')} activations")
    _refuse(what, problems)
    return QuantConfig(FP8, COMPRESSED_TENSORS)


# The module names an MXFP4 checkpoint may leave unconverted: transformers only ever converts gpt-oss's experts,
# so these (and norms) change nothing; an entry naming anything else may name experts stored otherwise.
_MXFP4_UNCONVERTED = re.compile(r"(^|[.*])(self_attn|router|embed_tokens|lm_head|[a-z_]*norm)([.*]|$)")


def _mxfp4(stored: Mapping[str, Any]) -> QuantConfig:
    kept = stored.get("modules_to_not_convert") or []
    if not isinstance(kept, list | tuple) or not all(isinstance(name, str) for name in kept):
        raise ValueError(f"config.json quantization_config.modules_to_not_convert={kept!r} must be a list of names")
    others = [name for name in kept if "expert" in name or not _MXFP4_UNCONVERTED.search(name)]
    if others:
        raise ValueError(f"the MXFP4 quantization_config leaves {others!r} unconverted (modules_to_not_convert); "
                         f"batchllm reads MXFP4 checkpoints whose experts are all MXFP4, leaving only attention, "
                         f"the router, the embeddings and lm_head unconverted")
    return QuantConfig(MXFP4, MXFP4)


_RANDOM_INT = QuantConfig(INT)  # 4-bit, groups of 128, symmetric
FORMATS: dict[str, CheckpointFormat] = {
    "fp8": CheckpointFormat(_fp8, QuantConfig(FP8), quantizes_on_load=True),
    "gptq": CheckpointFormat(_gptq, _RANDOM_INT),
    "awq": CheckpointFormat(_awq, _RANDOM_INT),
    "compressed-tensors": CheckpointFormat(_compressed_tensors, _RANDOM_INT),
    # Experts quantized on load by rounding to nearest (quantization/mxfp4.py); every other layer unquantized.
    "mxfp4": CheckpointFormat(_mxfp4, QuantConfig(MXFP4), quantizes_on_load=True),
}
QUANTIZATION_METHODS = tuple(FORMATS)
