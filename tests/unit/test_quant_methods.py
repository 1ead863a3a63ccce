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
from batchllm.model.layers.norm import GemmaRMSNorm, RMSNorm, normalize_for
from batchllm.model.loader import load_checkpoint_weights
from batchllm.model.quantization.config import QuantConfig
from batchllm.model.quantization.fp8 import Fp8Rows
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


class NoDelta:
    """An adapter whose delta is zero: what matters is that one reads the layer's 16-bit input."""

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert isinstance(x, torch.Tensor), "an adapter was given FP8 rows"


@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
def test_a_norm_hands_an_fp8_reader_its_output_quantized(norm_class):
    """`normalize_for`: an FP8 linear layer reading a norm gets the norm's output as FP8 rows (on the GPU one fused
    kernel), and computes from them exactly what it computes from the 16-bit output (which fp8_linear quantizes per
    token itself); with an adapter, or an unquantized reader, the norm's 16-bit output (and residual) as before."""
    gen = torch.Generator().manual_seed(5)
    fp8_reader = MergedColumnLinear(64, [24, 24], bias=True, quant_config=QuantConfig("fp8"))
    plain_reader = MergedColumnLinear(64, [24, 24], bias=True, quant_config=None)
    for name, value in fp8_reader.quant_method.quantize_weight(torch.randn(48, 64, generator=gen)).items():
        getattr(fp8_reader, name).data = value
    fp8_reader.bias.data = torch.randn(48, generator=gen)
    norm = norm_class(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    x, residual = torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16)
    norm.to(torch.bfloat16)

    rows = normalize_for(fp8_reader, norm, x)
    assert isinstance(rows, Fp8Rows) and rows.shape == (5, 64) and rows.dtype == torch.bfloat16
    assert torch.equal(fp8_reader(rows), fp8_reader(norm(x)))
    rows, new_residual = normalize_for(fp8_reader, norm, x, residual)
    expected, expected_residual = norm(x, residual)
    assert isinstance(rows, Fp8Rows) and torch.equal(new_residual, expected_residual)
    assert torch.equal(fp8_reader(rows), fp8_reader(expected))

    fp8_reader.lora = NoDelta()
    assert torch.equal(normalize_for(fp8_reader, norm, x), norm(x))
    assert torch.equal(fp8_reader(normalize_for(fp8_reader, norm, x)), fp8_reader(norm(x)))
    for reader in (plain_reader, None):
        out, out_residual = normalize_for(reader, norm, x, residual)
        assert torch.equal(out, expected) and torch.equal(out_residual, expected_residual)
