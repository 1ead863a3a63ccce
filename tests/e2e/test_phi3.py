"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) end to end against HF transformers, on tiny checkpoints it writes itself.

The checkpoints hold Phi-3's fused `qkv_proj` / `gate_up_proj` tensors and LongRoPE factors. Two variants:
- "window": a 12-token sliding window on every layer, untied, `max_position_embeddings` equal to the original
  length: the short factors, on prompts 3 to 4 windows long (HF alone first shows that the window matters);
- "partial-long": Phi-4-mini's partial rotary (0.75 of each head), tied embeddings, a context 16 times the
  original 32 positions: the long factors and their attention factor, on prompts longer than the original
  length, where HF uses the long factors too.
The reference is HF `generate` / forward with eager attention in float32, one prompt at a time.
"""

from __future__ import annotations

import math

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from batchllm import LLM, LoRARequest, SamplingParams
from batchllm.model.config import ModelConfig
from batchllm.model.loader import load_model
from tests.unit.test_model_vs_hf import PagedRunner, save_tiny_checkpoint

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_FACTORS = torch.Generator().manual_seed(7)


def _longrope(rotary_dim: int) -> dict:
    """Distinct short and long factors per frequency (as Phi-3's are), long ones larger."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": (1 + torch.rand(half, generator=_FACTORS)).tolist(),
            "long_factor": (2 + 6 * torch.rand(half, generator=_FACTORS)).tolist()}


