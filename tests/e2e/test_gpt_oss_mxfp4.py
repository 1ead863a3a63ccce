"""gpt-oss with MXFP4 experts (the released checkpoints' format) end to end against HF transformers.

The tiny checkpoint is test_gpt_oss.py's model (4 layers, windows, sinks, YaRN, the clamp, top-2 of 4 experts)
with an intermediate size of 64, so that each of two tensor-parallel ranks holds two whole blocks of 32, saved
as transformers lays out an MXFP4 gpt-oss checkpoint (`*_blocks [E, rows, cols / 32, 16]`, `*_scales
[E, rows, cols / 32]`, the rows of `gate_up_proj` interleaving gate and up) with the quantization_config the
released models carry. Its codes and block scales are random bytes (scales 2^-6 to 2^-4, every E2M1 code), not
made by batchllm's quantizer: the reference is HF loading the same file with `Mxfp4Config(dequantize=True)`
(its own decoding, on the CPU) and running its float32 eager model.
"""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config, Qwen2MoeConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from batchllm import LLM, SamplingParams
from batchllm.connectors.jobs.engine_preview import preview_engine
from batchllm.connectors.jobs.run_estimate import weight_bytes
from batchllm.entrypoints.cli.main import main
from batchllm.kernels.moe_reference import dequantize_mxfp4
from batchllm.model.default_model import default_model_path
from batchllm.model.loader import load_model
from batchllm.model.quantization import resolve_quantization
from batchllm.model.quantization.mxfp4 import quantize_mxfp4
from batchllm.model.size import model_size
from tests.e2e.test_gemma import _hf_greedy
from tests.e2e.test_gpt_oss import SHAPE
from tests.e2e.test_sliding_window import ENGINE, MAX_NEW, _greedy, _prompts
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

MXFP4_SHAPE = {**SHAPE, "intermediate_size": 64}
# What the released gpt-oss checkpoints' config.json says.
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _random_mxfp4(generator: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `[*shape, 16]` of random bytes (two random E2M1 codes each) and scales `shape` of 2^-6 to 2^-4."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator).to(torch.uint8)
    return blocks, torch.randint(127 - 6, 127 - 3, shape, generator=generator).to(torch.uint8)


def test_dequantize_mxfp4_equals_transformers() -> None:
    """Our decoding (kernels and loader's layout, `[rows, cols / 2]` per row) of random blocks and scales (every
    code, scales from 2^-127 to 2^127) against transformers' own, which returns `[E, cols, rows]`."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=generator).to(torch.uint8)
    scales = torch.randint(0, 255, (3, 8, 4), generator=generator).to(torch.uint8)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dequantize_mxfp4(blocks.flatten(-2), scales).transpose(1, 2)
    assert torch.equal(ours, reference)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, HF model, HF greedy tokens, their logprobs)."""
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**MXFP4_SHAPE), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # as test_gpt_oss.py: sinks and biases far from trivial
            param.normal_(1.0 if "norm" in name else 0.0, 1.0 if name.endswith("sinks") else 0.1)
    model.save_pretrained(directory.parent / "bf16")  # the same model unquantized, for quantization="mxfp4"
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # HF's bf16 layout is [E, in, out]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _random_mxfp4(generator, experts, rows, cols // 32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                              experts_implementation="eager",
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    expected, logprobs = _hf_greedy(hf, _prompts())
    return directory, hf, expected, logprobs


def test_experts_load_as_hf_dequantizes_them(checkpoint) -> None:
    """Each expert's gate, up and down weights, decoded from our stacked parts, equal HF's dequantized
    `gate_up_proj` (gate the even columns, up the odd ones) and `down_proj`, transposed to `[out, in]`."""
    directory, hf, _, _ = checkpoint
    model, _ = load_model(directory, "cpu", torch.float32)
    ours, theirs = model.model.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    assert ours.w13_weight.dtype == torch.uint8 and ours.w13_bias.dtype == torch.float32
    w13, w2 = dequantize_mxfp4(ours.w13_weight, ours.w13_weight_scale), dequantize_mxfp4(ours.w2_weight,
                                                                                          ours.w2_weight_scale)
    gate_up = theirs.gate_up_proj.transpose(1, 2)  # [E, 2I, H], rows interleaved
    assert torch.equal(w13, torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1))
    assert torch.equal(w2, theirs.down_proj.transpose(1, 2))


def test_greedy_and_logprobs_equal_hf(checkpoint) -> None:
    directory, _, expected, expected_logprobs = checkpoint
    llm = LLM(str(directory), enable_prefix_caching=False, **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    # Float32 on both sides from the same decoded weights; only the order of the sums differs (as test_gpt_oss).
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)


