"""GPTQ and AWQ 4-bit checkpoints of MoE models (Mixtral, Qwen3-MoE), written here from each format's definition,
against HF transformers holding the dequantized weights.

The tiny checkpoints of test_moe.py are quantized in the test, every decoder projection (attention, dense MLPs and
every expert's gate / up / down) and nothing else: the router, embeddings, norms and lm_head stay as they are, as
GPTQModel and AutoAWQ leave them. The packings are tests/unit/int4_writers.py's (written from AutoGPTQ's and
AutoAWQ's own packers, and checked there against hand-written words): GPTQ v1 (`checkpoint_format: "gptq"`, zero
points stored minus one) symmetric and asymmetric, 4- and 8-bit, AWQ GEMM (zero points, AutoAWQ's interleaved
nibbles) and compressed-tensors pack-quantized asymmetric (written here from its layout: the library quantizes
only `nn.Linear` modules, which transformers' stacked experts are not), all in groups of 16 input features, so
that each tensor-parallel rank of two holds whole groups of the experts' 32 intermediate features.

Reference: HF's model in float32 (eager experts) with every quantized weight replaced by the test's own
dequantization, `(code - zero) * scale` of the codes it packed. Ours computes the same float32 values (one exact
subtraction, one rounded product), so the two models hold equal weights and differ only by summation order: the
logprobs within 1e-4, as test_moe.py asks of the unquantized models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from batchllm import LLM, SamplingParams
from batchllm.connectors.jobs.engine_preview import preview_engine
from batchllm.connectors.jobs.run_estimate import weight_bytes
from batchllm.kernels.moe_reference import dequantize_int_experts
from batchllm.model.loader import load_model
from batchllm.model.size import model_size
from tests.e2e.test_fp8_doors import load_as_rank
from tests.e2e.test_gemma import _hf_greedy
from tests.e2e.test_moe import FAMILIES, SPARSE_LAYERS
from tests.e2e.test_moe_fp8_checkpoints import EXPERT_PROJECTIONS, is_quantized
from tests.e2e.test_sliding_window import ENGINE, MAX_NEW, _greedy, _prompts
from tests.unit import int4_writers as iw
from tests.unit.test_fp8_checkpoints import compressed_tensors_config
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

GROUP = 16
FORMATS = ("gptq-sym", "gptq-asym", "gptq-8bit-asym", "awq", "ct-asym")


def quantize(fmt: str, weight: torch.Tensor) -> tuple[iw.Quantized, dict[str, torch.Tensor]]:
    """One HF weight's codes, zeros and scales, and its checkpoint tensors in `fmt`."""
    groups, num_groups = iw.contiguous_groups(weight.shape[1], GROUP)
    if fmt == "awq":
        quantized = iw.quantize_awq(weight, groups, num_groups)
        return quantized, iw.awq_tensors(quantized)
    bits = 8 if "8bit" in fmt else 4
    quantized = iw.quantize_gptq(weight, groups, num_groups, bits, sym=fmt == "gptq-sym")
    if fmt == "ct-asym":
        return quantized, compressed_tensors_tensors(quantized)
    return quantized, iw.gptq_tensors(quantized, bits, v1=True)


def compressed_tensors_tensors(q: iw.Quantized) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized, 4-bit asymmetric (int4_writers.ct_dequantize reads it back the same way):
    the signed codes and zero points (-8 .. 7) stored plus 8, which are the unsigned ones quantize_gptq makes;
    `weight_packed [N, K / 8]` packed along K, `weight_zero_point [N / 8, G]` packed along N, `weight_scale [N, G]`
    and `weight_shape`."""
    return {"weight_packed": iw.pack_last(q.codes, 4), "weight_zero_point": iw.pack_last(q.zeros, 4).T.contiguous(),
            "weight_scale": q.scales.float().T.contiguous(), "weight_shape": torch.tensor(q.codes.shape)}


def quantization_config(fmt: str) -> dict:
    if fmt == "awq":
        return iw.awq_config(GROUP)
    if fmt == "ct-asym":
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP, "symmetric": False}
        config = compressed_tensors_config("pack-quantized", weights, None)
        return {**config, "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]}
    return iw.gptq_config(8 if "8bit" in fmt else 4, GROUP, desc_act=False, sym=fmt == "gptq-sym")


def write_int4_checkpoint(family: str, fmt: str, original: Path, directory: Path) -> dict[str, torch.Tensor]:
    """The `fmt` checkpoint of `original` in `directory`; returns the float32 weights it stands for (the quantized
    ones dequantized by the test), every other tensor as stored, by checkpoint name."""
    stored, reference = {}, {}
    for name, weight in load_file(original / "model.safetensors").items():
        if not is_quantized(family, name, weight):
            stored[name] = reference[name] = weight
            continue
        quantized, tensors = quantize(fmt, weight)
        stored.update({f"{name.removesuffix('.weight')}.{suffix}": t for suffix, t in tensors.items()})
        reference[name] = quantized.dequantize()
    config = json.loads((original / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return reference


def hf_reference(original: Path, reference: dict[str, torch.Tensor], directory: Path) -> torch.nn.Module:
    """HF's model (float32, eager attention and experts) holding the dequantized weights."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(original / "config.json", directory)
    save_file(reference, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(EXPERT_PROJECTIONS))
