"""gpt-oss (bf16 / fp32 experts) end to end against HF transformers on a tiny checkpoint it writes itself.

4 layers alternating an 8-token window and full attention, 4 experts of which each token takes the top 2 logits
(then a softmax over those 2), expert and router biases, a SwiGLU clamp low enough to bite (1.0), attention
sinks far from their zero init, YaRN RoPE. The reference is HF `generate` (eager attention, eager experts,
float32), one prompt at a time; the fixture first checks on HF alone that the window, the sinks, the clamp and
the routing each change the greedy tokens on these prompts, or a model ignoring one of them would pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from batchllm import LLM, SamplingParams
from batchllm.model.config import ModelConfig
from batchllm.model.gpt_oss_config import parse_config
from batchllm.model.layers.rotary import RotaryEmbedding
from batchllm.model.loader import load_model
from batchllm.model.quantization import QuantConfig, resolve_quantization
from batchllm.model.quantization.config import MXFP4
from batchllm.model.size import model_size
from tests.e2e.test_gemma import _hf_greedy
from tests.e2e.test_sliding_window import ENGINE, MAX_NEW, _greedy, _prompts
from tests.unit.test_model_vs_hf import PagedRunner, hf_logits

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
             max_position_embeddings=256, num_hidden_layers=4, intermediate_size=32, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, rope_parameters=YARN)
WINDOWS = [8, None, 8, None]  # GptOssConfig's default layer_types: even layers windowed


@dataclass
class Checkpoint:
    directory: Path
    hf: torch.nn.Module
    expected: list[list[int]]  # HF's greedy tokens of `_prompts()`
    expected_logprobs: list[list[float]]


def _hf_model(directory, **overrides):
    config = AutoConfig.from_pretrained(directory)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32,
                                                 attn_implementation="eager", experts_implementation="eager").eval()
    if "sinks" in overrides:  # a very negative sink takes no share of any softmax: attention without sinks
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(overrides["sinks"])
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Checkpoint:
    directory = tmp_path_factory.mktemp("gpt-oss")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**SHAPE), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Sinks start at zero and biases would be trivial: every tensor random, the sinks of the order of
            # the attention scores so that they take a real share of each softmax.
            param.normal_(1.0 if "norm" in name else 0.0, 1.0 if name.endswith("sinks") else 0.1)
    model.save_pretrained(directory)
    hf = _hf_model(directory)
    prompts = _prompts()
    expected, logprobs = _hf_greedy(hf, prompts)
    for switch in ({"sliding_window": 1000}, {"sinks": -1e4}, {"swiglu_limit": 1e4}, {"num_experts_per_tok": 1}):
        assert _hf_greedy(_hf_model(directory, **switch), prompts)[0] != expected, switch
    return Checkpoint(directory, hf, expected, logprobs)


def test_config_reads_what_hf_builds(checkpoint) -> None:
    config = ModelConfig.from_dir(checkpoint.directory)
    hf_windows = [layer.self_attn.sliding_window for layer in checkpoint.hf.model.layers]
    assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == hf_windows == WINDOWS
    assert (config.moe.num_experts, config.moe.num_experts_per_tok, config.moe.moe_intermediate_size) == (4, 2, 32)
    assert config.moe.swiglu_limit == 1.0 and config.attention_bias and config.o_proj_bias
    assert config.rope_scaling.rope_type == "yarn"


@pytest.mark.parametrize("rope", [YARN, {**YARN, "truncate": True, "beta_fast": 16.0, "factor": 8.0},
                                  {**YARN, "mscale": 1.3, "mscale_all_dim": 0.7},
                                  {**YARN, "attention_factor": 1.25, "original_max_position_embeddings": 32}],
                         ids=["no-truncate", "truncate", "mscale", "attention-factor"])
def test_yarn_cos_sin_equal_hf_rotary_embedding(rope) -> None:
    """Our cos/sin table, indexed by position, against HF's GptOssRotaryEmbedding at every position: the same
    float32 operations, so bit-identical. The truncated variant moves the ramp's ends; mscale / attention_factor
    change the cos/sin scale."""
    hf_config = GptOssConfig(**{**SHAPE, "rope_parameters": rope})
    config = parse_config(json.loads(hf_config.to_json_string()))
    ours = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling)
    positions = torch.arange(config.max_model_len)[None]
    cos, sin = GptOssRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
    plain = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta)
    assert not torch.allclose(ours.cos, plain.cos, atol=1e-3)  # the scaling is not a no-op here


def test_teacher_forced_logits_equal_hf(checkpoint) -> None:
    """Each prompt fed in chunks of 10 (each reading the earlier chunks' K/V back from the NaN-poisoned paged
    cache), against HF's logits of the whole prompt in one pass."""
    model, config = load_model(checkpoint.directory, "cpu", torch.float32)
    runner = PagedRunner(model, config, num_blocks=64, block_size=8)
    for seq_id, prompt in enumerate(_prompts()):
        chunks = [runner.step([(seq_id, prompt[start:start + 10], start)])[0] for start in range(0, len(prompt), 10)]
        ours, reference = torch.cat(chunks).log_softmax(-1), hf_logits(checkpoint.hf, prompt).log_softmax(-1)
        # Float32 on both sides, the sums in another order (paged, chunked attention; experts accumulated in
        # float32): a few 1e-6 at most. A wrong sink, window, clamp or routing weight moves them by tenths.
        assert torch.allclose(ours, reference, atol=1e-4, rtol=0)


