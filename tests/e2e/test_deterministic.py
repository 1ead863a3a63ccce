"""`deterministic=True` on the CPU, the real default model: 16 rows (greedy and seeded sampling) give bit-identical
tokens and logprobs alone, inside a batch of 64 other rows, under a 16-token step budget with prefix caching on
(their shared prefix cached), and through two data-parallel replicas. The reference is the same rows computed
alone; without the flag the logprobs of the same comparison differ, which shows the comparison can fail."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.connectors.jobs.identity import quantization_identity
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.engine_config import EngineConfig, check_deterministic
from batchllm.entrypoints.cli.engine_flags import OneLineErrors, add_engine_flags, engine_options
from tests.connectors.jobs import read_shards, write_parquet_input

# A shared 20-token-plus prefix, so that with prefix caching on the later rows start from cached blocks.
PREFIX = "You are a careful assistant. Answer in one short sentence, with no preamble and no lists. "
ROWS = [PREFIX + f"Question {i}: what is {i} plus {3 * i + 1}, and why?" for i in range(16)]
OTHERS = [f"Write a line about the number {i} and the colour {c}." for i, c in
          zip(range(64), ["red", "green", "blue", "amber"] * 16)]
MAX_TOKENS = 4  # enough for logprobs to move without the flag (asserted below), few steps for the lone rows


def _params(i: int) -> SamplingParams:
    """Rows 0-7 greedy, 8-15 seeded sampling; two logprobs a token."""
    if i < 8:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, logprobs=2)


def _results(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[tuple]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple((t, lp.logprob) for t, lp in sorted(step.items())) for step in o.outputs[0].logprobs or ()))
            for o in outputs]


def _each_alone(llm: LLM, indices=range(len(ROWS))) -> list[tuple]:
    """Each row in a call of its own: its steps hold only it (one-row GEMMs, which MKL rounds unlike 16 or more)."""
    return [_results(llm, [ROWS[i]], [_params(i)])[0] for i in indices]


def _in_batch(llm: LLM, rows=ROWS, others=OTHERS, row_params=None, **other_params) -> list[tuple]:
    """The 16 rows spread inside a batch of 64 others (other params: greedy, longer or shorter; `other_params` added
    to theirs). `row_params(i)`: row i's (default `_params`)."""
    row_params = row_params or _params
    mixed, params, where = [], [], []
    for j, other in enumerate(others):
        if j % 4 == 0:
            where.append(len(mixed))
            mixed.append(rows[j // 4])
            params.append(row_params(j // 4))
        mixed.append(other)
        params.append(SamplingParams(max_tokens=row_params(0).max_tokens + j % 5, temperature=0, **other_params))
    in_batch = _results(llm, mixed, params)
    return [in_batch[k] for k in where]


@pytest.fixture(scope="module")
def deterministic_llm():
    return LLM(device="cpu", deterministic=True, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(deterministic_llm):
    return _each_alone(deterministic_llm)


def test_rows_alone_equal_rows_inside_a_batch_bit_for_bit(deterministic_llm, alone):
    in_batch = _in_batch(deterministic_llm)
    together = _results(deterministic_llm, ROWS, [_params(i) for i in range(16)])  # the 16 rows as one batch
    assert in_batch == alone
    assert together == alone


def test_rows_under_a_16_token_budget_with_prefix_caching_equal_rows_alone(alone):
    llm = LLM(device="cpu", deterministic=True, max_num_batched_tokens=16, enable_prefix_caching=True)
    first = _results(llm, ROWS, [_params(i) for i in range(16)])
    cached = _results(llm, ROWS, [_params(i) for i in range(16)])  # every prompt's prefix blocks are cached now
    assert first == alone
    assert cached == alone


def test_rows_through_two_data_parallel_replicas_equal_rows_alone(alone):
    frame = pd.DataFrame({"q": ROWS[:8]})  # greedy rows: the door takes one SamplingParams for every row
    result = batchllm.generate(frame, prompt_column="q", engine_kwargs={"device": "cpu", "deterministic": True,
                                                                       "enable_prefix_caching": False},
                               data_parallel_size=2, use_tqdm=False, max_tokens=MAX_TOKENS, temperature=0,
                               logprobs=2)
    for row, (tokens, steps) in zip(result["logprobs"], alone[:8]):
        assert tuple(step["token_id"] for step in row) == tokens
        assert tuple(step["logprob"] for step in row) == tuple(dict(step)[t] for step, t in zip(steps, tokens))


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu", enable_prefix_caching=False)


def test_without_the_flag_the_logprobs_move_with_the_batch(default_llm):
    # One greedy and one seeded row suffice: without the flag every one of the 16 rows' logprobs moves (measured).
    in_batch = _in_batch(default_llm)
    assert _each_alone(default_llm, (0, 8)) != [in_batch[0], in_batch[8]]


def test_a_job_resumed_with_the_other_value_is_refused(deterministic_llm, default_llm, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"q": "Row {i}: name a fruit."}}\n' for i in range(4)))
    job = {"prompt_column": "q", "rows_per_shard": 2, "max_tokens": 2, "temperature": 0, "use_tqdm": False}
    batchllm.run_job(source, tmp_path / "out", llm=deterministic_llm, **job)
    with pytest.raises(ManifestMismatch, match="deterministic"):
        batchllm.run_job(source, tmp_path / "out", llm=default_llm, **job)


def test_the_flag_reaches_the_config_the_cli_and_the_job_manifest():
    assert EngineConfig.from_kwargs(device="cpu", deterministic=True).deterministic is True
    assert EngineConfig.from_kwargs(device="cpu").deterministic is False
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        EngineConfig.from_kwargs(device="cpu", deterministic="yes")
    check_deterministic(True, "cuda:0", dtype="bfloat16")  # the GPU path: Triton kernels of one launch shape
    check_deterministic(True, "cuda:0", dtype="float16")
    with pytest.raises(ValueError, match="on CUDA takes bfloat16 or float16 models, got dtype 'float32'"):
        check_deterministic(True, "cuda:0", dtype="float32")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 on CUDA yet: NCCL"):
        check_deterministic(True, "cuda:0", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="deterministic=True does not work with enable_lora"):
        EngineConfig.from_kwargs(device="cpu", deterministic=True, enable_lora=True)
    with pytest.raises(ValueError, match="deterministic=True does not work with speculative_config"):
        EngineConfig.from_kwargs(device="cpu", deterministic=True,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    parser = OneLineErrors()
    add_engine_flags(parser)
    assert engine_options(parser.parse_args(["--deterministic"])) == {"deterministic": True}
    assert engine_options(parser.parse_args([])) == {}

    class Engine:
        quantization, kv_cache_dtype, deterministic = None, "auto", True

    assert quantization_identity(Engine()) == {"quantization": None, "kv_cache_dtype": "auto", "deterministic": True}
    Engine.deterministic = False
    assert quantization_identity(Engine()) is None  # manifests written without the flag read as before


def test_a_job_killed_and_resumed_equals_the_uninterrupted_job(tiny_llama_dir, tmp_path):
    """`batchllm run --deterministic` killed (SIGKILL) after its first shard and run again: its rows, logprobs
    included, equal an uninterrupted in-process job's (prefix caching off there, on in the CLI's engine). On the
    tiny random Llama: the point is the job's bookkeeping under the flag; the real model's rows are checked above."""
    source = tmp_path / "in"
    write_parquet_input(source, [8], row_group_size=4)  # two shards: one before the kill, one after
    reference = tmp_path / "reference"
    batchllm.run_job(source, reference, llm=LLM(tiny_llama_dir, device="cpu", deterministic=True,
                                                enable_prefix_caching=False),
                     prompt_column="q", rows_per_shard=4, max_in_flight=2,
                     max_tokens=MAX_TOKENS, temperature=0, logprobs=1, use_tqdm=False)
    output, log = tmp_path / "out", tmp_path / "job.log"
    command = [sys.executable, "-m", "batchllm", "run", str(source), str(output), "--prompt-column", "q",
               "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--logprobs", "1", "--rows-per-shard", "4",
               "--max-in-flight", "2", "--device", "cpu", "--deterministic", "--model", str(tiny_llama_dir)]
    # Not from the repo root: `python -m` puts the cwd on sys.path, and the root's kernels/ shadows HF's `kernels`.
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    manifest = output / "_manifest.jsonl"
    deadline = time.monotonic() + 300
    while process.poll() is None and not (manifest.exists() and len(manifest.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    killed = process.poll() is None
    if killed:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    resumed = subprocess.run(command, cwd=tmp_path, stdout=log.open("ab"), stderr=subprocess.STDOUT, timeout=600)
    assert resumed.returncode == 0, log.read_text()
    assert killed, "the job ended before the kill"
    assert read_shards(output).sort_by("id").equals(read_shards(reference).sort_by("id"))
