"""Disaggregated prefill / decode on the CPU: two worker processes (prefill, decode) sharing a K/V buffer in
shared memory must give one engine's outputs, greedy and seeded, with prefix caching on and under preemption in
the decode engine, leak no block in either engine, and run through every door (CLI, pandas, JSONL, stream).

The reference is the single-process engine (whose agreement with HF transformers is tests/e2e's subject). The
fake-executor tests of the handoff itself are tests/unit/test_kv_handoff.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.connectors import engine_cache
from batchllm.entrypoints.cli.main import main
from batchllm.executor.multiproc_executor import WorkerDiedError
from tests.connectors.helpers import openai_batch_texts
from tests.distributed.test_tensor_parallel import SHAPES, gone, prompts, tokens, write_checkpoint

PD = {"prefill": 1, "decode": 1}
MAX_NEW = 8  # a handoff happens once per row, at its prefill: a few decoded tokens show the decode engine's part
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
TEXTS = [f"Describe, in one sentence, the {thing} of a small town." for thing in
         ("market", "school", "station", "harbour", "library")]
SEEDED = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=i) for i in range(len(TEXTS))]


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    for _ in range(4):  # the decode engine frees a load's slots a few steps after it
        engine.step()
    for name, kv in (("prefill", engine.prefill_kv), ("decode", engine.decode_kv)):
        assert kv.pool.num_free_blocks == kv.pool.num_blocks, f"{name} engine leaked blocks"
    link = engine.prefill_kv.link
    assert link.num_free_blocks == link.num_blocks, "buffer slots leaked"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("pd"), **dict(SHAPES["gqa-biases"], num_hidden_layers=3))


def test_greedy_equals_one_engine_with_shared_prefixes_and_decode_preemption(checkpoint):
    shared = prompts(1001)[3]  # 40 tokens: every prompt below starts with them
    prompt_list = [shared + p for p in prompts(1001)] * 2
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # 14 blocks of 16 tokens per engine for 10 rows of 41-80 tokens growing by 40: the decode engine preempts
    # (admitting optimistically: KV-aware admission would hold these forced outputs without preempting).
    options = dict(device="cpu", num_kv_blocks=14, max_num_seqs=6, skip_tokenizer_init=True, seed=0,
                   admission_policy="optimistic")
    expected = tokens(LLM(checkpoint, **options), prompt_list, params)
    llm = LLM(checkpoint, disaggregated=PD, **options)
    try:
        assert tokens(llm, prompt_list, params) == expected
        stats = llm.stats
        assert stats.kv_handoffs == len(prompt_list) and stats.kv_handoff_blocks > 0, stats
        assert stats.num_preemptions > 0, "the decode engine was meant to preempt"
        assert llm.engine.prefill.scheduler.kv_cache.stats.hits > 0, "the shared prefix never hit the prefill cache"
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_engine_texts() -> tuple[list[str], list[str]]:
    """The single-process engine's (greedy, seeded) texts of TEXTS: the reference for every door below."""
    one = LLM(device="cpu")
    greedy, seeded = ([o.outputs[0].text for o in one.generate(TEXTS, params, use_tqdm=False)]
                      for params in (GREEDY, SEEDED))
    return greedy, seeded


def test_the_default_model_through_every_door_greedy_and_seeded(one_engine_texts, tmp_path, capsys):
    """One disaggregated engine, built by the CLI and then cached, serves every door and the seeded rows."""
    expected, expected_seeded = one_engine_texts
    pq.write_table(pa.table({"q": TEXTS}), tmp_path / "in.parquet")
    flags = ["--prompt-column", "q", "--max-tokens", str(MAX_NEW), "--ignore-eos", "--no-progress", "--device", "cpu"]
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), *flags,
                 "--disaggregated", json.dumps(PD)]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "out").to_pydict()["generated_text"] == expected
    llm = engine_cache._cached[1]
    assert llm.stats.kv_handoffs == len(TEXTS)
    got = [[o.outputs[0].text for o in llm.generate(TEXTS, params, use_tqdm=False)] for params in (GREEDY, SEEDED)]
    assert got == [expected, expected_seeded]
    assert llm.stats.kv_handoffs == len(TEXTS)

    engine_kwargs = {"device": "cpu", "disaggregated": PD}
    out = batchllm.generate(pd.DataFrame({"q": TEXTS}), prompt_column="q", engine_kwargs=engine_kwargs,
                            max_tokens=MAX_NEW, temperature=0, ignore_eos=True, use_tqdm=False)
    assert out["generated_text"].tolist() == expected
    assert engine_cache._cached[1] is llm, "the same engine serves the same options"
    assert openai_batch_texts(tmp_path, TEXTS, MAX_NEW, engine_kwargs) == expected
    results = dict(llm.stream(((i, text, GREEDY) for i, text in enumerate(TEXTS)), max_in_flight=2))
    assert [results[i].outputs[0].text for i in range(len(TEXTS))] == expected
    pids = llm.runner.worker_pids
    engine_cache.clear_engine_cache()
    llm.shutdown()
    assert gone(pids, within_s=10)

    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "bad"), *flags, "--disaggregated", '{"prefill": 2}'])
    assert exit_info.value.code == 2
    assert '--disaggregated supports {"prefill": 1, "decode": 1}' in capsys.readouterr().err


def test_a_killed_decode_worker_fails_fast_and_leaves_no_process(checkpoint):
    llm = LLM(checkpoint, device="cpu", num_kv_blocks=64, skip_tokenizer_init=True, disaggregated=PD)
    tokens(llm, prompts(1001))
    pids = llm.runner.worker_pids
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"decode engine worker rank 0 \(pid \d+\) exited with code -9"):
        tokens(llm, prompts(1001))
    assert time.monotonic() - start < 10
    llm.shutdown()
    assert gone(pids, within_s=10)


def test_refused_combinations(checkpoint):
    with pytest.raises(ValueError, match='supports {"prefill": 1, "decode": 1}'):
        LLM(checkpoint, device="cpu", disaggregated={"prefill": 2, "decode": 1})
    with pytest.raises(ValueError, match="disaggregated does not work with tensor_parallel_size"):
        LLM(checkpoint, device="cpu", disaggregated=PD, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"\['buffer_blocks'\] must be an int >= 1"):
        LLM(checkpoint, device="cpu", disaggregated=dict(PD, buffer_blocks=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engines_on_their_gpus_equal_one_engine(checkpoint):
    """On one GPU both engines share it, on two each has its own (engine/prefill_decode_build.py); the prefill
    engine's copies out and the decode engine's copies in run on their own streams, each in its own process."""
    prompt_list = prompts(1001) * 4
    options = dict(device="cuda", dtype="float32", num_kv_blocks=256, skip_tokenizer_init=True, seed=0)
    expected = tokens(LLM(checkpoint, **options), prompt_list)
    llm = LLM(checkpoint, disaggregated=PD, **options)
    try:
        assert tokens(llm, prompt_list) == expected
        assert llm.stats.kv_handoffs == sum(len(p) > 1 for p in prompt_list)
        assert_nothing_held(llm)
    finally:
        llm.shutdown()
