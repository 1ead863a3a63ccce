"""Writers of 4- and 8-bit integer checkpoints in the layouts their producers write, for test_int4_checkpoints.py.

Written from the producers' own descriptions and code, not from batchllm's reader (batchllm/model/quantization):

- GPTQ, as AutoGPTQ's `QuantLinear.pack` (auto_gptq/nn_modules/qlinear/qlinear_cuda.py) and GPTQModel write it:
  `qweight [K / pack, N]` int32, in-feature k in bits `bits * (k % pack)` of word row `k // pack`
  (`pack = 32 / bits`); `qzeros [G, N / pack]` int32 packed the same way along the out-features; `scales [G, N]`
  fp16; `g_idx [K]` int32, the group of each in-feature. `checkpoint_format` "gptq" (v1) stores `zero - 1`:
  AutoGPTQ subtracts 1 from each zero before packing, GPTQModel subtracts 0x11111111 (4-bit) from each packed
  word, and reads v1 by adding it back (`convert_gptq_v1_to_v2_format_module`); "gptq_v2" stores the zero.
  Weight `w[n, k] = (q[n, k] - zero[g_idx[k], n]) * scale[g_idx[k], n]`. The quantizer is GPTQ's
  `Quantizer.find_params` (round to nearest, no Hessian): the range widened to hold 0; symmetric puts the zero
  at `2**(bits-1)` with scale `2 * absmax / (2**bits - 1)`; asymmetric scale `(max - min) / (2**bits - 1)`, zero
  `round(-min / scale)`. A partial last group (K not a multiple of the group size) is what AutoGPTQ writes
  (`ceil(K / group_size)` groups).
- AWQ GEMM, as AutoAWQ's `WQLinear_GEMM.from_linear` (awq/modules/linear/gemm.py) writes it: `qweight [K, N / 8]`
  int32, nibble i of word j holding out-column `8 j + AWQ_ORDER[i]`; `qzeros [G, N / 8]` the same way; `scales
  [G, N]` fp16; `w = (q - zero) * scale`. The quantizer is AutoAWQ's `pseudo_quantize_tensor` with zero_point:
  scale `(max - min).clamp(1e-5) / 15`, zero `clamp(-round(min / scale), 0, 15)` (no clipping search).
- compressed-tensors pack-quantized: written by the compressed-tensors library itself (`write_compressed_tensors`),
  read back here by `ct_dequantize`, an unpacker of this file's own.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")
# AutoGPTQ 0.7's quantize_config.json fields; GPTQModel adds its own (`gptq_config(..., gptqmodel=True)`).
GPTQ_EXTRA = {"damp_percent": 0.01, "static_groups": False, "true_sequential": True, "model_name_or_path": None,
              "model_file_base_name": "model"}


@dataclass(frozen=True)
class Quantized:
    """One weight `[N, K]` as unsigned codes `[N, K]` (uint8, to keep ten models' worth small), unsigned zero
    points (int64) and scales (as stored) `[G, N]`, and the group of each in-feature `[K]` (int64)."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The test's own float32 `w[n, k] = (q[n, k] - zero[g_k, n]) * scale[g_k, n]`."""
        zeros = self.zeros.index_select(0, self.groups).T
        scales = self.scales.float().index_select(0, self.groups).T
        return (self.codes.long() - zeros).float() * scales


def contiguous_groups(in_features: int, group_size: int) -> tuple[torch.Tensor, int]:
    """`k // group_size` (one group when group_size is -1) and the number of groups, the last maybe partial."""
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features) // size, -(-in_features // size)


