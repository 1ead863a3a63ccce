"""FP8 checkpoints of the real default model (SmolLM2-135M-Instruct), written here in each format we read, loaded
with our loader and compared with our quantize-on-load (`quantization="fp8"`) of the same float32 weights.

- compressed-tensors `float-quantized` (llm-compressor's FP8_DYNAMIC), written by the compressed-tensors library
  itself: with the channel strategy it stores exactly what we compute (absmax / 448 per row, x / scale rounded to
  E4M3), so weight bits, scales and logits must be identical; with the tensor strategy the loaded weights must
  dequantize to exactly the stored `weight * weight_scale`.
- HF / vLLM `quant_method: "fp8"` with a per-tensor `weight_scale` (written here in the AutoFP8 / vLLM layout):
  dequantized weights exactly `weight * weight_scale`; logits close to quantize-on-load.
- HF fine-grained `quant_method: "fp8"` with 128 x 128 `weight_scale_inv` blocks (DeepSeek-V3 layout, partial edge
  blocks): within the bound of re-quantizing the block-dequantized weights per channel; logits close.
- KV-cache scales (`self_attn.k_scale` / `v_scale`) land on the attention layers; unsupported quantization
  methods and compressed-tensors schemes are refused with a ValueError naming fp8.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchllm.model.default_model import default_model_path
from batchllm.model.loader import load_model
from tests.unit.test_model_vs_hf import PagedRunner

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# Our fused modules and the HF modules whose rows they hold, in order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
# "Close" for a format whose FP8 weights are rounded differently from our per-channel quantize-on-load (per tensor,
# or blocks re-quantized): FP8 weights and per-token FP8 activations make this small model's logits chaotic (a
# one-ulp float32 difference flips an activation's FP8 rounding and grows layer by layer), so two roundings of the
# same weights are as far apart as FP8 is from float32, and no absolute logit tolerance below whole units holds.
# The bound is relative to that noise floor, measured in the same run: the mean |logit difference| from
# quantize-on-load at most NOISE_RATIO x the mean |quantize-on-load - float32|. Measured over PROMPTS: noise floor
# 0.92; per-tensor and compressed-tensors tensor strategy 1.24x, blocks 1.06x. Scale bugs move it further: every
# layer's v_proj scale x1.25 gives 3.3x, k/v rows scaled with q's scale 10.8x, one layer's gate_up x1.5 7.6x
# (subtler ones hide in the noise: the exact weight checks before each logit check are what catch those).
# compressed-tensors' own fake-quantized forward of the identical FP8_DYNAMIC model is 0.5-0.95 from ours for the
# same reason, though each of its linears, given the same input, matches ours to 2e-7 relative.
NOISE_RATIO = 2.0


def fp8_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """`model.layers.N.self_attn.qkv_proj` ... → module, for every decoder layer."""
    modules = dict(model.named_modules())
    num_layers = len(model.model.layers)
    return {f"model.layers.{n}.{fused}": modules[f"model.layers.{n}.{fused}"]
            for n in range(num_layers) for fused in FUSED}


def hf_parts(fused_name: str) -> list[str]:
    """`model.layers.3.self_attn.qkv_proj` → the HF module names `model.layers.3.self_attn.q_proj`, ..."""
    layer, fused = fused_name.split(".", 3)[2], fused_name.split(".", 3)[3]
    return [f"model.layers.{layer}.{part}" for part in FUSED[fused]]


def dequantized(module: torch.nn.Module) -> torch.Tensor:
    assert module.weight.dtype == FP8 and module.weight_scale.dtype == torch.float32
    assert module.weight_scale.shape == (module.weight.shape[0],)
    return module.weight.float() * module.weight_scale[:, None]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def logits_of(model: torch.nn.Module, config, prompts: list[list[int]]) -> list[torch.Tensor]:
    return PagedRunner(model, config).step([(i, p, 0) for i, p in enumerate(prompts)])


def mean_abs_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return torch.cat([(x - y).abs().flatten() for x, y in zip(a, b, strict=True)]).mean().item()


def assert_logits_close(ours: list[torch.Tensor], on_load) -> None:
    """Within NOISE_RATIO x the FP8 noise floor of quantize-on-load (see NOISE_RATIO)."""
    _, _, reference, noise_floor = on_load
    difference = mean_abs_difference(ours, reference)
    assert difference <= NOISE_RATIO * noise_floor, (difference, noise_floor)


def assert_unquantized_tensors_kept(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Embeddings and norms stay float32 and equal to the checkpoint; the (tied) LM head is the embedding."""
    params = dict(model.named_parameters())
    for name, tensor in weights.items():
        if name.endswith("norm.weight") or name == "model.embed_tokens.weight":
            assert params[name].dtype == torch.float32 and torch.equal(params[name], tensor), name
    assert getattr(model, "lm_head", None) is None, "tied: the LM head is the float32 embedding"


