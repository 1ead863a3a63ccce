"""Step sizes chosen by timing steps (executor/calibration.py): the rule on hand-computed times, which engines
calibrate, and a calibrated engine on the CPU (a plan forced on it) against HF transformers' greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchllm.engine.build import _calibration_plan
from batchllm.engine_config import EngineConfig
from batchllm.executor import calibration
from batchllm.executor.calibration import (
    BATCH_SIZES,
    STEP_BUDGETS,
    CalibrationPlan,
    sizes_the_pool_holds,
    smallest_near_best,
)
from tests.hf_greedy import hf_greedy_tokens


def test_the_smallest_size_within_the_tolerance_of_the_best_throughput_wins():
    # Rows / ms: 12.8, 18.3, 23.3, 25.6. Within 10 % of 25.6 (>= 23.04): 512 and 1024; the smaller wins.
    times = {128: 10.0, 256: 14.0, 512: 22.0, 1024: 40.0}
    assert smallest_near_best(times, 0.1) == 512
    assert smallest_near_best(times, 0.0) == 1024  # no tolerance: the best
    assert smallest_near_best({128: 10.0, 256: 30.0}, 0.1) == 128  # a larger step that loses throughput
    with pytest.raises(ValueError, match="no step was timed"):
        smallest_near_best({}, 0.1)


def test_a_wide_tolerance_keeps_the_smallest_batch():
    assert smallest_near_best({128: 10.0, 256: 14.0, 1024: 40.0}, 0.6) == 128  # 12.8 >= 0.4 x 25.6


def test_the_pool_bounds_the_candidate_batches():
    # 300,000 tokens at 1,025 a row: 292 rows fit, so 128 and 256; a pool too small for any keeps the smallest.
    assert sizes_the_pool_holds((128, 256, 512, 1024), 300_000, 1025) == (128, 256)
    assert sizes_the_pool_holds((128, 256), 1000, 1025) == (128,)


def test_a_ladder_must_increase():
    with pytest.raises(ValueError, match=r"CalibrationPlan.batch_sizes must be distinct positive sizes"):
        CalibrationPlan(batch_sizes=(512, 256))
    with pytest.raises(ValueError, match=r"CalibrationPlan.step_budgets"):
        CalibrationPlan(step_budgets=(0, 8192))


def _on(config: EngineConfig, device: str) -> EngineConfig:
    return config.replace(model=dataclasses.replace(config.model, device=device))


def test_a_gpu_engine_generating_calibrates_what_the_user_left_unset():
    auto = _on(EngineConfig.from_kwargs(device="cpu"), "cuda")
    plan = _calibration_plan(auto)
    assert plan.batch_sizes == BATCH_SIZES and plan.step_budgets == STEP_BUDGETS
    plan = _calibration_plan(_on(EngineConfig.from_kwargs(device="cpu", max_num_seqs=64), "cuda"))
    assert plan.batch_sizes == () and plan.step_budgets == STEP_BUDGETS
    plan = _calibration_plan(_on(EngineConfig.from_kwargs(device="cpu", max_num_batched_tokens=4096), "cuda"))
    assert plan.batch_sizes == BATCH_SIZES and plan.step_budgets == ()
    both = EngineConfig.from_kwargs(device="cpu", max_num_seqs=64, max_num_batched_tokens=4096)
    assert _calibration_plan(_on(both, "cuda")) is None


@pytest.mark.parametrize("kwargs", [{}, {"task": "embed"}, {"disaggregated": {"prefill": 1, "decode": 1}}])
def test_the_cpu_pooling_and_disaggregated_engines_keep_their_defaults(kwargs):
    config = EngineConfig.from_kwargs(device="cpu", **kwargs)
    assert config.scheduler.max_num_seqs == 256 and not config.batch_size_given
    device = "cpu" if not kwargs else "cuda"
    assert _calibration_plan(_on(config, device)) is None


def test_a_calibrated_engine_runs_the_sizes_it_chose_and_matches_hf(tiny_llama_dir, monkeypatch):
    """A plan forced onto a CPU engine: every candidate step runs through the real model (prefill steps on a
    throwaway cache, decode steps on the pool), timed by a stand-in clock of hand-set times, so the choice is
    known. Prefill: 64 tokens in 1.0 ms (64 tokens/ms), 128 in 1.8 ms (71.1): 64 is 10 % short of the best, outside
    5 %, so 128. Decode: 2 rows in 1.0 ms (2.0 rows/ms), 4 in 1.1 (3.64, the best), 8 in 2.4 (3.33, within 10 %
    of it): the smaller, 4. The engine's scheduler, `LLM.max_num_seqs` and `LLM.max_num_batched_tokens` report the
    choice, the steps keep to it, and greedy tokens equal HF transformers'."""
    from batchllm import LLM, SamplingParams

    ran = []

    def stand_in_clock(step, repeats, synchronize):
        step.run()  # the real forward, once
        ran.append((len(step.logits_indices), step.num_tokens))
        decode = step.num_tokens == len(step.logits_indices)
        return {2: 1.0, 4: 1.1, 8: 2.4}[step.num_tokens] if decode else {64: 1.0, 128: 1.8}[step.num_tokens]

    plan = CalibrationPlan(batch_sizes=(2, 4, 8), step_budgets=(64, 128), context=20, prompt_len=32, repeats=1)
    monkeypatch.setattr(calibration, "time_step", stand_in_clock)
    monkeypatch.setattr("batchllm.engine.build._calibration_plan", lambda config: plan)
    llm = LLM(tiny_llama_dir, device="cpu")
    assert ran == [(2, 64), (4, 128), (2, 2), (4, 4), (8, 8)]  # 64 = 2 prompts of 32; decode rows of one token
    assert (llm.max_num_seqs, llm.max_num_batched_tokens) == (4, 128)
    assert llm.engine.scheduler.config.max_num_seqs == 4 and llm.config.scheduler.max_num_batched_tokens == 128
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34, 35]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert llm.stats.max_running == 4 and llm.stats.max_step_tokens <= 128
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_tokens(tiny_llama_dir, prompts, 6)



