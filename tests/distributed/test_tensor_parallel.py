"""Tensor parallelism on the CPU (gloo): TP=N must give TP=1's greedy tokens, and its worker processes must
never hang the engine or outlive it.

The reference is the single-process engine, whose output is itself checked against HF transformers in
tests/e2e. Checkpoints are random-weight Llamas written as safetensors, plus the real default model
(9 heads, 3 KV heads: TP=3 splits every projection and the vocabulary).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from batchllm import LLM, SamplingParams, StructuredOutputsParams
from batchllm.executor.multiproc_executor import WorkerDiedError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHAPES = {
    # Odd vocabulary (padded to a multiple of the group), untied head, biases on q/k/v and the row layers.
    "gqa-biases": dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=False,
                       attention_bias=True, mlp_bias=True),
    # One KV head: replicated on both ranks. Tied embeddings: the LM head is the vocab-parallel embedding.
    "mqa-tied": dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=1000, tie_word_embeddings=True),
    # For TP=4 and TP=8: KV heads split over 4 ranks, then each replicated on 2 of 8.
    "8-heads": dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False),
}


def write_checkpoint(directory: Path, **shape) -> Path:
    config = LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                            "max_position_embeddings": 256, **shape})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(directory)
    return directory


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in (1, 5, 17, 40, 9)]


def tokens(llm: LLM, prompt_list, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompt_list, params, use_tqdm=False)]


def engine(model, tp: int, **kwargs) -> LLM:
    kwargs.setdefault("skip_tokenizer_init", True)
    return LLM(model, device="cpu", tensor_parallel_size=tp, num_kv_blocks=64, seed=0, **kwargs)


def gone(pids: list[int], within_s: float) -> bool:
    """True once none of `pids` is running (a zombie left for init to reap counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("shape,tp", [("gqa-biases", 2), ("mqa-tied", 2), ("8-heads", 4), ("8-heads", 8)])
def test_tp_equals_single_process_greedy(tmp_path: Path, shape: str, tp: int) -> None:
    model = write_checkpoint(tmp_path, **SHAPES[shape])
    prompt_list = prompts(SHAPES[shape]["vocab_size"])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)  # the ranks' agreement needs few tokens
    # A small token budget chunks the longer prompts' prefill across steps.
    expected = tokens(engine(model, 1, max_num_batched_tokens=16), prompt_list, params)
    llm = engine(model, tp, max_num_batched_tokens=16)
    assert tokens(llm, prompt_list, params) == expected
    pids = llm.runner.worker_pids
    assert len(pids) == tp
    del llm
    assert gone(pids, within_s=10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("shape", ["gqa-biases", "mqa-tied"])
def test_tp2_on_gpus_with_cuda_graphs_equals_one_gpu(tmp_path: Path, shape: str) -> None:
    """NCCL collectives inside captured CUDA graphs, Triton kernels on each rank; float32 keeps ties apart."""
    model = write_checkpoint(tmp_path, **SHAPES[shape])
    prompt_list = prompts(SHAPES[shape]["vocab_size"]) * 4  # enough rows for a batched, graph-replayed decode

    def run(tp: int) -> list[list[int]]:
        llm = LLM(model, device="cuda", dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=64,
                  skip_tokenizer_init=True)
        assert llm.runner.num_blocks > 0
        result = tokens(llm, prompt_list, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()  # an in-process engine's KV pool must not starve the next test's rank 0
        return result

    assert run(2) == run(1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp_seeded_sampling_and_logprobs_match(tmp_path: Path, async_scheduling: bool) -> None:
    """Asynchronous: rank 0 broadcasts each step's samples, which every rank's next inputs read."""
    model = write_checkpoint(tmp_path, **SHAPES["gqa-biases"])
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, logprobs=2)
    single = engine(model, 1).generate(prompts(1001), params, use_tqdm=False)
    llm = engine(model, 2, async_scheduling=async_scheduling)
    parallel = llm.generate(prompts(1001), params, use_tqdm=False)
    llm.shutdown()
    for a, b in zip(single, parallel):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)


def test_tp3_on_the_default_model_equals_tp1() -> None:
    """With grammar-constrained rows too: rank 0 masks. Asynchronous (the harder path for grammars): the
    bitmask follows the step as a second message, which every rank reads."""
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 =", "Is the sky green?",
                 "Describe a cat as JSON:"]
    plain = SamplingParams(max_tokens=8, temperature=0)  # TP=3's agreement with TP=1 needs no long answers
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    choice = SamplingParams(max_tokens=8, temperature=0, structured_outputs=yes_no)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    json_params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    params = [plain, plain, plain, choice, json_params]
    expected = [o.outputs[0].text for o in LLM(device="cpu").generate(questions, params, use_tqdm=False)]
    assert expected[3] in ("yes", "no")
    llm = LLM(device="cpu", tensor_parallel_size=3, async_scheduling=True)
    assert [o.outputs[0].text for o in llm.generate(questions, params, use_tqdm=False)] == expected
    llm.shutdown()


def test_killed_worker_fails_fast_and_leaves_no_process(tmp_path: Path) -> None:
    llm = engine(write_checkpoint(tmp_path, **SHAPES["gqa-biases"]), 2)
    tokens(llm, prompts(1001))
    pids = llm.runner.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        tokens(llm, prompts(1001))
    assert time.monotonic() - start < 10
    assert gone(pids, within_s=10)
    with pytest.raises(WorkerDiedError, match="shut down"):
        tokens(llm, prompts(1001))


def engine_script(directory: Path, then: str) -> Path:
    """A script that builds a TP=2 engine on a random checkpoint, prints its worker pids, then runs `then`."""
    model = write_checkpoint(directory, **SHAPES["gqa-biases"])
    script = directory / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from batchllm import LLM, SamplingParams, StructuredOutputsParams
        if __name__ == "__main__":
            # As started from a terminal: Ctrl-C raises KeyboardInterrupt, whatever the test process inherited.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            llm = LLM({str(model)!r}, device="cpu", tensor_parallel_size=2, num_kv_blocks=64,
                      skip_tokenizer_init=True)
            print(*llm.runner.worker_pids, flush=True)
    """) + textwrap.indent(textwrap.dedent(then), " " * 4))
    return script


def test_workers_exit_when_the_engine_process_is_killed(tmp_path: Path) -> None:
    script = engine_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    assert gone(pids, within_s=15)


def test_ctrl_c_mid_generation_stops_the_workers(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, while a step is running."""
    script = engine_script(tmp_path, """
        while True:
            llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    """)
    engine_process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(pid) for pid in engine_process.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(1.0)  # generating
        os.killpg(engine_process.pid, signal.SIGINT)
        _, stderr = engine_process.communicate(timeout=60)
    finally:
        engine_process.kill()
    assert "KeyboardInterrupt" in stderr
    assert gone(pids, within_s=15)


def test_shapes_that_do_not_split_are_refused_before_any_process_starts(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path, **SHAPES["gqa-biases"])
    children = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4 is not divisible"):
        engine(model, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        engine(model, 0)
    assert set(psutil.Process().children(recursive=True)) == children