def test_greedy_and_logprobs_equal_hf(checkpoint) -> None:
    llm = LLM(str(checkpoint.directory), enable_prefix_caching=False, **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == checkpoint.expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(checkpoint.expected_logprobs), atol=1e-4, rtol=0)


def test_greedy_equals_hf_under_chunked_prefill(checkpoint) -> None:
    # A 10-token budget splits every prompt into chunks that start inside an earlier chunk's window.
    llm = LLM(str(checkpoint.directory), enable_prefix_caching=False, max_num_batched_tokens=10, **ENGINE)
    assert _greedy(llm, _prompts()) == checkpoint.expected


def test_greedy_equals_hf_under_preemption(checkpoint) -> None:
    # A pool that holds one or two of the prompts with their outputs, not all four (a full and a window group).
    llm = LLM(str(checkpoint.directory), enable_prefix_caching=False, admission_policy="optimistic",
              **{**ENGINE, "num_kv_blocks": 16})
    llm.runner.kv_cache.tensor.fill_(float("nan"))  # a read of a slot no step wrote turns what follows into NaN
    assert _greedy(llm, _prompts()) == checkpoint.expected
    assert llm.stats.num_preemptions > 0


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"], ids=["tp2", "pp2"])
def test_greedy_equals_hf_split_over_two_processes(checkpoint, parallel) -> None:
    """TP=2 (gloo): each rank holds 2 of the 4 heads with their sinks and half of every expert's intermediate
    features (the interleaved gate/up columns de-interleaved before the split), the router whole. PP=2: each
    stage loads only its layers' stacked expert tensors and sinks."""
    llm = LLM(str(checkpoint.directory), enable_prefix_caching=False, **{parallel: 2}, **ENGINE)
    assert _greedy(llm, _prompts()) == checkpoint.expected
    llm.shutdown()


def test_model_size_counts_every_expert_bias_and_sink(checkpoint) -> None:
    """The parameter count from config.json equals what HF builds; a token multiplies by its top-k experts only."""
    size = model_size(ModelConfig.from_dir(checkpoint.directory))
    assert size.parameters == sum(p.numel() for p in checkpoint.hf.parameters())
    per_expert = 3 * 64 * 32 + 2 * 32 + 64  # gate, up, down and their biases
    assert size.layers - size.active == 4 * (4 - 2) * per_expert


def test_mxfp4_checkpoints_read_as_mxfp4_experts(checkpoint) -> None:
    """The released checkpoints' quantization_config: MXFP4 experts, the rest unquantized (loaded and compared
    with HF in test_gpt_oss_mxfp4.py)."""
    hf = json.loads((checkpoint.directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                 "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    assert ModelConfig.from_hf_dict(hf).moe.num_experts == 4
    assert resolve_quantization(hf, None) == QuantConfig(MXFP4, MXFP4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_equals_hf_on_the_gpu(tmp_path) -> None:
    """Sinks and windows in the paged Triton attention, the clamped SwiGLU and expert biases in the fused MoE
    kernel, inside CUDA graphs, in float32 (IEEE dots), against HF on the CPU; the pool NaN-filled. Its own
    checkpoint: transformers before 5.2x clamps gpt-oss's SwiGLU at 7.0 whatever config.json says (the GPU
    machine has 5.17), so this one keeps 7.0 and makes the experts' weights large enough for the clamp to bite."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**{**SHAPE, "swiglu_limit": 7.0}), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 1.0 if name.endswith(("sinks", "gate_up_proj")) else 0.1
            param.normal_(1.0 if "norm" in name else 0.0, std)
    model.save_pretrained(tmp_path)
    expected, _ = _hf_greedy(_hf_model(tmp_path), _prompts())
    llm = LLM(str(tmp_path), enable_prefix_caching=False,
              **{**ENGINE, "device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64})
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    assert _greedy(llm, _prompts()) == expected
