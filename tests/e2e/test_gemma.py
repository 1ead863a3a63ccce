"""Gemma 2, Gemma 3 and the text model of a multimodal Gemma 3 checkpoint, end to end against HF transformers on
tiny checkpoints it writes itself, every switch of the family on.

Gemma 2: local and global layers alternating (window 8), attention and final-logit soft-caps, a score scale
`query_pre_attn_scalar ** -0.5` other than `head_dim ** -0.5`, tied head. Gemma 3: two local layers to one
global (window 12, `sliding_window_pattern=3`), q/k norms, local and global RoPE bases differing, linear RoPE
scaling on the global layers. The reference is HF `generate` with eager attention in float32 (its masks apply
the window), one prompt at a time, on prompts 2 to 5 windows long; the test first checks, on HF alone, that the
window changes the greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import peft
import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    SiglipVisionConfig,
)
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from batchllm import LLM, LoRARequest, SamplingParams
from batchllm.model.config import ModelConfig
from batchllm.model.layers.norm import GemmaRMSNorm
from batchllm.model.loader import load_model
from tests.e2e.test_fp8_vs_simulation import DECODER_LINEARS, SimulatedFP8Linear
from tests.e2e.test_sliding_window import ENGINE, GREEDY, MAX_NEW, _greedy, _prompts
from tests.unit.test_model_vs_hf import PagedRunner, hf_logits, save_tiny_checkpoint

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             vocab_size=128, max_position_embeddings=256, query_pre_attn_scalar=24)
GEMMA3_TEXT = dict(**SHAPE, num_hidden_layers=6, sliding_window=12, sliding_window_pattern=3, rope_parameters={
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
FAMILIES = {
    # Soft-caps low enough to bite: without either, the teacher-forced logprobs move by tenths (tried).
    "gemma2": lambda: Gemma2Config(**SHAPE, num_hidden_layers=4, sliding_window=8, attn_logit_softcapping=4.0,
                                   final_logit_softcapping=3.0),
    "gemma3": lambda: Gemma3TextConfig(**GEMMA3_TEXT),
    # A one-layer SigLIP tower of 2x2 patches: written and skipped, only to have its tensors in the checkpoint.
    "gemma3-multimodal": lambda: Gemma3Config(
        text_config=GEMMA3_TEXT, mm_tokens_per_image=4,
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14).to_dict()),
}


def _fp8_kv_eager(module, query, key, value, *args, **kwargs):
    """HF's eager attention over keys and values rounded to E4M3 as an FP8 cache with scale 1.0 stores them
    (saturated to ±448, rounded to nearest): an independent model of `kv_cache_dtype="fp8"`."""
    rounded = [x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) for x in (key, value)]
    return eager_attention_forward(module, query, *rounded, *args, **kwargs)


AttentionInterface.register("fp8_kv_eager", _fp8_kv_eager)
AttentionMaskInterface.register("fp8_kv_eager", eager_mask)


def _hf_model(directory, window: int | None = None, attention: str = "eager"):
    config = AutoConfig.from_pretrained(directory)
    if window is not None:
        config.get_text_config().sliding_window = window
    return AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32,
                                                attn_implementation=attention).eval()


def _hf_greedy(model, prompts) -> tuple[list[list[int]], list[list[float]]]:
    """HF's greedy tokens of each prompt, and each token's logprob."""
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            new = out.sequences[0, len(prompt):]
            step_logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
            tokens.append(new.tolist())
            logprobs.append(step_logprobs.gather(1, new[:, None])[:, 0].tolist())
    return tokens, logprobs


@dataclass
class Family:
    name: str
    directory: Path
    hf: torch.nn.Module
    expected: list[list[int]]  # HF's greedy tokens of `_prompts()`
    expected_logprobs: list[list[float]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(FAMILIES[request.param](), directory)
    prompts = _prompts()
    hf = _hf_model(directory)
    expected, logprobs = _hf_greedy(hf, prompts)
    # The window must matter on these prompts, or an engine ignoring it would pass.
    no_window = _hf_model(directory, window=SHAPE["max_position_embeddings"])
    assert _hf_greedy(no_window, prompts)[0] != expected
    return Family(request.param, directory, hf, expected, logprobs)


def _text_layers(hf):
    return hf.model.language_model.layers if hasattr(hf.model, "language_model") else hf.model.layers


def test_config_reads_what_hf_builds(family) -> None:
    config = ModelConfig.from_dir(family.directory)
    attentions = [layer.self_attn for layer in _text_layers(family.hf)]
    assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == [a.sliding_window
                                                                                   for a in attentions]
    assert {a.scaling for a in attentions} == {config.attention_scale} == {24**-0.5}
    assert config.tie_word_embeddings and config.head_dim == 32 and config.max_model_len == 256


def test_teacher_forced_logits_equal_hf(family) -> None:
    """Each prompt fed in chunks of 10 (each chunk reading the earlier ones' K/V back from the paged cache),
    against HF's logits of the whole prompt in one pass."""
    model, config = load_model(family.directory, "cpu", torch.float32)
    runner = PagedRunner(model, config, num_blocks=64, block_size=8)
    for seq_id, prompt in enumerate(_prompts()):
        chunks = [runner.step([(seq_id, prompt[start:start + 10], start)])[0] for start in range(0, len(prompt), 10)]
        ours, reference = torch.cat(chunks).log_softmax(-1), hf_logits(family.hf, prompt).log_softmax(-1)
        # Float32 on both sides, the sums in another order: measured at most 1.6e-5; a wrong mask, scale, soft-cap,
        # embedding scale or RoPE table moves them by tenths or more (each tried).
        assert torch.allclose(ours, reference, atol=1e-4, rtol=0)


def test_greedy_and_logprobs_equal_hf(family) -> None:
    llm = LLM(str(family.directory), enable_prefix_caching=False, **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == family.expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    # As above: float32, only the order of the sums differs (measured at most 2e-5).
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(family.expected_logprobs), atol=1e-4, rtol=0)


def test_greedy_equals_hf_under_chunked_prefill(family) -> None:
    # A 10-token budget splits every prompt into chunks that start inside an earlier chunk's window.
    llm = LLM(str(family.directory), enable_prefix_caching=False, max_num_batched_tokens=10, **ENGINE)
    assert _greedy(llm, _prompts()) == family.expected


def test_greedy_equals_hf_with_a_cached_prefix_longer_than_the_window(family) -> None:
    llm = LLM(str(family.directory), enable_prefix_caching=True, **ENGINE)
    prompts = _prompts()
    first = _greedy(llm, prompts[2:3])
    hits_before = llm.stats.prefix_cache_hits
    second = _greedy(llm, prompts[3:])
    assert llm.stats.prefix_cache_hits - hits_before >= 32  # the shared prefix's whole blocks came from the cache
    assert first + second == family.expected[2:]


# Pools that hold one or two of the prompts with their outputs, not all four, so that requests are preempted and
# recomputed across their windows. A hybrid pool's block is a page of one layer group (Gemma 2: a full and a window
# group of 2 layers; Gemma 3: a full and two window groups), and a request must fit without any window freeing.
PREEMPTING_BLOCKS = {("gemma2", True): 16, ("gemma3", True): 28, ("gemma3-multimodal", True): 28}


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid-kv", "every-block-kept"])
def test_greedy_equals_hf_under_preemption(family, hybrid) -> None:
    blocks = PREEMPTING_BLOCKS.get((family.name, hybrid), 14)
    llm = LLM(str(family.directory), enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
              admission_policy="optimistic", **{**ENGINE, "num_kv_blocks": blocks})
    # A read of a slot no step wrote (a block freed while a window still saw it) turns what follows into NaN.
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    assert _greedy(llm, _prompts()) == family.expected
    assert llm.stats.num_preemptions > 0


def test_fp8_kv_cache_equals_hf_over_e4m3_rounded_keys_and_values(family) -> None:
    """Against HF float32 the FP8 cache is far off on these tiny random models (their greedy paths share 4 to 41
    of 64 tokens, teacher-forced logprobs up to 3 nats apart), so the reference is HF with its keys and values
    rounded to E4M3. The float32 rounding differences (1e-7) between the two now and then move a value across
    an E4M3 rounding boundary, which moves later logprobs by up to 1e-2 (measured: every token equal, logprobs
    within 8e-3 in one run, 2e-4 in another with other summation orders). So: at least 62 of 64 tokens, and
    logprobs within 0.05 up to a row's first difference. A cache that skipped or misplaced the rounding misses
    both by far."""
    expected, expected_logprobs = _hf_greedy(_hf_model(family.directory, attention="fp8_kv_eager"), _prompts())
    llm = LLM(str(family.directory), enable_prefix_caching=False, kv_cache_dtype="fp8", **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert sum(a == b for o, row in zip(outputs, expected) for a, b in zip(o.token_ids, row)) >= 62
    for output, row, row_logprobs in zip(outputs, expected, expected_logprobs):
        same = next((i for i, (a, b) in enumerate(zip(output.token_ids, row)) if a != b), len(row))
        ours = [step[token].logprob for token, step in zip(output.token_ids[:same], output.logprobs)]
        assert ours == pytest.approx(row_logprobs[:same], abs=0.05)


def test_fp8_weights_equal_hf_over_simulated_fp8_linears(family) -> None:
    """`quantization="fp8"` against HF with every decoder projection replaced by test_fp8_vs_simulation's
    simulation of the documented scheme (per-row E4M3 weights and activations), both in float64. Our attention
    sums in float32 where HF's eager one multiplies in float64, and a 1e-7 difference now and then moves an
    activation across an E4M3 rounding boundary, which carries on to every later position of its prompt
    (measured: every position within 1e-6 for Gemma 2 and the multimodal model; Gemma 3: 87 %, one flip). So:
    at least 3/4 of the positions within 1e-4. Against plain float64 HF every position is off, by 0.7 to 2.3
    nats (median), and so would be another rounding scheme."""
    simulation = AutoModelForCausalLM.from_pretrained(family.directory, dtype=torch.float64).eval()
    for layer in _text_layers(simulation):
        for parent in (layer.self_attn, layer.mlp):
            for name in DECODER_LINEARS:
                if hasattr(parent, name):
                    setattr(parent, name, SimulatedFP8Linear(getattr(parent, name)))
    model, config = load_model(family.directory, "cpu", torch.float64, quantization="fp8")
    runner = PagedRunner(model, config)
    differences = []
    for seq_id, prompt in enumerate(_prompts()):
        chunks = [runner.step([(seq_id, prompt[start:start + 10], start)])[0] for start in range(0, len(prompt), 10)]
        with torch.no_grad():
            expected = simulation(torch.tensor([prompt])).logits[0].log_softmax(-1)
        differences.append((torch.cat(chunks).double().log_softmax(-1) - expected).abs().amax(-1))
    assert (torch.cat(differences) <= 1e-4).double().mean() >= 0.75


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_greedy_equals_hf_split_over_two_processes(family, parallel) -> None:
    """TP=2 (gloo, two worker processes, as tests/distributed/test_tensor_parallel.py runs them): two heads and
    one KV head a rank, the vocabulary split; PP=2: half the layers a stage, the last holding its own copy of the
    tied embedding. Chunked prefill too. Gemma 3 runs as its multimodal checkpoint, whose renamed tensors each
    rank slices or skips; the plain Gemma 3 checkpoint builds the same model (10 s saved)."""
    if family.name == "gemma3":
        pytest.skip("the same model as gemma3-multimodal's")
    llm = LLM(str(family.directory), enable_prefix_caching=False, max_num_batched_tokens=10, **parallel, **ENGINE)
    assert _greedy(llm, _prompts()) == family.expected
    llm.shutdown()


def test_lora_greedy_equals_peft(family, tmp_path) -> None:
    """A PEFT adapter on every projection (both halves random, so every delta counts) against PEFT's own greedy
    tokens on the HF model; the adapter changes them."""
    if family.name == "gemma3-multimodal":
        pytest.skip("PEFT adapters of the text model are read; one of a multimodal model names other modules")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
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


def test_bfloat16_norms_and_embeddings_round_as_hf(tmp_path) -> None:
    """Where the order of operations shows, in bfloat16: the `1 + w` norm multiplies before its cast (Llama's
    norm casts first), and `sqrt(hidden)` is rounded to bfloat16 before scaling the embeddings (sqrt(48) = 6.93
    becomes 6.94). Both bit for bit HF's, and both orders distinguishable on these inputs."""
    save_tiny_checkpoint(Gemma3TextConfig(**{**GEMMA3_TEXT, "hidden_size": 48}), tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model, _ = load_model(tmp_path, "cpu", torch.bfloat16)
    ids = torch.arange(128)
    with torch.no_grad():
        embedded = model.model.embed(ids)
        assert torch.equal(embedded, hf.model.embed_tokens(ids[None])[0])
        assert not torch.equal(embedded, model.model.embed_tokens(ids) * 48**0.5)
        x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        ours, theirs = model.model.layers[0].input_layernorm, hf.model.layers[0].input_layernorm
        assert torch.equal(ours(x), theirs(x))
        x32 = x.float()
        cast_first = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * (1 + ours.weight)
        assert not torch.equal(cast_first, theirs(x))


def test_dummy_weights_give_gemma_norms_their_identity(family) -> None:
    """`load_format="dummy"` (the GPU benchmarks' random weights): a `1 + w` norm is the identity at w = 0, not
    at the 1 that Llama's norms get (which would double every norm's output, layer after layer)."""
    model, config = load_model(family.directory, "cpu", torch.float32, load_format="dummy")
    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert len(norms) == 4 * config.num_layers + 1 + (2 * config.num_layers if config.qk_norm else 0)
    assert all(torch.all(norm.weight == 0) for norm in norms)
    [logits] = PagedRunner(model, config).step([(0, list(range(40)), 0)])
    assert logits.isfinite().all() and logits.std() > 0


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_greedy_equals_hf_with_ngram_speculation(family) -> None:
    """n-gram drafts verified in strided steps over a hybrid KV cache of six-to-one window groups."""
    llm = LLM(str(family.directory), enable_prefix_caching=False, **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert _greedy(llm, _prompts()) == family.expected
    assert llm.stats.num_draft_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_equals_hf_on_the_gpu(family) -> None:
    """Soft-caps, the score scale and head_dim 32 in the Triton kernels, CUDA graphs, and the hybrid KV cache's
    groups (Gemma 3: a full group beside window groups) in float32 against HF on the CPU; the pool NaN-filled, so
    a read of a slot no step wrote shows."""
    llm = LLM(str(family.directory), enable_prefix_caching=False,
              **{**ENGINE, "device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64})
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    assert _greedy(llm, _prompts()) == family.expected
