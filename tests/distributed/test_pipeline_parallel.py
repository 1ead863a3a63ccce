"""Pipeline parallelism on the CPU (gloo): PP=P (times TP=T) must give the single-process engine's greedy tokens,
with P steps in flight; a dead stage must fail the engine fast, by name, and leave no process behind.

The reference is the single-process engine, whose output is itself checked against HF transformers in tests/e2e.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from batchllm import LLM, SamplingParams
from batchllm.executor.multiproc_executor import WorkerDiedError
from batchllm.model.config import ModelConfig
from batchllm.model.stages import StagePlan, stage_layers
from tests.distributed.test_tensor_parallel import SHAPES, gone, prompts, tokens, write_checkpoint

# Six layers: PP=3 gives each stage two.
SIX_LAYERS = dict(SHAPES["gqa-biases"], num_hidden_layers=6)
TIED_SIX_LAYERS = dict(SHAPES["mqa-tied"], num_hidden_layers=6)


def engine(model, pp: int, tp: int = 1, **kwargs) -> LLM:
    kwargs.setdefault("skip_tokenizer_init", True)
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model, device="cpu", pipeline_parallel_size=pp, tensor_parallel_size=tp, seed=0, **kwargs)


def in_flight_depths(llm: LLM) -> list[int]:
    """Record how many steps the engine holds in flight after each launch."""
    depths = []
    launch = llm.engine.executor.execute_model_async

    def recording(scheduler_output):
        pending = launch(scheduler_output)
        depths.append(len(llm.engine._in_flight) + 1)
        return pending

    llm.engine.executor.execute_model_async = recording
    return depths


@pytest.mark.parametrize("shape,pp,tp", [(SIX_LAYERS, 2, 1), (TIED_SIX_LAYERS, 2, 1), (SIX_LAYERS, 3, 1),
                                         (SIX_LAYERS, 2, 2)], ids=["pp2", "pp2-tied", "pp3", "pp2xtp2"])
def test_pp_equals_single_process_greedy(tmp_path: Path, shape: dict, pp: int, tp: int) -> None:
    model = write_checkpoint(tmp_path, **shape)
    prompt_list = prompts(shape["vocab_size"]) * 2
    # 4 rows at a time and a 16-token budget: micro-batches of 2 rows, chunked prefills, 10 rows queued.
    options = dict(max_num_seqs=4, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = tokens(engine(model, 1, **options), prompt_list, params)
    llm = engine(model, pp, tp, **options)
    depths = in_flight_depths(llm)
    assert tokens(llm, prompt_list, params) == expected
    assert max(depths) == pp, "the pipeline never held one step per stage"
    pids = llm.runner.worker_pids
    assert len(pids) == pp * tp
    llm.shutdown()
    assert gone(pids, within_s=10)


def test_pp_under_preemption_and_prefix_caching(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path, **SIX_LAYERS)
    shared = prompts(1001)[3]  # 40 tokens: two full blocks every prompt below starts with
    prompt_list = [shared + p for p in prompts(1001)] * 2
    # 12 blocks of 16 tokens for 10 rows of 41-80 tokens plus 12 new ones each: rows are preempted as they grow
    # (admitted optimistically, so that the preemption path runs).
    options = dict(num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=64, admission_policy="optimistic")
    expected = tokens(engine(model, 1, **options), prompt_list)
    llm = engine(model, 2, **options)
    assert tokens(llm, prompt_list) == expected
    stats = llm.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    llm.shutdown()


def test_pp_with_swap_preemption_and_the_host_tier(tmp_path: Path) -> None:
    """Each stage keeps its own layers' K/V in its own host pool: the copies of a swap must agree across them."""
    model = write_checkpoint(tmp_path, **SIX_LAYERS)
    prompt_list = [p * 3 for p in prompts(1001)] * 2
    options = dict(num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=64, swap_space=0.01,
                   preemption_mode="swap", admission_policy="optimistic")
    expected = tokens(engine(model, 1, **options), prompt_list)
    llm = engine(model, 2, **options)
    assert tokens(llm, prompt_list) == expected
    assert llm.stats.swap_preemptions > 0, llm.stats
    llm.shutdown()


QUESTIONS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
DEFAULT_GREEDY = SamplingParams(max_tokens=6, temperature=0)  # the stages' agreement needs no long answers


