"""Mixtral, Qwen2-MoE and Qwen3-MoE end to end against HF transformers on tiny checkpoints it writes itself.

Mixtral: 2 layers of 4 experts, top-2, always renormalised. Qwen2-MoE: 3 layers, the middle one dense
(`mlp_only_layers=[1]`), 8 experts, top-2 not renormalised, a shared expert with its sigmoid gate, q/k/v biases.
Qwen3-MoE: 4 layers, every second one sparse (`decoder_sparse_step=2`), 8 experts, top-2 renormalised, q/k norms.
The reference is HF `generate` (eager attention, float32), one prompt at a time; the fixture first checks on HF
alone that the routing matters (another top-k changes the greedy tokens), or a model ignoring it would pass.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import peft
import pytest
import torch
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from batchllm import LLM, LoRARequest, SamplingParams
from batchllm.distributed import parallel_state
from batchllm.kernels import moe_reference
from batchllm.model.config import ModelConfig
from batchllm.model.layers.fused_moe import FusedMoE
from batchllm.model.loader import load_model
from batchllm.model.quantization.fp8_method import Fp8LinearMethod
from batchllm.model.size import model_size
from tests.e2e.test_fp8_vs_simulation import DECODER_LINEARS, SimulatedFP8Linear
from tests.e2e.test_gemma import _hf_greedy
from tests.e2e.test_sliding_window import ENGINE, GREEDY, MAX_NEW, _greedy, _prompts
from tests.unit.test_model_vs_hf import PagedRunner, hf_logits, save_tiny_checkpoint

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
             max_position_embeddings=256, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": lambda: MixtralConfig(**SHAPE, intermediate_size=32, num_hidden_layers=2, num_local_experts=4),
    "qwen2-moe": lambda: Qwen2MoeConfig(**SHAPE, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                        num_experts=8, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                        norm_topk_prob=False),
    "qwen3-moe": lambda: Qwen3MoeConfig(**SHAPE, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                                        num_experts=8, decoder_sparse_step=2, norm_topk_prob=True),
}
SPARSE_LAYERS = {"mixtral": [0, 1], "qwen2-moe": [0, 2], "qwen3-moe": [1, 3]}


@dataclass
class Family:
    name: str
    directory: Path
    hf: torch.nn.Module
    expected: list[list[int]]  # HF's greedy tokens of `_prompts()`
    expected_logprobs: list[list[float]]


def _hf_model(directory, **overrides):
    config = AutoConfig.from_pretrained(directory)
    for key, value in overrides.items():
        setattr(config, key, value)
    # HF's plain loop over the experts (its default on the CPU is a grouped matmul, float32 only).
    return AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32,
                                                attn_implementation="eager", experts_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(FAMILIES[request.param](), directory)
    hf = _hf_model(directory)
    expected, logprobs = _hf_greedy(hf, _prompts())
    # Routing each token to one expert instead of two must change the tokens.
    assert _hf_greedy(_hf_model(directory, num_experts_per_tok=1), _prompts()[:2])[0] != expected[:2]
    return Family(request.param, directory, hf, expected, logprobs)


def test_config_reads_which_layers_are_sparse(family) -> None:
    config = ModelConfig.from_dir(family.directory)
    hf_sparse = [i for i, layer in enumerate(family.hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(config.num_layers) if config.moe.is_sparse(i)] == hf_sparse == SPARSE_LAYERS[family.name]
    assert config.moe.num_experts_per_tok == 2 and config.sliding_window is None


def test_teacher_forced_logits_equal_hf(family) -> None:
    """Each prompt fed in chunks of 10 (each reading the earlier chunks' K/V back from the paged cache), against
    HF's logits of the whole prompt in one pass."""
    model, config = load_model(family.directory, "cpu", torch.float32)
    runner = PagedRunner(model, config, num_blocks=64, block_size=8)
    for seq_id, prompt in enumerate(_prompts()):
        chunks = [runner.step([(seq_id, prompt[start:start + 10], start)])[0] for start in range(0, len(prompt), 10)]
        ours, reference = torch.cat(chunks).log_softmax(-1), hf_logits(family.hf, prompt).log_softmax(-1)
        # Float32 on both sides, the sums in another order: measured at most 2e-6. A wrong routing weight or
        # expert moves them by tenths.
        assert torch.allclose(ours, reference, atol=1e-4, rtol=0)


def test_greedy_and_logprobs_equal_hf(family) -> None:
    llm = LLM(str(family.directory), enable_prefix_caching=False, **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == family.expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(family.expected_logprobs), atol=1e-4, rtol=0)


def test_greedy_equals_hf_under_chunked_prefill_and_a_cached_prefix(family) -> None:
    """A 10-token budget chunks every prompt; the last two prompts share a 33-token prefix whose whole blocks
    the second reads from the prefix cache."""
    llm = LLM(str(family.directory), enable_prefix_caching=True, max_num_batched_tokens=10, **ENGINE)
    prompts = _prompts()
    first = _greedy(llm, prompts[:3])
    hits_before = llm.stats.prefix_cache_hits
    second = _greedy(llm, prompts[3:])
    assert llm.stats.prefix_cache_hits - hits_before >= 32
    assert first + second == family.expected


def test_greedy_equals_hf_under_preemption(family) -> None:
    # 14 blocks of 8 hold one or two of the prompts with their outputs, not all four.
    llm = LLM(str(family.directory), enable_prefix_caching=False, admission_policy="optimistic",
              **{**ENGINE, "num_kv_blocks": 14})
    llm.runner.kv_cache.tensor.fill_(float("nan"))  # a read of a slot no step wrote turns what follows into NaN
    assert _greedy(llm, _prompts()) == family.expected
    assert llm.stats.num_preemptions > 0


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"], ids=["tp2", "pp2"])
def test_greedy_equals_hf_split_over_two_processes(family, parallel) -> None:
    """TP=2 (gloo, two worker processes): each rank holds half of every expert's intermediate features (and of
    the shared expert's), the router whole; the experts' partial sums are all-reduced. PP=2: each stage loads
    only its layers' experts."""
    llm = LLM(str(family.directory), enable_prefix_caching=False, **{parallel: 2}, **ENGINE)
    assert _greedy(llm, _prompts()) == family.expected
    llm.shutdown()


def test_fused_moe_weight_loader_shards_each_expert_over_tensor_parallel_ranks(monkeypatch) -> None:
    """Rank r holds rows [r * I/2, (r + 1) * I/2) of each expert's gate and up projections and biases (in the first
    and second half of w13[e]) and the same columns of its down projection; the down bias only on rank 0, since
    the ranks' outputs are summed. The partial outputs add up to each token's experts computed by hand from the
    full per-expert tensors."""
    experts, hidden, inter, tokens = 4, 16, 8, 10
    gen = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(experts, inter, hidden, generator=gen), torch.randn(experts, inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    b1, b3, b2 = (torch.randn(experts, n, generator=gen) for n in (inter, inter, hidden))
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    partials = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_state", parallel_state.TensorParallel(rank, 2))
        layer = FusedMoE(experts, 2, hidden, inter, renormalize=False, bias=True)
        loads = [(layer.w13_weight, w1, "gate"), (layer.w13_weight, w3, "up"), (layer.w2_weight, w2, "down"),
                 (layer.w13_bias, b1, "gate"), (layer.w13_bias, b3, "up"), (layer.w2_bias, b2, "down")]
        for e in range(experts):
            for param, full, part in loads:
                param.weight_loader(param, full[e], (e, part))
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(layer.w13_weight[:, :inter // 2], w1[:, half])
        assert torch.equal(layer.w13_weight[:, inter // 2:], w3[:, half])
        assert torch.equal(layer.w13_bias, torch.cat([b1[:, half], b3[:, half]], dim=1))
        assert torch.equal(layer.w2_weight, w2[:, :, half])
        assert torch.equal(layer.w2_bias, b2 if rank == 0 else torch.zeros_like(b2))
        partials.append(moe_reference.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                                w13_bias=layer.w13_bias, w2_bias=layer.w2_bias))

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        return w2[e] @ (torch.nn.functional.silu(w1[e] @ v + b1[e]) * (w3[e] @ v + b3[e])) + b2[e]

    expected = torch.stack([sum(weights[t, k] * expert(e, x[t]) for k, e in enumerate(ids[t].tolist()))
                            for t in range(tokens)])
    assert torch.allclose(partials[0] + partials[1], expected, atol=1e-4)
    assert not torch.allclose(partials[0], expected, atol=1e-1)


def test_model_size_counts_every_expert_and_the_active_ones(family) -> None:
    """The parameter count from config.json equals what HF builds; a token multiplies by its top-k experts only."""
    size, config = model_size(ModelConfig.from_dir(family.directory)), ModelConfig.from_dir(family.directory)
    assert size.parameters == sum(p.numel() for p in family.hf.parameters())
    moe = config.moe
    idle_experts = len(SPARSE_LAYERS[family.name]) * (moe.num_experts - moe.num_experts_per_tok)
    assert size.layers - size.active == idle_experts * 3 * config.hidden_size * moe.moe_intermediate_size


def quantize_rows_e4m3(weight: torch.Tensor) -> torch.Tensor:
    """`weight [..., rows, in]` rounded to E4M3 with one float32 scale (absmax / 448) per row, back in its dtype:
    weight-only FP8, written here from the format's definition (torch's E4M3 cast rounds to nearest even)."""
    scale = (weight.float().abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)
    return ((weight.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(weight.dtype) * scale.to(weight.dtype))


def test_fp8_quantizes_the_linears_and_the_experts(family) -> None:
    """`quantization="fp8"` against HF in float64 with every attention and dense-MLP projection (the shared expert's
    too) replaced by test_fp8_vs_simulation's simulated per-row E4M3 linear, and every expert's weights rounded to
    E4M3 per row (the experts are weight-only FP8: activations stay in the model's dtype), the router as it is.
    Measured: every position within 1e-4. Our experts sum in float32 (kernels.fused_moe), so an E4M3 rounding
    boundary of a linear's activations may now and then be crossed (test_gemma's FP8 test saw it): 9/10 of the
    positions are asked for. HF with unquantized experts is off at every position (median 0.07 to 0.1 nats)."""
    simulation = AutoModelForCausalLM.from_pretrained(family.directory, dtype=torch.float64,
                                                      experts_implementation="eager").eval()
    for layer in simulation.model.layers:
        for parent in (layer.self_attn, layer.mlp, getattr(layer.mlp, "shared_expert", None)):
            for name in DECODER_LINEARS:
                if parent is not None and isinstance(getattr(parent, name, None), torch.nn.Linear):
                    setattr(parent, name, SimulatedFP8Linear(getattr(parent, name)))
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            with torch.no_grad():
                for weight in (experts.gate_up_proj, experts.down_proj):
                    weight.copy_(quantize_rows_e4m3(weight))
    model, config = load_model(family.directory, "cpu", torch.float64, quantization="fp8")
    sparse = model.model.layers[SPARSE_LAYERS[family.name][0]]
    assert isinstance(sparse.self_attn.qkv_proj.quant_method, Fp8LinearMethod)
    assert sparse.mlp.experts.w13_weight.dtype == sparse.mlp.experts.w2_weight.dtype == torch.float8_e4m3fn
    runner = PagedRunner(model, config)
    differences = []
    for seq_id, prompt in enumerate(_prompts()):
        ours = runner.step([(seq_id, prompt, 0)])[0].double().log_softmax(-1)
        with torch.no_grad():
            expected = simulation(torch.tensor([prompt])).logits[0].log_softmax(-1)
        differences.append((ours - expected).abs().amax(-1))
    assert (torch.cat(differences) <= 1e-4).double().mean() >= 0.9


def test_experts_of_an_unsupported_format_are_refused_by_name(family, tmp_path) -> None:
    """GPTQ with act-order (desc_act): experts whose input features are grouped by a g_idx."""
    shutil.copy(family.directory / "model.safetensors", tmp_path)
    config = json.loads((family.directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                     "sym": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MoE experts quantized with act-order .*gptq desc_act.* are not supported"):
        load_model(tmp_path, "cpu", torch.float32)


def test_lora_on_attention_and_dense_mlps_equals_peft(family, tmp_path) -> None:
    """A PEFT adapter on the attention projections and on the dense layers' MLPs (Qwen2-MoE's layer 1; a MoE block
    takes none), both halves random, against PEFT's own greedy tokens on the HF model."""
    targets = r".*layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
    # PEFT turns MLP targets of Qwen3-MoE (and, from PEFT 0.22, of Qwen2-MoE: a regex becomes its leaf names) into
    # targets of the experts' parameters too, which the engine refuses: there the adapter is on attention only.
    if family.name == "qwen3-moe" or (family.name == "qwen2-moe" and Version(peft.__version__) >= Version("0.22")):
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = peft.get_peft_model(_hf_model(family.directory), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(tmp_path)
    expected, _ = _hf_greedy(peft_model.eval(), _prompts())
    assert expected != family.expected
    llm = LLM(str(family.directory), enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    outputs = llm.generate(_prompts(), GREEDY, lora_request=LoRARequest("all", 1, str(tmp_path)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_sliding_windows_are_read_per_layer_as_hf_reads_them() -> None:
    """Not on in the checkpoints above; each family's own rule, against what transformers builds: Mixtral passes
    `config.sliding_window` to every layer's attention, the Qwen MoE attentions hold their own `sliding_window`
    (Qwen3-MoE: every layer under use_sliding_window; Qwen2-MoE: every other layer below max_window_layers, here
    from a config written before `layer_types`, which transformers now derives and writes)."""
    hf_configs = [MixtralConfig(**SHAPE, num_hidden_layers=4, sliding_window=16),
                  Qwen3MoeConfig(**SHAPE, num_hidden_layers=4, use_sliding_window=True, sliding_window=16),
                  Qwen2MoeConfig(**SHAPE, num_hidden_layers=6, use_sliding_window=True, sliding_window=16,
                                 max_window_layers=4)]
    architectures = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
    for hf_config, architecture in zip(hf_configs, architectures, strict=True):
        hf_config.update(dict(moe_intermediate_size=8, num_experts=4, num_local_experts=4, intermediate_size=8))
        attentions = [layer.self_attn for layer in AutoModelForCausalLM.from_config(hf_config).model.layers]
        windows = ([hf_config.sliding_window] * len(attentions) if architecture == "MixtralForCausalLM"
                   else [getattr(attention, "sliding_window", None) for attention in attentions])
        assert windows.count(16) >= 2
        hf = {**hf_config.to_dict(), "architectures": [architecture]}
        hf.pop("layer_types", None)
        config = ModelConfig.from_hf_dict(hf)
        assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == windows


def test_dummy_weights_fill_every_expert(family) -> None:
    """`load_format="dummy"` (the GPU benchmarks' random weights) fills each expert from its own seed."""
    model, config = load_model(family.directory, "cpu", torch.float32, load_format="dummy")
    experts = model.model.layers[SPARSE_LAYERS[family.name][0]].mlp.experts
    assert experts.w13_weight.std() == pytest.approx(0.02, rel=0.1)
    assert not torch.equal(experts.w13_weight[0], experts.w13_weight[1])
    [logits] = PagedRunner(model, config).step([(0, list(range(40)), 0)])
    assert logits.isfinite().all() and logits.std() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_equals_hf_on_the_gpu(family) -> None:
    """The fused MoE Triton kernel (device-side expert sort, grouped GEMMs) inside CUDA graphs, in float32 (IEEE
    dots), against HF on the CPU; the pool NaN-filled, so a read of a slot no step wrote shows."""
    llm = LLM(str(family.directory), enable_prefix_caching=False,
              **{**ENGINE, "device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64})
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    assert _greedy(llm, _prompts()) == family.expected
