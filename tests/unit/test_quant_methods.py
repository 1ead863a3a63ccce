"""The quantization-method seam (`batchllm/model/quantization/registry.py`): a linear layer takes its method by the
name in its `quant_config`, so a method registered from outside changes what the layer computes without any
change to the layers or the loader; an unknown name is refused, naming the registered ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from batchllm.model.layers.linear import MergedColumnLinear, RowLinear
from batchllm.model.loader import load_checkpoint_weights
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.quantization.registry import LINEAR_METHODS
from batchllm.model.quantization.unquantized import UnquantizedLinearMethod


class TimesTwo(UnquantizedLinearMethod):
    """Holds the checkpoint's weight as it is and multiplies by twice it."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, 2 * layer.weight, bias)


class TinyMLP(nn.Module):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(2, [1, 1], bias=True, quant_config=quant_config)
        self.down_proj = RowLinear(2, 2, bias=False, quant_config=quant_config)


def test_an_unknown_method_is_refused_naming_it_and_the_registered_ones():
    with pytest.raises(ValueError, match=r"'nf4' has no linear method; registered: 'unquantized', 'fp8', 'int'"):
        RowLinear(8, 4, bias=False, quant_config=QuantConfig("nf4"))


def test_a_method_registered_outside_the_layers_changes_their_output(tmp_path, monkeypatch):
    monkeypatch.setitem(LINEAR_METHODS, "times_two", TimesTwo)
    save_file({"gate_proj.weight": torch.tensor([[1.0, 2.0]]), "gate_proj.bias": torch.tensor([0.5]),
               "up_proj.weight": torch.tensor([[3.0, -1.0]]), "up_proj.bias": torch.tensor([-1.0]),
               "down_proj.weight": torch.tensor([[1.0, 0.0], [2.0, 1.0]])}, tmp_path / "model.safetensors")
    mlp = TinyMLP(QuantConfig("times_two"))
    assert isinstance(mlp.down_proj.quant_method, TimesTwo)
    load_checkpoint_weights(mlp, tmp_path, SimpleNamespace(tie_word_embeddings=False, architecture="TinyMLP"))
    x = torch.tensor([[1.0, 1.0]])
    # gate: 2 * (1 + 2) + 0.5, up: 2 * (3 - 1) - 1; down of (a, b): 2 * (a, 2a + b).
    assert mlp.gate_up_proj(x).tolist() == [[6.5, 3.0]]
    assert mlp.down_proj(torch.tensor([[6.5, 3.0]])).tolist() == [[13.0, 32.0]]
    unquantized = TinyMLP(None)
    load_checkpoint_weights(unquantized, tmp_path, SimpleNamespace(tie_word_embeddings=False, architecture="TinyMLP"))
    assert unquantized.gate_up_proj(x).tolist() == [[3.5, 1.0]]
