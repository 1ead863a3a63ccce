"""FP8 checkpoints of MoE models (Mixtral, Qwen3-MoE), written here from each format's definition, against HF.

The tiny checkpoints of test_moe.py are quantized in the test, every decoder projection (attention, dense MLPs and
every expert's gate / up / down) and nothing else: the router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`),
embeddings, norms and lm_head stay as they are, the `modules_to_not_convert` of Qwen/Qwen3-30B-A3B-FP8. Formats:

- HF fine-grained FP8 (`quant_method: "fp8"`, `weight_block_size`): E4M3 codes with one float32
  `weight_scale_inv` (block absmax / 448) per block, the edge blocks partial when the block does not divide the
  weight ([40, 24] here; [16, 16] divides every tiny shape). We requantize those weights per row (blocks do not
  fit the per-row scales of our kernels), so the reference holds that documented requantization of
  `codes x weight_scale_inv`, and the loaded weights are also checked against the bound of it.
- compressed-tensors `float-quantized`, strategy channel: `weight_scale [out, 1]` = row absmax / 448, read as is.
- HF / AutoFP8 per tensor (`quant_method: "fp8"`, no block size; Mixtral-8x7B-Instruct-v0.1-FP8's layout): a
  scalar `weight_scale` = tensor absmax / 448, and with `activation_scheme: "static"` a scalar `input_scale` per
  weight, which we ignore (our activations are scaled per token, the experts' not quantized).

Reference: HF transformers' model in float64 with every quantized weight replaced by its dequantized value, and
the linear layers' activations quantized per token (test_fp8_vs_simulation's `fake_quantize`): our linears are
W8A8 per token, our experts W8A16 (their activations are not quantized). Both sides run in float64, but a few
steps of each round in float32 on either side (HF's and our norm statistics, our experts' dequantization and sum),
so now and then an activation lands on the other side of an E4M3 rounding boundary, and the difference it makes
reaches every later position of that prompt through the K/V cache. Measured: every position within 1e-4 (median
2e-7) but in Qwen3-MoE with [40, 24] blocks, where one flip in layer 0 at position 29 of the two prompts sharing
a prefix leaves 83 % of the positions within 1e-4; 3/4 are asked for. No position agrees when the reference is
HF's unquantized model (median 0.2-0.3 nats) or quantizes the experts' activations too (W8A8 experts: 0.07).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from batchllm import LLM, SamplingParams
from batchllm.model.loader import load_model
from tests.e2e.test_fp8_doors import load_as_rank
from tests.e2e.test_fp8_vs_simulation import DECODER_LINEARS, fake_quantize
from tests.e2e.test_moe import FAMILIES, SPARSE_LAYERS
from tests.e2e.test_sliding_window import ENGINE, MAX_NEW, _prompts
from tests.unit.test_fp8_checkpoints import FP8_TOKEN_ACTIVATIONS, compressed_tensors_config
from tests.unit.test_model_vs_hf import PagedRunner, save_tiny_checkpoint

E4M3, E4M3_MAX = torch.float8_e4m3fn, 448.0
ROUTERS = {"mixtral": "block_sparse_moe.gate", "qwen3-moe": "mlp.gate"}
EXPERT_PROJECTIONS = {"mixtral": ("w1", "w3", "w2"), "qwen3-moe": ("gate_proj", "up_proj", "down_proj")}
BLOCKS = {"blocks-16x16": [16, 16], "blocks-40x24": [40, 24]}
FORMATS = [*BLOCKS, "channel", "tensor"]
TP_TOLERANCE = 0.25  # nats; see test_tensor_parallel_2_follows_the_simulation


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of `x / scale` (float32 division, saturated, nearest even: how the producers round)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_blocks(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF fine-grained FP8: `(codes [out, in], weight_scale_inv [ceil(out / b0), ceil(in / b1)])`, one absmax / 448
    per block, partial at the right and bottom edges (zero padding changes no absmax)."""
    rows, cols = weight.shape
    padded = F.pad(weight.float(), (0, -cols % block[1], 0, -rows % block[0]))
    blocks = padded.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))  # [R, b0, C, b1]
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12)
    codes = to_e4m3(blocks, scale_inv[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return codes.contiguous(), scale_inv


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """Float32 `codes x weight_scale_inv` of each element's block, as transformers dequantizes the format."""
    rows, cols = codes.shape
    scales = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return codes.float() * scales


def is_quantized(family: str, name: str, tensor: torch.Tensor) -> bool:
    """A decoder projection: a 2-D weight of a layer, not the router (Qwen3-30B-A3B-FP8's modules_to_not_convert)."""
    return name.startswith("model.layers.") and tensor.dim() == 2 and not name.endswith(f".{ROUTERS[family]}.weight")


def quantization_config(family: str, fmt: str, num_layers: int) -> dict:
    if fmt == "channel":
        config = compressed_tensors_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                                           FP8_TOKEN_ACTIVATIONS)
        return {**config, "ignore": ["lm_head", f"re:.*{ROUTERS[family]}$"]}
    if fmt == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static",
                "ignored_layers": ["lm_head", *(f"model.layers.{n}.{ROUTERS[family]}" for n in range(num_layers))]}
    # Qwen3-30B-A3B-FP8's list: lm_head, then each layer's input_layernorm, router and post_attention_layernorm.
    kept = [f"model.layers.{n}.{module}" for n in range(num_layers)
            for module in ("input_layernorm", ROUTERS[family], "post_attention_layernorm")]
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": BLOCKS[fmt],
            "modules_to_not_convert": ["lm_head", *kept]}