def act_order_groups(in_features: int, group_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """GPTQ with desc_act: in-features quantized in the order of a permutation (GPTQ's: descending Hessian
    diagonal; here a seeded random one), and `g_idx[perm[i]] = i // group_size`, so each group's members are
    scattered over the in-features."""
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(in_features, dtype=torch.long)
    groups[perm] = torch.arange(in_features) // group_size
    return groups, -(-in_features // group_size)


def group_min_max(w: torch.Tensor, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) min and max, `[N, G]`, over the in-features of each group."""
    index = groups.expand(w.shape[0], -1)
    low = torch.full((w.shape[0], num_groups), torch.inf).scatter_reduce(1, index, w, "amin")
    high = torch.full((w.shape[0], num_groups), -torch.inf).scatter_reduce(1, index, w, "amax")
    return low, high


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, groups: torch.Tensor,
           maxq: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale[:, groups]) + zero[:, groups], 0, maxq).long()


def quantize_gptq(w: torch.Tensor, groups: torch.Tensor, num_groups: int, bits: int, sym: bool) -> Quantized:
    """GPTQ's `Quantizer.find_params` + round to nearest (see the module docstring); scales stored fp16."""
    maxq = 2**bits - 1
    low, high = group_min_max(w, groups, num_groups)
    low, high = low.clamp(max=0), high.clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = torch.where(low < 0, -high, low)
    empty = (low == 0) & (high == 0)
    low, high = torch.where(empty, -1.0, low), torch.where(empty, 1.0, high)
    scale = (high - low) / maxq
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-low / scale)
    codes = _codes(w, scale, zero, groups, maxq)
    return Quantized(codes.to(torch.uint8), zero.long().T.contiguous(), scale.T.contiguous().half(), groups)


def quantize_awq(w: torch.Tensor, groups: torch.Tensor, num_groups: int) -> Quantized:
    """AutoAWQ's 4-bit zero-point `pseudo_quantize_tensor` (see the module docstring); scales stored fp16."""
    low, high = group_min_max(w, groups, num_groups)
    scale = (high - low).clamp(min=1e-5) / 15
    zero = (-torch.round(low / scale)).clamp(0, 15)
    codes = _codes(w, scale, zero, groups, 15)
    return Quantized(codes.to(torch.uint8), zero.long().T.contiguous(), scale.T.contiguous().half(), groups)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words (any integers, taken modulo 2**32) → the int32 with the same 32 bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_last(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """`[R, C]` codes → `[R, C / pack]` int32: field i (bits `bits * i` up) of word j holds column
    `j * pack + order[i]` (order: identity unless given)."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    rows, cols = values.shape
    assert cols % pack == 0 and int(values.min()) >= 0 and int(values.max()) < 2**bits
    grouped = values.long().reshape(rows, cols // pack, pack)
    words = torch.zeros(rows, cols // pack, dtype=torch.long)
    for i, column in enumerate(order):
        words |= grouped[:, :, column] << (bits * i)
    return to_int32(words)


def unpack_last(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `pack_last`, field by field: `[R, W]` int32 → `[R, W * pack]` int64 codes."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    unsigned = words.long() & 0xFFFFFFFF
    out = torch.empty(words.shape[0], words.shape[1], pack, dtype=torch.long)
    for i, column in enumerate(order):
        out[:, :, column] = (unsigned >> (bits * i)) & (2**bits - 1)
    return out.reshape(words.shape[0], -1)


def gptq_zero_offset(bits: int) -> int:
    """GPTQModel's v2 → v1 constant: 1 in every field of a word (0x11111111 for 4 bits)."""
    return sum(1 << (bits * i) for i in range(32 // bits))


def gptq_tensors(q: Quantized, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """`qweight`, `qzeros`, `scales`, `g_idx` of one linear. v1 subtracts 1 from every packed zero as GPTQModel
    does (word arithmetic modulo 2**32; with every zero >= 1 that is also AutoGPTQ's per-field `zeros -= 1`)."""
    qzeros = pack_last(q.zeros, bits)
    if v1:
        qzeros = to_int32(qzeros.long() - gptq_zero_offset(bits))
    return {"qweight": pack_last(q.codes, bits).T.contiguous(), "qzeros": qzeros,
            "scales": q.scales, "g_idx": q.groups.to(torch.int32)}


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_last(q.codes.T.contiguous(), 4, AWQ_ORDER), "qzeros": pack_last(q.zeros, 4, AWQ_ORDER),
            "scales": q.scales}


def gptq_config(bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq",
                gptqmodel: bool = False) -> dict:
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": checkpoint_format, **GPTQ_EXTRA}
    if gptqmodel:
        config.update({"lm_head": False, "pack_dtype": "int32", "damp_percent": 0.05, "damp_auto_increment": 0.01,
                       "meta": {"quantizer": ["gptqmodel:4.0.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                                "damp_percent": 0.05, "static_groups": False, "true_sequential": True}})
    return config


def awq_config(group_size: int, version: str = "gemm") -> dict:
    """As transformers' AwqConfig / AutoAWQ's `save_quantized` put it in config.json."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": version,
            "modules_to_not_convert": None}


@dataclass
class Case:
    """A checkpoint written once, and the test's own float32 dequantization of each HF linear."""

    directory: Path
    expected: Callable[[str], torch.Tensor]  # HF module name (`model.layers.0.self_attn.q_proj`) → [N, K]
    quantized: dict[str, Quantized] | None = None  # GPTQ / AWQ: what was packed


def linear_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The decoder's HF linears, `model.layers.N.self_attn.q_proj` ..."""
    return sorted(name.removesuffix(".weight") for name in weights
                  if name.endswith(".weight") and name.split(".", 3)[-1].removesuffix(".weight") in LINEAR_PARTS)


def copy_side_files(original: Path, directory: Path) -> None:
    """Tokenizer and generation files of the original (everything but its config and weights)."""
    for path in original.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.startswith("model"):
            shutil.copy(path, directory / path.name)


def write_config(directory: Path, original: Path, quantization_config: dict | None) -> None:
    config = json.loads((original / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_int_checkpoint(directory: Path, original: Path, weights: dict[str, torch.Tensor],
                         quantize: Callable[[str, torch.Tensor], Quantized],
                         pack: Callable[[Quantized], dict[str, torch.Tensor]], quantization_config: dict) -> Case:
    """Every decoder linear's `.weight` replaced by `pack(quantize(name, weight))`; everything else (embeddings,
    norms) kept as it is; config.json with `quantization_config`, and the tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = dict(weights)
    quantized = {}
    for name in linear_names(weights):
        quantized[name] = quantize(name, tensors.pop(f"{name}.weight"))
        tensors.update({f"{name}.{suffix}": t for suffix, t in pack(quantized[name]).items()})
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_config(directory, original, quantization_config)
    copy_side_files(original, directory)
    return Case(directory, lambda name: quantized[name].dequantize(), quantized)


# --- compressed-tensors, written by the library ---------------------------------------------------------------------


def write_compressed_tensors(directory: Path, original: Path, preset: str, strategy: str, group_size: int | None,
                             dtype: torch.dtype = torch.float32) -> Path:
    """What llm-compressor's `oneshot(model, recipe=QuantizationModifier(scheme=preset, ignore=["lm_head"]))` +
    `save_pretrained(save_compressed=True)` does with its min-max observer, minus llm-compressor (as
    test_fp8_checkpoints.py's FP8 writer): the library's preset scheme, `apply_quantization_config`, scales and
    zero points from its `calculate_qparams` over each group's (or row's) min and max, `ModelCompressor` to pack
    the weights and write quantization_config. `dtype` is the model's, which the scales take."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(original, dtype=dtype)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights.strategy, scheme.weights.group_size = strategy, group_size
    apply_quantization_config(hf_model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for module in hf_model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            args = module.quantization_scheme.weights
            weight = module.weight
            if strategy == "group":
                weight = weight.unflatten(-1, (-1, group_size))
            scale, zero_point = calculate_qparams(weight.amin(dim=-1), weight.amax(dim=-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if not args.symmetric:
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(hf_model)
    compressor.compress_model(hf_model)
    hf_model.save_pretrained(directory)
    compressor.update_config(directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    copy_side_files(original, directory)
    return directory


def ct_dequantize(stored: dict[str, torch.Tensor], name: str, bits: int = 4) -> torch.Tensor:
    """This file's own reading of a pack-quantized weight: `weight_packed [N, K / pack]` holds in-feature
    `pack j + i` of row n in field i of word j, as `q + 2**(bits-1)` (signed codes stored unsigned);
    `weight_zero_point [N / pack, G]` holds row `pack r + i` in field i of word r the same way (absent: 0);
    `weight_scale [N, G]`; group of in-feature k `k // (K / G)`; `w = (q - zero) * scale` in float32."""
    rows, cols = (int(v) for v in stored[f"{name}.weight_shape"])
    offset = 2 ** (bits - 1)
    codes = unpack_last(stored[f"{name}.weight_packed"], bits)[:, :cols] - offset
    scale = stored[f"{name}.weight_scale"].float()
    packed_zero = stored.get(f"{name}.weight_zero_point")
    zero = (torch.zeros(scale.shape, dtype=torch.long) if packed_zero is None
            else unpack_last(packed_zero.T.contiguous(), bits).T[:rows] - offset)
    group = torch.arange(cols) // (cols // scale.shape[1])
    return (codes - zero[:, group]).float() * scale[:, group]