def original(request, tmp_path_factory) -> tuple[str, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(FAMILIES[request.param](), directory)
    return request.param, directory


@pytest.fixture(scope="module", params=FORMATS)
def checkpoint(request, original, tmp_path_factory):
    """(family, quantized checkpoint directory, float32 reference weights by name, HF greedy tokens, logprobs)."""
    family, directory = original
    base = tmp_path_factory.mktemp(f"{family}-{request.param}")
    reference = write_int4_checkpoint(family, request.param, directory, base / "int4")
    expected, logprobs = _hf_greedy(hf_reference(directory, reference, base / "reference"), _prompts())
    return family, base / "int4", reference, expected, logprobs


def test_every_expert_holds_the_checkpoints_codes(checkpoint) -> None:
    """Each expert's stacked `w13` (gate rows, then up rows) and `w2` dequantize exactly to the test's values; the
    experts stay packed integers (8 or 4 codes an int32 word, a scale and a zero point per group of 16)."""
    family, directory, reference, _, _ = checkpoint
    model, config = load_model(directory, "cpu", torch.float32)
    gate, up, down = EXPERT_PROJECTIONS[family]
    module = "block_sparse_moe" if family == "mixtral" else "mlp"
    hidden = config.hidden_size
    for n in SPARSE_LAYERS[family]:
        experts, prefix = model.model.layers[n].mlp.experts, f"model.layers.{n}.{module}.experts"
        assert experts.w13_weight.dtype == torch.int32 and experts.w13_weight_zero.dtype == torch.uint8
        assert experts.w13_weight_scale.shape[-1] == hidden // GROUP
        w13 = dequantize_int_experts(experts.w13_weight, experts.w13_weight_scale, experts.w13_weight_zero, hidden)
        inter = experts.intermediate_size
        w2 = dequantize_int_experts(experts.w2_weight, experts.w2_weight_scale, experts.w2_weight_zero, inter)
        for e in range(len(experts.local_experts)):
            assert torch.equal(w13[e], torch.cat([reference[f"{prefix}.{e}.{gate}.weight"],
                                                  reference[f"{prefix}.{e}.{up}.weight"]])), (n, e)
            assert torch.equal(w2[e], reference[f"{prefix}.{e}.{down}.weight"]), (n, e)


def test_greedy_and_logprobs_equal_hf_on_the_dequantized_weights(checkpoint) -> None:
    _, directory, _, expected, expected_logprobs = checkpoint
    llm = LLM(str(directory), enable_prefix_caching=False, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), params, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_processes_equal_hf(tmp_path, expert_parallel) -> None:
    """Mixtral GPTQ asymmetric over two processes (gloo). TP=2: each rank holds one group of 16 of every expert's
    32 intermediate features, gate / up rows with their scales and zero points, down's word columns with its
    groups' scales and zero points. EP=2: each rank holds two of the four experts whole."""
    save_tiny_checkpoint(FAMILIES["mixtral"](), tmp_path / "original")
    reference = write_int4_checkpoint("mixtral", "gptq-asym", tmp_path / "original", tmp_path / "int4")
    expected, _ = _hf_greedy(hf_reference(tmp_path / "original", reference, tmp_path / "reference"), _prompts())
    llm = LLM(str(tmp_path / "int4"), enable_prefix_caching=False, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, **ENGINE)
    assert _greedy(llm, _prompts()) == expected
    llm.shutdown()


def test_random_gptq_experts_build_and_generate(tmp_path) -> None:
    """`quantization="gptq"` with `load_format="dummy"` (the benchmarks' random weights): 4-bit groups of 128, so
    a MoE shape whose hidden and expert sizes are multiples of 128."""
    config = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=256)
    save_tiny_checkpoint(config, tmp_path)
    llm = LLM(str(tmp_path), quantization="gptq", load_format="dummy", enable_prefix_caching=False, **ENGINE)
    experts = llm.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.int32 and experts.w13_weight.shape == (4, 256, 16)
    assert experts.w2_weight_scale.shape == (4, 128, 1) and (experts.w2_weight_scale > 0).all()
    [output] = llm.generate([list(range(3, 20))], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8


def test_groups_cut_by_tensor_parallelism_and_unquantized_experts_are_refused_by_name(tmp_path) -> None:
    """Groups of 32 over Mixtral's 32 intermediate features: under TP=2 a rank would hold half a group of each down
    projection. An expert left unquantized in a GPTQ checkpoint is named."""
    save_tiny_checkpoint(FAMILIES["mixtral"](), tmp_path / "original")
    write_int4_checkpoint("mixtral", "gptq-asym", tmp_path / "original", tmp_path / "int4")
    config = json.loads((tmp_path / "int4" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 32
    (tmp_path / "int4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"4-bit experts in groups of 32 .* \[64, 16\] expert weight does not divide"):
        load_as_rank(tmp_path / "int4", 0, 2)
    write_int4_checkpoint("mixtral", "gptq-asym", tmp_path / "original", tmp_path / "mixed")
    tensors = load_file(tmp_path / "mixed" / "model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.2.w3"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{expert}.{suffix}"]
    tensors[f"{expert}.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "mixed" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.safetensors: {expert}.weight: is stored unquantized in a gptq"):
        load_model(tmp_path / "mixed", "cpu", torch.float32)


def test_the_weight_bytes_counted_are_the_bytes_the_engine_holds(checkpoint) -> None:
    """The dry run's and the run estimate's weight bytes (config.json only) against the parameters `load_model`
    builds on the CPU: the experts at 4 or 8 bits a weight (the CPU keeps them packed), the linears it dequantizes
    on load and everything else in float32; scales and zero points left out, as the estimate documents."""
    _, directory, _, _, _ = checkpoint
    model, config = load_model(directory, "cpu", torch.float32)
    held = sum(param.numel() * param.element_size() for name, param in model.named_parameters()
               if not name.endswith(("_weight_scale", "_weight_zero")))
    preview = preview_engine(str(directory), {"device": "cpu", "skip_tokenizer_init": True})
    assert preview.expert_weight_bits == (8 if "8bit" in directory.parent.name else 4)
    assert weight_bytes(model_size(config), preview) == held