def write_fp8_checkpoint(family: str, fmt: str, original: Path, directory: Path) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of `original` in `directory`; returns the float64 weights our engine should run with
    (dequantized; blocks requantized per row as documented) by checkpoint name, every other tensor as stored."""
    tensors, stored, reference = load_file(original / "model.safetensors"), {}, {}
    for name, weight in tensors.items():
        stored[name], reference[name] = weight, weight.double()
        if not is_quantized(family, name, weight):
            continue
        prefix = name.removesuffix("weight")
        if fmt == "channel":
            scale = (weight.float().abs().amax(1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)  # [out, 1]
            stored[name], stored[prefix + "weight_scale"] = to_e4m3(weight, scale), scale
            reference[name] = stored[name].double() * scale.double()  # exact
        elif fmt == "tensor":
            scale = (weight.float().abs().amax() / E4M3_MAX).clamp_min(1e-12)  # a scalar
            stored[name], stored[prefix + "weight_scale"] = to_e4m3(weight, scale), scale
            stored[prefix + "input_scale"] = torch.tensor(0.0123)
            reference[name] = stored[name].double() * scale.double()
        else:
            stored[name], stored[prefix + "weight_scale_inv"] = quantize_blocks(weight, BLOCKS[fmt])
            reference[name] = fake_quantize(dequantize_blocks(stored[name], stored[prefix + "weight_scale_inv"],
                                                              BLOCKS[fmt]))
    config = json.loads((original / "config.json").read_text())
    config["quantization_config"] = quantization_config(family, fmt, config["num_hidden_layers"])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return reference


class ActivationQuantizedLinear(nn.Module):
    """`F.linear(fq(x), W) + b` in float64 for an HF linear whose weight already holds the dequantized FP8 values."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight.detach(), linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(fake_quantize(x), self.weight).to(x.dtype)
        return out if self.bias is None else out + self.bias