def test_greedy_equals_hf_under_chunked_prefill_and_preemption(checkpoint) -> None:
    directory, _, expected, _ = checkpoint
    chunked = LLM(str(directory), enable_prefix_caching=False, max_num_batched_tokens=10, **ENGINE)
    assert _greedy(chunked, _prompts()) == expected
    preempted = LLM(str(directory), enable_prefix_caching=False, admission_policy="optimistic",
                    **{**ENGINE, "num_kv_blocks": 16})
    preempted.runner.kv_cache.tensor.fill_(float("nan"))
    assert _greedy(preempted, _prompts()) == expected
    assert preempted.stats.num_preemptions > 0


def test_greedy_equals_hf_under_tensor_parallelism(checkpoint) -> None:
    """TP=2 (gloo): each rank holds 32 of every expert's 64 intermediate features, one block of its down
    projection's scales, and the gate and up rows de-interleaved before the split."""
    directory, _, expected, _ = checkpoint
    llm = LLM(str(directory), enable_prefix_caching=False, tensor_parallel_size=2, **ENGINE)
    assert _greedy(llm, _prompts()) == expected
    llm.shutdown()


def test_greedy_equals_hf_under_expert_parallelism(checkpoint) -> None:
    """EP=2 (gloo): each rank holds two whole experts, blocks and scales unsplit."""
    directory, _, expected, _ = checkpoint
    llm = LLM(str(directory), enable_prefix_caching=False, tensor_parallel_size=2, enable_expert_parallel=True,
              **ENGINE)
    assert _greedy(llm, _prompts()) == expected
    llm.shutdown()