@pytest.fixture(scope="module")
def default_model_texts() -> list[str]:
    return [o.outputs[0].text for o in LLM(device="cpu").generate(QUESTIONS, DEFAULT_GREEDY, use_tqdm=False)]


# The default model has 9 heads and 3 KV heads: tensor parallelism splits it 3 ways, not 2.
@pytest.mark.parametrize("pp,tp", [(2, 1), (3, 1), (2, 3)], ids=["pp2", "pp3", "pp2xtp3"])
def test_pp_on_the_default_model_equals_one_process(default_model_texts, pp: int, tp: int) -> None:
    llm = LLM(device="cpu", pipeline_parallel_size=pp, tensor_parallel_size=tp, max_num_seqs=2)
    try:
        texts = [o.outputs[0].text for o in llm.generate(QUESTIONS, DEFAULT_GREEDY, use_tqdm=False)]
        assert texts == default_model_texts
    finally:
        llm.shutdown()


def test_a_killed_stage_fails_fast_by_name_and_leaves_no_process(tmp_path: Path) -> None:
    llm = engine(write_checkpoint(tmp_path, **SIX_LAYERS), 3)
    tokens(llm, prompts(1001))
    pids = llm.runner.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"stage 1 \(rank 1\) \(pid \d+\) exited with code -9"):
        tokens(llm, prompts(1001))
    assert time.monotonic() - start < 10
    assert gone(pids, within_s=10)


def test_refused_before_any_process_starts(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path, **SHAPES["gqa-biases"])  # two layers
    children = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must be between 1 and the model's 2 layers"):
        engine(model, 3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1"):
        engine(model, 0)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 does not work with speculative_config"):
        engine(model, 2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 does not work with enable_lora"):
        engine(model, 2, enable_lora=True)
    assert set(psutil.Process().children(recursive=True)) == children


# ---- the split ----------------------------------------------------------------------------------------------------

def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=5e5,
                max_position_embeddings=8192, max_model_len=8192)
    return ModelConfig(**{**base, **fields})


def test_stages_split_the_layers_by_parameters():
    # llama3-8b: a layer holds 218 M parameters, the embedding and the head 525 M each: halves are equal.
    assert stage_layers(_config(), 2) == ((0, 16), (16, 32))
    # Four stages: the first and the last hold 2.4 layers' worth besides their layers, so they take fewer layers:
    # 7 + 2.4 and 9 (6 + 2.4 and 10 would leave a middle stage with more than 9.4).
    assert stage_layers(_config(), 4) == ((0, 7), (7, 16), (16, 25), (25, 32))
    # A vocabulary as large as many layers: the middle stage takes most of them.
    assert stage_layers(_config(vocab_size=1_000_000, num_layers=12), 3) == ((0, 1), (1, 11), (11, 12))


def test_each_stage_holds_its_part_of_the_checkpoint():
    config = _config(num_layers=4, tie_word_embeddings=True)
    first, last = StagePlan(config, 0, 2), StagePlan(config, 1, 2)
    assert (first.start, first.end, last.start, last.end) == (0, 2, 2, 4)
    assert not first.held_elsewhere("model.embed_tokens.weight")
    assert not last.held_elsewhere("model.embed_tokens.weight")  # tied: the last stage's logits read it
    assert first.held_elsewhere("model.norm.weight") and not last.held_elsewhere("model.norm.weight")
    assert first.held_elsewhere("model.layers.2.mlp.down_proj.weight")
    assert not first.held_elsewhere("model.layers.1.mlp.down_proj.weight")
    assert last.held_elsewhere("model.layers.1.self_attn.q_proj.weight")
    untied = StagePlan(_config(num_layers=4), 1, 2)
    assert untied.held_elsewhere("model.embed_tokens.weight") and not untied.held_elsewhere("lm_head.weight")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pp2_on_two_gpus_equals_one_gpu(tmp_path: Path, async_scheduling: bool) -> None:
    """Activations over NCCL send/recv between the stages' GPUs; float32 keeps greedy ties apart."""
    model = write_checkpoint(tmp_path, **SIX_LAYERS)
    prompt_list = prompts(SIX_LAYERS["vocab_size"]) * 4
    options = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=8,
                   async_scheduling=async_scheduling)
    expected = tokens(LLM(model, **options), prompt_list)
    llm = LLM(model, pipeline_parallel_size=2, **options)
    try:
        assert tokens(llm, prompt_list) == expected
    finally:
        llm.shutdown()