def simulation(original: Path, reference: dict[str, torch.Tensor], directory: Path) -> nn.Module:
    """HF's model (float64, eager experts) over the `reference` weights, its linears' activations quantized."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(original / "config.json", directory)
    save_file(reference, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in DECODER_LINEARS:
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, ActivationQuantizedLinear(getattr(parent, name)))
    return model


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def original(request, tmp_path_factory) -> tuple[str, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(FAMILIES[request.param](), directory)
    return request.param, directory


@pytest.fixture(scope="module", params=FORMATS)
def checkpoint(request, original, tmp_path_factory):
    """(family, format, FP8 checkpoint directory, float64 reference weights by name, the simulation)."""
    family, directory = original
    base = tmp_path_factory.mktemp(f"{family}-{request.param}")
    reference = write_fp8_checkpoint(family, request.param, directory, base / "fp8")
    return family, request.param, base / "fp8", reference, simulation(directory, reference, base / "reference")


def test_the_experts_and_linears_hold_the_checkpoints_values(checkpoint) -> None:
    """Every expert's rows in our stacked `w13` (gate, then up) and `w2`, and every fused linear's rows,
    dequantize exactly to the reference weights; the router stays unquantized and equal to the checkpoint's."""
    family, fmt, directory, reference, _ = checkpoint
    model, _ = load_model(directory, "cpu", torch.float64)
    gate, up, down = EXPERT_PROJECTIONS[family]
    module = "block_sparse_moe" if family == "mixtral" else "mlp"
    for n in SPARSE_LAYERS[family]:
        experts, prefix = model.model.layers[n].mlp.experts, f"model.layers.{n}.{module}.experts"
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == E4M3
        w13 = experts.w13_weight.double() * experts.w13_weight_scale.double()[..., None]
        w2 = experts.w2_weight.double() * experts.w2_weight_scale.double()[..., None]
        for e in range(len(experts.local_experts)):
            assert torch.equal(w13[e], torch.cat([reference[f"{prefix}.{e}.{gate}.weight"],
                                                  reference[f"{prefix}.{e}.{up}.weight"]])), (n, e)
            assert torch.equal(w2[e], reference[f"{prefix}.{e}.{down}.weight"]), (n, e)
        router = model.model.layers[n].mlp.gate.weight
        assert router.dtype == torch.float64
        assert torch.equal(router, reference[f"model.layers.{n}.{ROUTERS[family]}.weight"])
        qkv = model.model.layers[n].self_attn.qkv_proj
        assert torch.equal(qkv.weight.double() * qkv.weight_scale.double()[:, None], torch.cat(
            [reference[f"model.layers.{n}.self_attn.{p}_proj.weight"] for p in "qkv"]))
    if fmt in BLOCKS:  # the per-row requantization stays within E4M3's rounding of codes x block scales
        stored = load_file(directory / "model.safetensors")
        name = f"model.layers.{SPARSE_LAYERS[family][0]}.{module}.experts.1.{down}.weight"
        exact = dequantize_blocks(stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"],
                                  BLOCKS[fmt]).double()
        row_scale = exact.abs().amax(1, keepdim=True) / E4M3_MAX
        assert ((reference[name] - exact).abs() <= exact.abs() * 2**-4 + row_scale * 2**-10).all()
        assert not torch.equal(reference[name], exact)


def test_logprobs_equal_the_simulation(checkpoint) -> None:
    _, _, directory, _, simulated = checkpoint
    model, config = load_model(directory, "cpu", torch.float64)
    runner = PagedRunner(model, config)
    differences = []
    for seq_id, prompt in enumerate(_prompts()):
        ours = runner.step([(seq_id, prompt, 0)])[0].double().log_softmax(-1)
        with torch.no_grad():
            expected = simulated(torch.tensor([prompt])).logits[0].log_softmax(-1)
        differences.append((ours - expected).abs().amax(-1))
    assert (torch.cat(differences) <= 1e-4).double().mean() >= 0.75


@pytest.fixture(scope="module")
def qwen3_ragged_blocks(tmp_path_factory) -> tuple[Path, nn.Module]:
    """Qwen3-MoE in [40, 24] blocks: a block straddles the two tensor-parallel halves of each expert's 32 rows."""
    base = tmp_path_factory.mktemp("qwen3-ragged")
    save_tiny_checkpoint(FAMILIES["qwen3-moe"](), base / "original")
    reference = write_fp8_checkpoint("qwen3-moe", "blocks-40x24", base / "original", base / "fp8")
    return base / "fp8", simulation(base / "original", reference, base / "reference")


def test_tensor_parallel_ranks_hold_their_halves_of_each_expert(qwen3_ragged_blocks) -> None:
    """Rank r's `w13` rows are TP=1's gate rows [16r, 16r + 16) and up rows likewise, with their scales, and its `w2`
    TP=1's columns [16r, 16r + 16) with every row's scale (TP=1 is checked against the reference above)."""
    directory, _ = qwen3_ragged_blocks
    whole = load_model(directory, "cpu", torch.float32)[0].model.layers[1].mlp.experts
    for rank in range(2):
        shard = load_as_rank(directory, rank, 2).model.layers[1].mlp.experts
        rows = torch.cat([torch.arange(16) + 16 * rank, torch.arange(16) + 32 + 16 * rank])
        assert torch.equal(shard.w13_weight.view(torch.uint8), whole.w13_weight[:, rows].view(torch.uint8))
        assert torch.equal(shard.w13_weight_scale, whole.w13_weight_scale[:, rows])
        columns = whole.w2_weight[:, :, 16 * rank:16 * rank + 16].contiguous()
        assert torch.equal(shard.w2_weight.view(torch.uint8), columns.view(torch.uint8))
        assert torch.equal(shard.w2_weight_scale, whole.w2_weight_scale)