def write_checkpoint(directory: Path, original: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    """config.json of the original with `quantization_config` added, and one safetensors file."""
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((original / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if tensors:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def with_extra_tensors(directory: Path, base: Path, extra: dict[str, torch.Tensor],
                       quantization_config: dict) -> Path:
    """A second checkpoint sharing `base`'s weights (symlinked) plus a shard of `extra` tensors, tied together by
    model.safetensors.index.json, with its own quantization_config. Writes no second copy of the model."""
    directory.mkdir(parents=True)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "model-00001-of-00002.safetensors").symlink_to(base / "model.safetensors")
    save_file(extra, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    with safe_open(base / "model.safetensors", framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(extra, "model-00002-of-00002.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def kv_scales(num_layers: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Distinct, exactly representable k/v scales per layer."""
    out = {}
    for n in range(num_layers):
        out[f"model.layers.{n}.self_attn.k_scale"] = torch.full(shape, 0.5 + n / 64)
        out[f"model.layers.{n}.self_attn.v_scale"] = torch.full(shape, 0.25 + n / 128)
    return out


def assert_kv_scales_landed(model: torch.nn.Module, num_layers: int) -> None:
    for n, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn
        assert isinstance(attn.k_scale, float) and isinstance(attn.v_scale, float), n
        assert (attn.k_scale, attn.v_scale) == (0.5 + n / 64, 0.25 + n / 128), n
    assert len(model.model.layers) == num_layers


# --- the original model and our quantize-on-load of it ------------------------------------------------------------


@pytest.fixture(scope="module")
def original() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def weights(original: Path) -> dict[str, torch.Tensor]:
    return load_file(original / "model.safetensors")


@pytest.fixture(scope="module")
def linear_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The HF linear modules of the decoder, `model.layers.N.self_attn.q_proj` ... (all 30 layers)."""
    parts = {part for group in FUSED.values() for part in group}
    names = sorted(name.removesuffix(".weight") for name in weights
                   if name.endswith(".weight") and name.split(".", 3)[-1].removesuffix(".weight") in parts)
    assert len(names) == 30 * 7
    return names


@pytest.fixture(scope="module")
def prompts(original: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(original)
    return [tokenizer(text).input_ids for text in PROMPTS]


@pytest.fixture(scope="module")
def on_load(original: Path, prompts: list[list[int]]):
    """(model, config, logits) of `quantization="fp8"` on the float32 checkpoint, and the mean |logit difference|
    from the float32 model: the FP8 noise floor."""
    full, full_config = load_model(original, "cpu", torch.float32)
    full_logits = logits_of(full, full_config, prompts)
    del full
    model, config = load_model(original, "cpu", torch.float32, quantization="fp8")
    logits = logits_of(model, config, prompts)
    return model, config, logits, mean_abs_difference(logits, full_logits)


# --- (a) compressed-tensors, written by the compressed-tensors library ---------------------------------------------


def write_compressed_tensors(directory: Path, original: Path, strategy: str) -> Path:
    """What llm-compressor's `oneshot(model, recipe=QuantizationModifier(scheme="FP8_DYNAMIC", ignore=["lm_head"]))`
    + `save_pretrained(save_compressed=True)` does, minus llm-compressor: the library's own FP8_DYNAMIC preset,
    `apply_quantization_config`, weight scales from its `calculate_qparams` (min/max per row for "channel", over the
    tensor for "tensor", as llm-compressor's min-max weight observer computes them), `ModelCompressor`
    to compress the weights to E4M3 and write quantization_config into config.json."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    hf_model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    scheme.weights.strategy = strategy
    apply_quantization_config(hf_model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    quantized = 0
    with torch.no_grad():
        for module in hf_model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            weight = module.weight
            if strategy == "channel":
                low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
            else:
                low, high = torch.aminmax(weight)
            scale, _ = calculate_qparams(low, high, module.quantization_scheme.weights)
            module.weight_scale.copy_(scale)
            module.quantization_status = QuantizationStatus.FROZEN
            quantized += 1
    assert quantized == 30 * 7  # lm_head is ignored
    compressor = ModelCompressor.from_pretrained_model(hf_model)
    compressor.compress_model(hf_model)
    hf_model.save_pretrained(directory)
    compressor.update_config(directory)

    stored = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert stored["quant_method"] == "compressed-tensors" and stored["format"] == "float-quantized"
    assert stored["version"] == ct.__version__ and stored["ignore"] == ["lm_head"]
    assert stored["config_groups"]["group_0"]["weights"]["strategy"] == strategy
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        q = f.get_slice("model.layers.0.self_attn.k_proj.weight")
        s = f.get_slice("model.layers.0.self_attn.k_proj.weight_scale")
        assert q.get_dtype() == "F8_E4M3" and s.get_dtype() == "F32"
        assert s.get_shape() == ([192, 1] if strategy == "channel" else [1])
        assert "lm_head.weight" not in f.keys()
    return directory


@pytest.fixture(scope="module")
def ct_channel(tmp_path_factory: pytest.TempPathFactory, original: Path) -> Path:
    return write_compressed_tensors(tmp_path_factory.mktemp("ct-channel"), original, "channel")


@pytest.fixture(scope="module")
def ct_tensor(tmp_path_factory: pytest.TempPathFactory, original: Path) -> Path:
    return write_compressed_tensors(tmp_path_factory.mktemp("ct-tensor"), original, "tensor")


@pytest.mark.parametrize("requested", [None, "fp8"])
def test_compressed_tensors_channel_is_bit_identical_to_quantize_on_load(
    ct_channel: Path, on_load, prompts: list[list[int]], weights: dict[str, torch.Tensor], requested: str | None,
) -> None:
    reference, _, reference_logits, _ = on_load
    model, config = load_model(ct_channel, "cpu", torch.float32, quantization=requested)

    expected = fp8_modules(reference)
    for name, module in fp8_modules(model).items():
        assert module.weight.dtype == FP8 and module.weight_scale.dtype == torch.float32, name
        assert torch.equal(bits(module.weight), bits(expected[name].weight)), name
        assert torch.equal(module.weight_scale, expected[name].weight_scale), name
    assert_unquantized_tensors_kept(model, weights)
    for ours, theirs in zip(logits_of(model, config, prompts), reference_logits, strict=True):
        assert torch.equal(ours, theirs), (ours - theirs).abs().max().item()
    # No KV-cache scales in the checkpoint: the default.
    assert all((layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) == (1.0, 1.0)
               for layer in model.model.layers)


def test_compressed_tensors_tensor_strategy_dequantizes_exactly(
    ct_tensor: Path, on_load, prompts: list[list[int]], weights: dict[str, torch.Tensor],
) -> None:
    model, config = load_model(ct_tensor, "cpu", torch.float32)

    stored = load_file(ct_tensor / "model.safetensors")
    for name, module in fp8_modules(model).items():
        # Each HF module's own w_fp8 * scale (scale shape [1]), its rows where our fused module puts them.
        expected = torch.cat([stored[f"{p}.weight"].float() * stored[f"{p}.weight_scale"] for p in hf_parts(name)])
        assert torch.equal(dequantized(module), expected), name
    assert_unquantized_tensors_kept(model, weights)
    assert_logits_close(logits_of(model, config, prompts), on_load)


# --- (b) HF / vLLM quant_method "fp8", one scale per tensor --------------------------------------------------------


def per_tensor_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoFP8 / vLLM per-tensor layout: `weight` E4M3 and a float32 scalar `weight_scale`, weight ≈ q * scale."""
    scale = weight.abs().max() / FP8_MAX
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(())


@pytest.fixture(scope="module")
def fp8_per_tensor(tmp_path_factory: pytest.TempPathFactory, original: Path, weights: dict[str, torch.Tensor],
                   linear_names: list[str]) -> Path:
    """`{"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}` (vLLM's Fp8Config
    keys), every decoder linear as `<module>.weight` F8_E4M3 + `<module>.weight_scale` F32 scalar."""
    tensors = dict(weights)
    for name in linear_names:
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = per_tensor_fp8(weights[f"{name}.weight"])
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    return write_checkpoint(tmp_path_factory.mktemp("fp8-per-tensor"), original, tensors, config)


@pytest.fixture(scope="module")
def fp8_per_tensor_static_kv(tmp_path_factory: pytest.TempPathFactory, fp8_per_tensor: Path,
                             linear_names: list[str]) -> Path:
    """The same weights with `activation_scheme: "static"`: a scalar `input_scale` per linear (ignored: we always
    quantize activations per token), plus AutoFP8-style scalar `self_attn.k_scale` / `v_scale` per layer, in a
    second shard."""
    extra = {f"{name}.input_scale": torch.tensor(0.0123) for name in linear_names}
    extra.update(kv_scales(30, ()))
    config = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    return with_extra_tensors(tmp_path_factory.mktemp("fp8-static") / "ckpt", fp8_per_tensor, extra, config)


def assert_per_tensor_dequantization_exact(model: torch.nn.Module, stored: dict[str, torch.Tensor]) -> None:
    for name, module in fp8_modules(model).items():
        parts = hf_parts(name)
        # Bits as stored, the per-tensor scale repeated over each module's rows: no re-quantization.
        assert torch.equal(bits(module.weight), torch.cat([bits(stored[f"{p}.weight"]) for p in parts])), name
        expected_scale = torch.cat([stored[f"{p}.weight_scale"].expand(stored[f"{p}.weight"].shape[0])
                                    for p in parts])
        assert torch.equal(module.weight_scale, expected_scale), name
        expected = torch.cat([stored[f"{p}.weight"].float() * stored[f"{p}.weight_scale"] for p in parts])
        assert torch.equal(dequantized(module), expected), name


def test_fp8_per_tensor_dequantizes_exactly_and_runs_close_to_quantize_on_load(
    fp8_per_tensor: Path, on_load, prompts: list[list[int]], weights: dict[str, torch.Tensor],
) -> None:
    model, config = load_model(fp8_per_tensor, "cpu", torch.float32)

    assert_per_tensor_dequantization_exact(model, load_file(fp8_per_tensor / "model.safetensors"))
    assert_unquantized_tensors_kept(model, weights)
    assert_logits_close(logits_of(model, config, prompts), on_load)


def test_hand_written_per_tensor_rounds_like_compressed_tensors(
    fp8_per_tensor: Path, ct_tensor: Path, linear_names: list[str],
) -> None:
    """A check on this file's own writer: its per-tensor weights and scales are bit for bit what compressed-tensors'
    tensor strategy stores, so the exact comparisons of (b) are against the published rounding, not only ours."""
    ours, theirs = load_file(fp8_per_tensor / "model.safetensors"), load_file(ct_tensor / "model.safetensors")
    for name in linear_names:
        assert torch.equal(bits(ours[f"{name}.weight"]), bits(theirs[f"{name}.weight"])), name
        assert torch.equal(ours[f"{name}.weight_scale"].reshape(1), theirs[f"{name}.weight_scale"]), name


def test_compressed_tensors_tensor_strategy_with_scalar_scales(
    tmp_path: Path, ct_tensor: Path, fp8_per_tensor: Path,
) -> None:
    """Tensor-strategy `weight_scale` stored as a scalar (shape []) instead of [1]: the compressed-tensors config
    over (b)'s tensors, which are compressed-tensors' bit for bit but for that shape (test above)."""
    config = json.loads((ct_tensor / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    tmp_path.joinpath("model.safetensors").symlink_to(fp8_per_tensor / "model.safetensors")
    model, _ = load_model(tmp_path, "cpu", torch.float32)

    assert_per_tensor_dequantization_exact(model, load_file(fp8_per_tensor / "model.safetensors"))


def test_fp8_static_activations_are_accepted_and_kv_scales_land(
    fp8_per_tensor_static_kv: Path, fp8_per_tensor: Path,
) -> None:
    model, _ = load_model(fp8_per_tensor_static_kv, "cpu", torch.float32, quantization="fp8")

    assert_per_tensor_dequantization_exact(model, load_file(fp8_per_tensor / "model.safetensors"))
    assert_kv_scales_landed(model, 30)


def test_compressed_tensors_kv_cache_scales_land(tmp_path: Path, ct_channel: Path, on_load) -> None:
    """llm-compressor's FP8 KV-cache layout: `kv_cache_scheme` (8-bit float, tensor strategy) in the config and
    `self_attn.k_scale` / `v_scale` of shape [1] (compressed-tensors' `initialize_qparams` gives tensor-strategy
    scales shape (1,))."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs

    config = json.loads((ct_channel / "config.json").read_text())["quantization_config"]
    config["kv_cache_scheme"] = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True,
                                                 dynamic=False).model_dump()
    directory = with_extra_tensors(tmp_path / "ckpt", ct_channel, kv_scales(30, (1,)), config)
    model, _ = load_model(directory, "cpu", torch.float32)

    assert_kv_scales_landed(model, 30)
    reference = on_load[0]
    reference_qkv = reference.model.layers[7].self_attn.qkv_proj
    assert torch.equal(bits(model.model.layers[7].self_attn.qkv_proj.weight), bits(reference_qkv.weight))


# --- (c) HF fine-grained FP8: 128 x 128 blocks --------------------------------------------------------------------


def block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 layout (README_WEIGHTS.md, "FP8 Weight Documentation"): a block not aligned to 128 is zero-padded
    to 128 before its scale is computed and the padding removed after quantizing; `weight_scale_inv` float32
    [ceil(out/128), ceil(in/128)], and the weight is `(128x128 block) * weight_scale_inv`."""
    rows, cols = weight.shape
    padded = F.pad(weight, (0, -cols % BLOCK, 0, -rows % BLOCK))
    blocks = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # [R, 128, C, 128]
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale_inv


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    return q.float() * scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


@pytest.fixture(scope="module")
def fp8_blocks(tmp_path_factory: pytest.TempPathFactory, original: Path, weights: dict[str, torch.Tensor],
               linear_names: list[str]) -> Path:
    tensors = dict(weights)
    for name in linear_names:
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = block_fp8(weights[f"{name}.weight"])
    assert tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (2, 5)  # 192 x 576: partial blocks
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    return write_checkpoint(tmp_path_factory.mktemp("fp8-blocks"), original, tensors, config)


def test_fp8_blocks_requantize_within_bound_and_run_close_to_quantize_on_load(
    fp8_blocks: Path, on_load, prompts: list[list[int]], weights: dict[str, torch.Tensor],
) -> None:
    model, config = load_model(fp8_blocks, "cpu", torch.float32)

    stored = load_file(fp8_blocks / "model.safetensors")
    for name, module in fp8_modules(model).items():
        reference = torch.cat([block_dequantize(stored[f"{p}.weight"], stored[f"{p}.weight_scale_inv"])
                               for p in hf_parts(name)])
        row_scale = module.weight_scale[:, None]
        # Per-channel E4M3 re-quantization: 3 mantissa bits (relative error <= 2**-4 rounding to nearest) and,
        # below the normal range, subnormals spaced 2**-9 * scale (absolute error <= 2**-10 * scale).
        error = (dequantized(module) - reference).abs()
        bound = reference.abs() * 2**-4 + row_scale * 2**-10
        assert (error <= bound).all(), (name, (error - bound).max().item())
        # The row scale is the row's absmax / 448, so nothing saturates.
        torch.testing.assert_close(module.weight_scale, reference.abs().amax(dim=1) / FP8_MAX, rtol=2**-20, atol=0)
    assert_unquantized_tensors_kept(model, weights)
    assert_logits_close(logits_of(model, config, prompts), on_load)


# --- what is refused -----------------------------------------------------------------------------------------------


def compressed_tensors_config(fmt: str, weights: dict, input_activations: dict | None) -> dict:
    """A compressed-tensors quantization_config in the layout the library writes (see `write_compressed_tensors`)."""
    def args(d: dict | None) -> dict | None:
        if d is None:
            return None
        return {"dynamic": False, "group_size": None, "block_structure": None, "symmetric": True, **d}

    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": args(weights),
                                      "input_activations": args(input_activations), "output_activations": None}},
    }


FP8_TOKEN_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
UNSUPPORTED: dict[str, Callable[[], dict]] = {
    "bitsandbytes": lambda: {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "ct-int8-w8a8": lambda: compressed_tensors_config(
        "int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
    "ct-fp8-block": lambda: compressed_tensors_config(
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
        {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}),
    "ct-fp8-group": lambda: compressed_tensors_config(
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64},
        FP8_TOKEN_ACTIVATIONS),
    "ct-fp8-int8-kv": lambda: {**compressed_tensors_config(
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, FP8_TOKEN_ACTIVATIONS),
        "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True}},
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_quantization_is_refused_naming_fp8(case: str, tmp_path: Path, original: Path) -> None:
    # The original float32 weights beside the config, so the quantization_config is the only thing wrong.
    write_checkpoint(tmp_path, original, {}, UNSUPPORTED[case]())
    (tmp_path / "model.safetensors").symlink_to(original / "model.safetensors")
    for requested in (None, "fp8"):
        with pytest.raises(ValueError, match="fp8"):
            load_model(tmp_path, "cpu", torch.float32, quantization=requested)


def test_unsupported_requested_quantization_is_refused_naming_fp8(original: Path) -> None:
    with pytest.raises(ValueError, match=r"'int8'.*fp8"):
        load_model(original, "cpu", torch.float32, quantization="int8")
