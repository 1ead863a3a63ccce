"""Mistral and Qwen2 sliding windows, end to end against HF transformers on tiny checkpoints it writes itself.

The reference is HF `generate` with eager attention (its masks apply the window), one prompt at a time. Every
prompt is several windows long, and the test first checks, on HF alone, that the window changes the greedy
tokens: an engine that ignored the window (or capped the length to it, as batchllm once did) fails.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from batchllm import LLM, SamplingParams
from batchllm.model.config import ModelConfig
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=256)
FAMILIES = {
    # Every layer windowed.
    "mistral": lambda **extra: MistralConfig(**SHAPE, num_hidden_layers=3, sliding_window=8, **extra),
    # Layers 0-1 full attention, 2-3 windowed (HF: a layer uses the window from `max_window_layers` on).
    "qwen2": lambda **extra: Qwen2Config(**SHAPE, num_hidden_layers=4, use_sliding_window=True, sliding_window=12,
                                         max_window_layers=2, tie_word_embeddings=False, **extra),
}
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
# The smallest blocks, so that a window spans two and the shared prefix fills four whole blocks.
ENGINE = dict(device="cpu", skip_tokenizer_init=True, block_size=8, num_kv_blocks=64, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    """Four prompts of 3 to 7 windows; the last two share a 33-token prefix (longer than either window)."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 128, (33,), generator=gen).tolist()
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (40, 27)] + [
        shared + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 11)]


def _hf_greedy(directory, prompts, **config_overrides) -> tuple[list[list[int]], list[list[float]]]:
    """HF's greedy tokens of each prompt, and each token's logprob."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                                 **config_overrides).eval()
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


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint directory, HF greedy tokens of `_prompts()`, their logprobs), once per family."""
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(FAMILIES[request.param](), directory)
    prompts = _prompts()
    expected, logprobs = _hf_greedy(directory, prompts)
    # The window must matter on these prompts, or an engine ignoring it would pass.
    off = ({"sliding_window": None} if request.param == "mistral"
           else {"use_sliding_window": False, "layer_types": ["full_attention"] * 4})
    assert _hf_greedy(directory, prompts, **off)[0] != expected
    return directory, expected, logprobs


def test_config_windows_the_layers_hf_windows(family) -> None:
    directory = family[0]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    hf_windows = [layer.self_attn.sliding_window if hasattr(layer.self_attn, "sliding_window")
                  else hf.config.sliding_window for layer in hf.model.layers]
    config = ModelConfig.from_dir(directory)
    assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == hf_windows
    assert config.max_model_len == SHAPE["max_position_embeddings"]  # not capped to the window


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid-kv", "every-block-kept"])
def test_greedy_and_logprobs_equal_hf(family, hybrid) -> None:
    directory, expected, expected_logprobs = family
    llm = LLM(str(directory), enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid, **ENGINE)
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    # Float32 on both sides; only the order of the sums differs (paged and batched vs HF's dense masks): measured
    # at most 1.5e-6 here, so 1e-4 leaves room for other BLAS builds and still catches a wrong mask.
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)


def test_greedy_equals_hf_under_chunked_prefill(family) -> None:
    # A 10-token budget splits every prompt into chunks that start inside an earlier chunk's window.
    directory, expected, _ = family
    llm = LLM(str(directory), enable_prefix_caching=False, max_num_batched_tokens=10, **ENGINE)
    assert _greedy(llm, _prompts()) == expected


def test_greedy_equals_hf_with_a_cached_prefix_longer_than_the_window(family) -> None:
    directory, expected, _ = family
    llm = LLM(str(directory), enable_prefix_caching=True, **ENGINE)
    prompts = _prompts()
    first = _greedy(llm, prompts[2:3])
    hits_before = llm.stats.prefix_cache_hits
    second = _greedy(llm, prompts[3:])
    assert llm.stats.prefix_cache_hits - hits_before >= 32  # the shared prefix's whole blocks came from the cache
    assert first + second == expected[2:]


# Pools that hold one or two of the prompts with their outputs, not all four, so that requests are preempted and
# recomputed across their windows. The hybrid KV cache frees what the windows left behind: Mistral (every layer
# windowed) preempts only with 8 blocks; Qwen2's pool block holds 2 of its 4 layers (a full and a window group).
PREEMPTING_BLOCKS = {("mistral", True): 8, ("mistral", False): 14, ("qwen2", True): 16, ("qwen2", False): 14}


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid-kv", "every-block-kept"])
def test_greedy_equals_hf_under_preemption(family, hybrid, request) -> None:
    directory, expected, _ = family
    blocks = PREEMPTING_BLOCKS[request.node.callspec.params["family"], hybrid]
    llm = LLM(str(directory), enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
              admission_policy="optimistic", **{**ENGINE, "num_kv_blocks": blocks})
    # A read of a slot no step wrote (a block freed while a window still saw it, then handed to another request
    # before it was written, or a stale table entry) would turn every output after it into NaN garbage.
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    assert _greedy(llm, _prompts()) == expected
    assert llm.stats.num_preemptions > 0


# Qwen2 here: a full and a window group. Tensor parallelism: both tables on each rank; pipeline stages: stage 0
# holds the full group's layers, stage 1 the window group's, each only its own storage slots.
@pytest.mark.parametrize("family", ["qwen2"], indirect=True)
@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_greedy_equals_hf_with_two_ranks(family, parallel) -> None:
    directory, expected, _ = family
    llm = LLM(str(directory), enable_prefix_caching=False, **{parallel: 2}, **ENGINE)
    assert _greedy(llm, _prompts()) == expected


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_greedy_equals_hf_with_ngram_speculation(family) -> None:
    # Verification steps lay each row out at a stride and roll rejected drafts back inside the window.
    directory, expected, _ = family
    llm = LLM(str(directory), enable_prefix_caching=False, **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert _greedy(llm, _prompts()) == expected
    assert llm.stats.num_draft_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid-kv", "every-block-kept"])
def test_greedy_and_logprobs_equal_hf_on_the_gpu(family, hybrid) -> None:
    """The Triton kernels (a window skips the blocks before it), CUDA graphs and the hybrid KV cache's group
    tables, in float32 (the kernels' dots in IEEE precision), against HF on the CPU; a NaN-filled pool catches a
    read of any slot no step wrote."""
    directory, expected, expected_logprobs = family
    llm = LLM(str(directory), enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
              **{**ENGINE, "device": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 64})
    llm.runner.kv_cache.tensor.fill_(float("nan"))
    with_logprobs = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(_prompts(), with_logprobs, use_tqdm=False)]
    assert [o.token_ids for o in outputs] == expected
    logprobs = [[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in outputs]
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-3, rtol=0)