def test_tensor_parallel_2_follows_the_simulation(qwen3_ragged_blocks) -> None:
    """TP=2 (gloo, two processes) in float32. Its row layers quantize each rank's half of the activations with its
    own scale (test_fp8_doors), so it is compared as logprobs along its greedy tokens, each within TP_TOLERANCE of
    the simulation's, and each token within TP_TOLERANCE of the simulation's most probable (a near tie may go
    either way). Measured: at most 0.19 apart (TP=1 in float32: 0.05)."""
    directory, simulated = qwen3_ragged_blocks
    llm = LLM(str(directory), enable_prefix_caching=False, tensor_parallel_size=2, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]
    llm.shutdown()
    for row, (prompt, output) in enumerate(zip(_prompts(), outputs, strict=True)):
        with torch.no_grad():
            sequence = torch.tensor([prompt + output.token_ids])
            expected = simulated(sequence).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        for position, token in enumerate(output.token_ids):
            difference = abs(output.logprobs[position][token].logprob - expected[position, token].item())
            assert difference < TP_TOLERANCE, (row, position, difference)
            assert expected[position].max() - expected[position, token] < TP_TOLERANCE, (row, position)


@pytest.fixture(scope="module")
def mixtral_fp8(tmp_path_factory) -> Path:
    """Mixtral per channel and in [40, 24] blocks: `<directory>/channel`, `<directory>/blocks-40x24`."""
    base = tmp_path_factory.mktemp("mixtral")
    save_tiny_checkpoint(FAMILIES["mixtral"](), base / "original")
    for fmt in ("channel", "blocks-40x24"):
        write_fp8_checkpoint("mixtral", fmt, base / "original", base / fmt)
    return base


EXPERT = "model.layers.1.block_sparse_moe.experts.2.w1"  # [32, 64]
ROUTER = "model.layers.1.block_sparse_moe.gate"
# case: (format, the edit of the checkpoint's tensors, what the error says after the tensor's name)
REFUSED = {
    # an asymmetric scheme's zero points: dropping them would shift every weight
    "zero-point": ("channel", lambda t: t.update({f"{EXPERT}.weight_zero_point": torch.zeros(32, 1, dtype=torch.int8)}),
                   f"{EXPERT}.weight_zero_point: is a 'weight_zero_point' tensor"),
    # a compressed-tensors pack-quantized expert: 8 codes per int32
    "4-bit": ("channel", lambda t: t.update({f"{EXPERT}.weight_packed": torch.zeros(32, 8, dtype=torch.int32),
                                             f"{EXPERT}.weight_shape": torch.tensor([32, 64])})
              or t.pop(f"{EXPERT}.weight"), f"{EXPERT}.weight_packed: is a 'weight_packed' tensor"),
    "int8": ("channel", lambda t: t.update({f"{EXPERT}.weight": torch.ones(32, 64, dtype=torch.int8)}),
             f"{EXPERT}.weight: is int8"),
    "scale-rows": ("channel", lambda t: t.update({f"{EXPERT}.weight_scale": t[f"{EXPERT}.weight_scale"][:16]}),
                   f"{EXPERT}.weight: weight_scale has 16 values"),
    # whole blocks only (floor, not ceil): no scale for the partial edge block
    "edge-block": ("blocks-40x24", lambda t: t.update({f"{EXPERT}.weight_scale_inv":
                                                       t[f"{EXPERT}.weight_scale_inv"][:, :2]}),
                   rf"{EXPERT}.weight: weight_scale_inv has shape \(1, 2\), expected \(1, 3\)"),
    # a router quantized too: ours stays in the model dtype, as the published checkpoints leave it
    "router": ("channel", lambda t: t.update({f"{ROUTER}.weight": t[f"{ROUTER}.weight"].to(E4M3),
                                              f"{ROUTER}.weight_scale": torch.ones(4, 1)}),
               f"{ROUTER}.weight: is an FP8 tensor, but the model keeps this layer unquantized"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_expert_tensor_we_do_not_read_or_of_the_wrong_shape_is_refused_by_name(mixtral_fp8, tmp_path, case):
    fmt, change, message = REFUSED[case]
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(mixtral_fp8 / fmt / "config.json", directory)
    tensors = load_file(mixtral_fp8 / fmt / "model.safetensors")
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.safetensors: {message}"):
        load_model(directory, "cpu", torch.float32)
