"""PEFT LoRA adapters read from disk and checked against the base model, before any generation.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors` with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A is `[r, in]`, B is
`[out, r]`, and the delta of a module is `scaling * x A^T B^T` with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`); `rank_pattern` / `alpha_pattern` give the modules whose names match a
pattern (PEFT's rule: the regex matches the name's end, after a dot) their own r / lora_alpha, as PEFT 0.22 writes
for fused gate/up modules. Only what this engine applies exactly is accepted: plain LoRA on q/k/v/o/gate/up/down,
no bias, no DoRA, no `modules_to_save`. A model whose checkpoint fuses q/k/v or gate/up (Phi-3: `qkv_proj`,
`gate_up_proj`) has adapters on the fused modules: one A, and B's rows cut into the parts, which is the same delta
on each part.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from batchllm.lora.request import LoRARequest
from batchllm.model.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Groups: the module's name in the base model (what PEFT's patterns match), its layer, the module, the half.
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter this engine cannot apply; the message names it."""


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter's weights on the CPU: `weights[(layer, module)] = (A [r, in], B [out, r] * scaling)`."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA target module of the base model, unsharded."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, m = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}


def load_adapter(request: LoRARequest, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter of `request`; raises LoRAError naming it."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    path = Path(request.lora_path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise LoRAError(f"{where}: {file.name} is missing (a PEFT adapter directory holds adapter_config.json "
                            f"and adapter_model.safetensors)")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{where}: adapter_config.json cannot be read: {exc}") from None
    rank_of, scaling_of = _check_settings(settings, where, max_rank)
    shapes = module_shapes(config)
    for fused, parts in FUSED_MODULES.items():
        shapes[fused] = (sum(shapes[part][0] for part in parts), shapes[parts[0]][1])
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}  # each module's name in the base model, which the patterns match
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's "
                            f"{'/'.join(MODULES)}")
        name, layer, module, half = match[1], int(match[2]), match[3], match[4]
        if module not in shapes:
            raise LoRAError(f"{where}: targets {module!r}; LoRA applies to {', '.join((*MODULES, *FUSED_MODULES))} "
                            f"only")
        if layer >= config.num_layers:
            raise LoRAError(f"{where}: has layer {layer}, the model has {config.num_layers} (another architecture?)")
        out_size, in_size = shapes[module]
        rank = rank_of(name)
        expected = (rank, in_size) if half == "A" else (out_size, rank)
        if tuple(tensor.shape) != expected:
            raise LoRAError(f"{where}: {key} has shape {tuple(tensor.shape)}, the model needs {expected} "
                            f"(another architecture?)")
        halves.setdefault((layer, module), {})[half] = tensor.float()
        names[(layer, module)] = name
    weights = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} without its other half")
        scaling = scaling_of(names[(layer, module)])
        if module not in FUSED_MODULES:
            weights[(layer, module)] = (pair["A"], pair["B"] * scaling)
            continue
        parts = FUSED_MODULES[module]
        rows = pair["B"].split([shapes[part][0] for part in parts])
        for part, b in zip(parts, rows, strict=True):
            if (layer, part) in halves:
                raise LoRAError(f"{where}: layer {layer} has both {module} and {part}")
            weights[(layer, part)] = (pair["A"], b * scaling)
    if not weights:
        raise LoRAError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(request.lora_name, max(a.shape[0] for a, _ in weights.values()), weights)


def _check_settings(settings: dict, where: str, max_rank: int
                    ) -> tuple[Callable[[str], int], Callable[[str], float]]:
    """The adapter's rank and scaling of a module, by its name in the base model."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {settings.get('peft_type')!r} is not LORA")
    refused = {"modules_to_save": "modules_to_save (fully trained copies of modules)",
               "use_dora": "use_dora (DoRA)", "layers_to_transform": "layers_to_transform"}
    for field, what in refused.items():
        if settings.get(field):
            raise LoRAError(f"{where}: {what} is not supported")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={settings['bias']!r} is not supported (only 'none')")
    if settings.get("fan_in_fan_out"):
        raise LoRAError(f"{where}: fan_in_fan_out is not supported")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    rank_pattern, alpha_pattern = settings.get("rank_pattern") or {}, settings.get("alpha_pattern") or {}
    for field, value in (("r", rank), *((f"rank_pattern[{key!r}]", r) for key, r in rank_pattern.items())):
        if not isinstance(value, int) or value < 1:
            raise LoRAError(f"{where}: {field} must be a positive int, got {value!r}")
        if value > max_rank:
            what = f"rank {value}" if field == "r" else f"{field} = {value}"
            raise LoRAError(f"{where}: {what} is above max_lora_rank={max_rank}; raise max_lora_rank")

    def rank_of(name: str) -> int:
        return _by_pattern(rank_pattern, name, rank)

    def scaling_of(name: str) -> float:
        module_rank, module_alpha = rank_of(name), _by_pattern(alpha_pattern, name, alpha)
        return module_alpha / (math.sqrt(module_rank) if settings.get("use_rslora") else module_rank)

    return rank_of, scaling_of


def _by_pattern(patterns: dict, name: str, default):
    """PEFT's rule: the first pattern that matches the end of a module's name (after a dot, or all of it)."""
    return next((value for key, value in patterns.items() if re.match(rf"(.*\.)?({key})$", name)), default)


def write_random_adapter(directory: Path, config: ModelConfig, rank: int, seed: int, scale: float,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """A PEFT LoRA directory of `rank` on every projection of `config`'s model, A and B drawn from
    N(0, scale²): the adapters of random-weight runs (`load_format="dummy"`), for benchmarks and GPU tests."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out_size, in_size) in module_shapes(config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_size, generator=gen) * scale).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_size, rank, generator=gen) * scale).to(dtype)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                "bias": "none", "task_type": "CAUSAL_LM"}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory
