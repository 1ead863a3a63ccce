"""Medusa heads (Cai et al. 2024) in the layout their authors publish (FasterDecoding/Medusa).

A heads directory holds `config.json` with `medusa_num_heads`, `medusa_num_layers`, `hidden_size` and
`vocab_size`, and `medusa_lm_head.safetensors` with head i's residual blocks
`{i}.{l}.linear.weight` / `.bias` (l < medusa_num_layers) and its vocabulary projection `{i}.{L}.weight`
(L = medusa_num_layers, no bias). A block computes `x + SiLU(W x + b)`. Head i reads the target's last hidden
state at position t and predicts the token at t + 2 + i (the target's own head predicts t + 1). The
`.pt` pickle some releases ship is refused: weights load from safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchllm.model.config import ModelConfig

WEIGHTS_FILE = "medusa_lm_head.safetensors"


def read_medusa_config(path: str | Path) -> dict:
    path = Path(path).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_config: the Medusa heads directory {str(path)!r} has no config.json")
    config = json.loads(config_file.read_text())
    missing = [key for key in ("medusa_num_heads", "hidden_size", "vocab_size") if key not in config]
    if missing:
        raise ValueError(f"speculative_config: {config_file} lacks {missing}: not a Medusa heads config")
    if not (path / WEIGHTS_FILE).is_file():
        found = sorted(p.name for p in path.iterdir())
        raise ValueError(f"speculative_config: {str(path)!r} has no {WEIGHTS_FILE} (found {found}); pickled .pt "
                         f"heads are not loaded, convert them to safetensors")
    return config


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts `[N, num_heads]` (long) from last hidden states `[N, H]`."""
        drafts = []
        for blocks, lm_head in zip(self.blocks, self.lm_heads):
            x = hidden
            for block in blocks:
                x = x + nn.functional.silu(block(x))
            drafts.append(lm_head(x).argmax(-1))
        return torch.stack(drafts, dim=1)


def load_medusa_heads(path: str | Path, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                      load_format: str, seed: int) -> MedusaHeads:
    config = read_medusa_config(path)
    heads = MedusaHeads(config["medusa_num_heads"], config.get("medusa_num_layers", 1), target.hidden_size,
                        target.vocab_size)
    if load_format == "dummy":
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in heads.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        return heads.to(device=device, dtype=dtype).eval()
    num_layers = len(heads.blocks[0])
    with safe_open(Path(path).expanduser() / WEIGHTS_FILE, framework="pt") as f:
        names = set(f.keys())
        with torch.no_grad():
            for i, (blocks, lm_head) in enumerate(zip(heads.blocks, heads.lm_heads)):
                for layer, block in enumerate(blocks):
                    block.weight.copy_(_read(f, names, f"{i}.{layer}.linear.weight", block.weight.shape))
                    block.bias.copy_(_read(f, names, f"{i}.{layer}.linear.bias", block.bias.shape))
                lm_head.weight.copy_(_read(f, names, f"{i}.{num_layers}.weight", lm_head.weight.shape))
    return heads.to(device=device, dtype=dtype).eval()


def _read(f, names: set[str], name: str, shape: torch.Size) -> torch.Tensor:
    if name not in names:
        raise ValueError(f"speculative_config: {WEIGHTS_FILE} lacks {name!r}")
    tensor = f.get_tensor(name)
    if tensor.shape != shape:
        raise ValueError(f"speculative_config: {WEIGHTS_FILE}'s {name!r} has shape {list(tensor.shape)}, the target "
                         f"model needs {list(shape)}")
    return tensor