def test_a_split_that_cuts_a_block_is_refused(checkpoint) -> None:
    """test_gpt_oss.py's intermediate size, 32, over two ranks leaves 16 features a rank: half a block."""
    directory = checkpoint[0]
    narrow = directory.parent / "narrow"
    narrow.mkdir()
    config = json.loads((directory / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    with pytest.raises(ValueError, match="must be a multiple of 32"):
        LLM(str(narrow), load_format="dummy", tensor_parallel_size=2, **ENGINE)


@pytest.mark.parametrize("kept", [["model.layers.*.mlp.experts"], ["model.layers.0"], ["model.layers.*.mlp"]])
def test_experts_left_unconverted_are_refused(checkpoint, kept) -> None:
    config = json.loads((checkpoint[0] / "config.json").read_text())
    config["quantization_config"] = {**QUANTIZATION_CONFIG, "modules_to_not_convert": kept}
    with pytest.raises(ValueError, match="leaves .* unconverted"):
        resolve_quantization(config, None)



def _experts(llm: LLM):
    return [layer.mlp.experts for layer in llm.runner.model.model.layers]


def test_quantization_mxfp4_quantizes_a_bf16_checkpoints_experts_on_load(checkpoint) -> None:
    """Each expert of the bf16 checkpoint quantized on load: its de-interleaved, transposed HF weights through
    the quantizer (tested in tests/unit/test_mxfp4_quantize.py); attention and router stay float32."""
    bf16 = checkpoint[0].parent / "bf16"
    model, _ = load_model(bf16, "cpu", torch.float32, quantization="mxfp4")
    hf = load_file(bf16 / "model.safetensors")
    experts = model.model.layers[2].mlp.experts
    gate_up, down = hf["model.layers.2.mlp.experts.gate_up_proj"], hf["model.layers.2.mlp.experts.down_proj"]
    for expert in range(4):
        packed, scales = quantize_mxfp4(torch.cat((gate_up[expert, :, 0::2], gate_up[expert, :, 1::2]), dim=1).t())
        assert torch.equal(packed, experts.w13_weight[expert])
        assert torch.equal(scales, experts.w13_weight_scale[expert])
        packed, scales = quantize_mxfp4(down[expert].t())
        assert torch.equal(packed, experts.w2_weight[expert]) and torch.equal(scales, experts.w2_weight_scale[expert])
    assert model.model.layers[2].self_attn.qkv_proj.weight.dtype == torch.float32


def test_dummy_weights_with_quantization_mxfp4_generate(checkpoint) -> None:
    """Benchmarks' gpt-oss: random weights, experts quantized from the values the unquantized dummy model gets."""
    bf16 = checkpoint[0].parent / "bf16"
    quantized = LLM(str(bf16), load_format="dummy", quantization="mxfp4", enable_prefix_caching=False, **ENGINE)
    plain = LLM(str(bf16), load_format="dummy", enable_prefix_caching=False, **ENGINE)
    assert all(len(tokens) == MAX_NEW for tokens in _greedy(quantized, _prompts()))
    for ours, dense in zip(_experts(quantized), _experts(plain)):
        for expert in range(4):
            packed, scales = quantize_mxfp4(dense.w13_weight[expert])
            assert torch.equal(packed, ours.w13_weight[expert]) and torch.equal(scales, ours.w13_weight_scale[expert])


def test_dummy_weights_of_an_mxfp4_config_are_random_codes(checkpoint) -> None:
    """The released config.json with load_format="dummy": random codes under one scale, 2^-7."""
    llm = LLM(str(checkpoint[0]), load_format="dummy", enable_prefix_caching=False, **ENGINE)
    assert all(len(tokens) == MAX_NEW for tokens in _greedy(llm, _prompts()))
    experts = _experts(llm)[0]
    assert experts.w13_weight.dtype == torch.uint8 and experts.w13_weight.unique().numel() > 200
    assert experts.w2_weight_scale.unique().tolist() == [120]


def test_quantization_mxfp4_needs_experts(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="quantizes the experts of MoE models, and LlamaForCausalLM has none"):
        load_model(tmp_path, "cpu", torch.float32, load_format="dummy", quantization="mxfp4")


@pytest.mark.parametrize("quantization", [None, "mxfp4"], ids=["checkpoint", "on-load"])
def test_the_weight_bytes_counted_are_the_bytes_the_engine_holds(checkpoint, quantization) -> None:
    """The dry run's and the run estimate's weight bytes (config.json only) against the parameters `load_model`
    builds: MXFP4 experts at 4.25 bits (their scales included), everything else in float32."""
    directory = checkpoint[0] if quantization is None else checkpoint[0].parent / "bf16"
    model, config = load_model(directory, "cpu", torch.float32, quantization=quantization)
    held = sum(param.numel() * param.element_size() for param in model.parameters())
    preview = preview_engine(str(directory), {"quantization": quantization, "device": "cpu",
                                              "skip_tokenizer_init": True})
    size = model_size(config)
    assert size.experts == sum(p.numel() * 2 for name, p in model.named_parameters()
                               if name.endswith(("w13_weight", "w2_weight")))  # two codes a byte
    assert weight_bytes(size, preview) == held



def test_quantization_mxfp4_on_a_qwen2_moe_checkpoint_equals_hf_on_the_dequantized_experts(tmp_path) -> None:
    """Per-expert checkpoint tensors (`experts.{e}.gate_proj` ...) quantized on load; the shared expert, the dense
    layer and attention stay float32. The reference: HF's model with each expert replaced by transformers' own
    decoding of our codes and scales (`convert_moe_packed_tensors`), a dense-weight path that shares nothing with
    our kernels."""
    save_tiny_checkpoint(Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32,
                                        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                        shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                        norm_topk_prob=False), tmp_path)
    llm = LLM(str(tmp_path), quantization="mxfp4", enable_prefix_caching=False, **ENGINE)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager",
                                              experts_implementation="eager").eval()
    for ours, layer in zip(llm.runner.model.model.layers, hf.model.layers):
        if not hasattr(layer.mlp, "experts"):
            assert ours.mlp.gate_up_proj.weight.dtype == torch.float32
            continue
        assert ours.mlp.shared_expert.gate_up_proj.weight.dtype == torch.float32
        for stacked, hf_name in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            packed, scales = getattr(ours.mlp.experts, f"{stacked}_weight"), getattr(ours.mlp.experts,
                                                                                   f"{stacked}_weight_scale")
            decoded = convert_moe_packed_tensors(packed.unflatten(-1, (-1, 16)), scales, dtype=torch.float32)
            original = getattr(layer.mlp.experts, hf_name)
            decoded = decoded.transpose(1, 2).contiguous()
            # 4-bit rounding of normal weights: about 12 % of their norm; a misplaced row would be over 100 %.
            assert (decoded - original).norm() < 0.2 * original.norm()
            original.data = decoded
    assert _greedy(llm, _prompts()) == _hf_greedy(hf, _prompts())[0]


def test_the_dry_run_says_the_experts_are_mxfp4(checkpoint, tmp_path, capsys) -> None:
    """`batchllm run --dry-run` on the MXFP4 checkpoint (config.json and a tokenizer: no weight is read)."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(checkpoint[0] / "config.json", model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_path() / name).is_file():
            shutil.copy(default_model_path() / name, model)
    pq.write_table(pa.table({"q": ["What is MXFP4?"]}), tmp_path / "in.parquet")
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--model", str(model), "--prompt-column",
                 "q", "--device", "cpu", "--max-tokens", "8", "--dry-run"]) == 0, capsys.readouterr().err
    assert "with 4.25-bit MXFP4 experts (scales included)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