def test_no_batch_larger_than_the_step_budget_is_timed(tiny_llama_dir, monkeypatch):
    """A decode row is a token of its step: with the user's 4-token budget, the 8-row candidate is never timed
    (were it, at 1.2 ms, it would be the best), and the batch is 4."""
    from batchllm import LLM, SamplingParams

    timed = []

    def stand_in_clock(step, repeats, synchronize):
        step.run()
        timed.append(step.num_tokens)
        return {2: 1.0, 4: 1.1, 8: 1.2}[step.num_tokens]

    monkeypatch.setattr(calibration, "time_step", stand_in_clock)
    monkeypatch.setattr("batchllm.engine.build._calibration_plan",
                        lambda config: CalibrationPlan(batch_sizes=(2, 4, 8), step_budgets=(), context=20, repeats=1))
    llm = LLM(tiny_llama_dir, device="cpu", max_num_batched_tokens=4)
    assert timed == [2, 4] and (llm.max_num_seqs, llm.max_num_batched_tokens) == (4, 4)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_tokens(tiny_llama_dir, prompts, 4)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_engine_calibrates_by_default_and_matches_hf(tmp_path):
    """On CUDA, sizes left unset are chosen from the ladders by timing, and the engine's greedy tokens equal HF
    transformers' (the GPU machines have no default model: a tokenizer-free tiny Llama)."""
    from batchllm import LLM, SamplingParams
    from tests.tiny_models import TINY_LLAMA, write_random_llama

    model = write_random_llama(tmp_path / "tiny", **TINY_LLAMA)
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True)
    assert llm.max_num_seqs in BATCH_SIZES and llm.max_num_batched_tokens in STEP_BUDGETS
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == hf_greedy_tokens(model, prompts, 6)