VARIANTS = {
    "window": lambda: Phi3Config(**SHAPE, max_position_embeddings=256, original_max_position_embeddings=256,
                                 rope_scaling=_longrope(16), sliding_window=12, tie_word_embeddings=False),
    "partial-long": lambda: Phi3Config(**SHAPE, max_position_embeddings=512, original_max_position_embeddings=32,
                                       rope_scaling=_longrope(12), partial_rotary_factor=0.75,
                                       tie_word_embeddings=True),
}
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINE = dict(device="cpu", skip_tokenizer_init=True, block_size=8, num_kv_blocks=64, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    """Four prompts of 35 to 44 tokens (past the window, and past "partial-long"'s original 32 positions); the last
    two share a 33-token prefix."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 128, (33,), generator=gen).tolist()
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (40, 35)] + [
        shared + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 11)]


def _hf(directory, **overrides):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                **overrides).eval()


def _hf_greedy(model, prompts) -> tuple[list[list[int]], list[list[float]]]:
    """HF's greedy tokens of each prompt, and each token's logprob."""
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, output_logits=True,
                                 return_dict_in_generate=True)
            new = out.sequences[0, len(prompt):]
            step_logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
            tokens.append(new.tolist())
            logprobs.append(step_logprobs.gather(1, new[:, None])[:, 0].tolist())
    return tokens, logprobs


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, checkpoint directory, HF greedy tokens of `_prompts()`, their logprobs), once per variant."""
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(VARIANTS[request.param](), directory)
    expected, logprobs = _hf_greedy(_hf(directory), _prompts())
    return request.param, directory, expected, logprobs


def test_the_window_and_the_long_factors_change_hf_output(variant) -> None:
    # Otherwise an engine that ignored the window, or used the short factors, would pass the tests below.
    name, directory, expected, _ = variant
    if name == "window":
        assert _hf_greedy(_hf(directory, sliding_window=None), _prompts())[0] != expected
    else:
        hf = _hf(directory)
        rope = dict(hf.config.rope_parameters)
        short = _hf(directory, rope_parameters={**rope, "long_factor": rope["short_factor"]})
        prompt = _prompts()[0]
        assert (_hf_prompt_logprobs(hf, prompt) - _hf_prompt_logprobs(short, prompt)).abs().max() > 0.1


def test_config_reads_what_hf_builds(variant) -> None:
    name, directory, _, _ = variant
    hf = _hf(directory)
    config = ModelConfig.from_dir(directory)
    hf_window = hf.config.sliding_window  # transformers' Phi-3 applies it to every layer
    assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == [hf_window] * 4
    assert config.rotary_dim == (12 if name == "partial-long" else None)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    scaling = config.rope_scaling
    assert scaling.rope_type == "longrope" and list(scaling.short_factor) == hf.config.rope_parameters["short_factor"]
    if name == "partial-long":
        # HF's default attention factor for a 16x context extension, from the original length.
        expected = math.sqrt(1 + math.log(16) / math.log(32))
        assert math.isclose(hf.model.rotary_emb.attention_scaling, expected)
        assert scaling.factor == 16 and scaling.attention_factor is None


def test_teacher_forced_logprobs_of_one_forward_equal_hf(variant) -> None:
    """Our paged forward over the prompts (one flat batch) against HF's forward of each prompt: the fused tensors'
    split, LongRoPE (long factors and attention factor for "partial-long", whose prompts exceed the original
    length), partial rotary and the window, at every position. Float32 both sides; only summation order differs,
    measured at most ~2e-6, so 1e-4 catches any wrong rotation or mask (those move logprobs by > 0.1, see above)."""
    _, directory, _, _ = variant
    hf = _hf(directory)
    model, config = load_model(directory, "cpu", torch.float32)
    prompts = _prompts()
    logits = PagedRunner(model, config).step([(i, p, 0) for i, p in enumerate(prompts)])
    for prompt, ours in zip(prompts, logits, strict=True):
        torch.testing.assert_close(torch.log_softmax(ours, dim=-1), _hf_prompt_logprobs(hf, prompt), atol=1e-4,
                                   rtol=0)


def test_a_long_context_engine_uses_the_long_factors_on_short_prompts_too(tmp_path) -> None:
    """The documented rule (layers/rotary.py): one factor set per engine, the long one when its context exceeds
    the original length. HF would use the short factors on a prompt within the original length; ours equals HF's
    forward with the long factors in the short ones' place, and not HF as it is."""
    save_tiny_checkpoint(VARIANTS["partial-long"](), tmp_path)
    hf = _hf(tmp_path)
    rope = dict(hf.config.rope_parameters)
    hf_long = _hf(tmp_path, rope_parameters={**rope, "short_factor": rope["long_factor"]})
    model, config = load_model(tmp_path, "cpu", torch.float32)
    prompt = _prompts()[0][:20]  # within the original 32 positions
    [logits] = PagedRunner(model, config).step([(0, prompt, 0)])
    ours = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(ours, _hf_prompt_logprobs(hf_long, prompt), atol=1e-4, rtol=0)
    assert (ours - _hf_prompt_logprobs(hf, prompt)).abs().max() > 0.1


def test_greedy_and_logprobs_equal_hf(variant) -> None:
    _, directory, expected, expected_logprobs = variant
    llm = LLM(str(directory), enable_prefix_caching=False, **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    # As in the teacher-forced test: float32, paged and batched vs HF's dense masks.
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)


def test_greedy_equals_hf_under_chunked_prefill(variant) -> None:
    # A 10-token budget splits every prompt into chunks that start inside an earlier chunk's window.
    _, directory, expected, _ = variant
    llm = LLM(str(directory), enable_prefix_caching=False, max_num_batched_tokens=10, **ENGINE)
    assert _greedy(llm, _prompts()) == expected


def test_greedy_equals_hf_with_a_cached_prefix(variant) -> None:
    _, directory, expected, _ = variant
    llm = LLM(str(directory), enable_prefix_caching=True, **ENGINE)
    prompts = _prompts()
    first = _greedy(llm, prompts[2:3])
    hits_before = llm.stats.prefix_cache_hits
    second = _greedy(llm, prompts[3:])
    assert llm.stats.prefix_cache_hits - hits_before >= 32  # the shared prefix's whole blocks came from the cache
    assert first + second == expected[2:]


# Pools that hold one or two of the prompts with their outputs, not all four, so that requests are preempted and
# recomputed. The hybrid KV cache frees the blocks a window left behind: "window" (every layer windowed) then
# preempts only with 8 blocks, which without it cannot hold two prompts at once.
PREEMPTING_BLOCKS = {("window", True): 8, ("window", False): 14, ("partial-long", True): 14,
                     ("partial-long", False): 14}


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid-kv", "every-block-kept"])
def test_greedy_equals_hf_under_preemption(variant, hybrid) -> None:
    name, directory, expected, _ = variant
    llm = LLM(str(directory), enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
              admission_policy="optimistic", **{**ENGINE, "num_kv_blocks": PREEMPTING_BLOCKS[name, hybrid]})
    assert _greedy(llm, _prompts()) == expected
    assert llm.stats.num_preemptions > 0


def test_fp8_weights_load_and_stay_close_to_hf(variant) -> None:
    """quantize-on-load cuts the fused tensors first and scales each shard's rows: per output row, so the
    dequantized fused weights equal HF's within E4M3's half step (2^-4 of each row's largest value), and the
    logprobs stay near HF's. A shard cut at the wrong rows would be off by whole values."""
    name, directory, expected, _ = variant
    hf = _hf(directory)
    model, config = load_model(directory, "cpu", torch.float32, quantization="fp8")
    for ours, theirs in ((model.model.layers[1].self_attn.qkv_proj, hf.model.layers[1].self_attn.qkv_proj),
                         (model.model.layers[2].mlp.gate_up_proj, hf.model.layers[2].mlp.gate_up_proj)):
        row_max = theirs.weight.abs().amax(dim=1, keepdim=True)
        assert ((ours.dequantized_weight() - theirs.weight).abs() <= row_max / 16).all()
    prompt = _prompts()[0]
    [logits] = PagedRunner(model, config).step([(0, prompt, 0)])
    # Measured: 0.08-0.10 mean |difference| (FP8 noise through 4 layers of these random weights); q/v/k cut in the
    # wrong order gives 0.85.
    difference = (torch.log_softmax(logits, dim=-1) - _hf_prompt_logprobs(hf, prompt)).abs().mean()
    assert difference < 0.25, difference
    llm = LLM(str(directory), quantization="fp8", enable_prefix_caching=False, **ENGINE)
    tokens = _greedy(llm, _prompts()[:2])
    assert all(len(t) == MAX_NEW for t in tokens)
    # FP8 noise may flip a near-tie, after which the texts part: the first tokens still agree.
    assert [t[:2] for t in tokens] == [t[:2] for t in expected[:2]]


def _phi3_config(**changes) -> dict:
    hf = Phi3Config(**SHAPE, max_position_embeddings=512, original_max_position_embeddings=32,
                    rope_scaling=_longrope(12), partial_rotary_factor=0.75).to_dict()
    hf["architectures"] = ["Phi3ForCausalLM"]
    for key, value in changes.items():
        if key in ("short_factor", "long_factor", "factor", "attention_factor", "rope_type", "partial_rotary_factor"):
            hf["rope_parameters"][key] = value
        else:
            hf[key] = value
    return hf


def test_a_config_in_the_older_spellings_reads_the_same() -> None:
    # Checkpoints written before transformers 5: `rope_scaling` with `type: su`, `rope_theta` at the top level.
    new = _phi3_config()
    old = {key: value for key, value in new.items() if key != "rope_parameters"}
    rope = new["rope_parameters"]
    old["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    old["rope_theta"] = rope["rope_theta"]
    assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(new)


@pytest.mark.parametrize("changes, message", [
    (dict(short_factor=[1.0] * 8), r"short_factor must be a list of 6 positive numbers.*got 8 values"),
    (dict(long_factor="wide"), r"long_factor must be a list of 6 positive numbers"),
    (dict(factor=-2.0), r"factor must be a positive number"),
    (dict(rope_type="llama3"), r"rope type 'llama3' is not supported"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be a number in \(0, 1\]"),
    (dict(original_max_position_embeddings=0), r"original_max_position_embeddings must be"),
    (dict(sliding_window=0), r"sliding_window must be a positive number"),
    (dict(hidden_act="gelu"), r"only hidden_act='silu'"),
])
def test_bad_config_values_are_named(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(_phi3_config(**changes))


def test_tensor_parallel_greedy_equals_hf(variant) -> None:
    # Two ranks (gloo on the CPU): each holds 2 of the 4 query heads and 1 of the 2 KV heads, so each cuts its rows
    # of q, k and v (and of gate and up) out of the fused checkpoint tensors.
    _, directory, expected, _ = variant
    llm = LLM(str(directory), tensor_parallel_size=2, enable_prefix_caching=False, seed=0, **ENGINE)
    assert _greedy(llm, _prompts()) == expected


def test_lora_on_the_fused_modules_equals_peft(variant, tmp_path) -> None:
    """A PEFT adapter on Phi-3's own modules (fused qkv_proj and gate_up_proj, o_proj, down_proj; both halves
    random, so every delta counts) against PEFT's greedy tokens on the HF model; the adapter changes them."""
    _, directory, expected_base, _ = variant
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    peft_model = peft.get_peft_model(_hf(directory), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(tmp_path)
    expected, _ = _hf_greedy(peft_model.eval(), _prompts())
    assert expected != expected_base
    llm = LLM(str(directory), enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    outputs = llm.generate(_prompts(), GREEDY, lora_request=LoRARequest("fused", 1, str(tmp_path)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
