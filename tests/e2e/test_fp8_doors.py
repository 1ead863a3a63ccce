"""FP8 weights and the FP8 KV cache through every door: the CLI flags on a Parquet table with two data-parallel
replicas, an OpenAI batch file and a pandas frame through `engine_kwargs`, a job's manifest pinning them,
preemption and the prefix cache on FP8 blocks, and tensor parallelism sharding the scales with their weights.

The expected text is the single-process `LLM(quantization="fp8", kv_cache_dtype="fp8")`'s greedy output, whose
quality against HF transformers is tests/e2e/test_fp8_quality.py's subject. These tests check that each door
gets that engine; the fixture checks that its output differs from the float32 model's, so a door that dropped
the options would fail. The doors run the session's tiny random Llama (tests/conftest.py), where FP8 changes
the greedy text too: their point is the options reaching the engines, not FP8's numerics. The preemption and
prefix-cache test keeps the default model, whose FP8 rounding its tolerance was measured on.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.distributed import parallel_state
from batchllm.entrypoints.cli.main import main
from batchllm.model.loader import load_model
from tests.distributed.test_tensor_parallel import SHAPES, engine, prompts, write_checkpoint
from tests.e2e.conftest import QUESTIONS

FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
# Two prompts sharing a long prefix, for the prefix cache; the questions, for everything else.
SHARED = "You are a careful assistant. Answer in one short sentence, without any preamble or apology. " * 3
TEXTS = [*QUESTIONS, SHARED + "What is 2 + 2?", SHARED + "Name a color."]


@pytest.fixture(scope="module")
def fp8_texts(tiny) -> list[str]:
    texts = [out.outputs[0].text for out in LLM(tiny, **FP8).generate(TEXTS, GREEDY, use_tqdm=False)]
    float32 = [out.outputs[0].text for out in LLM(tiny).generate(TEXTS, GREEDY, use_tqdm=False)]
    assert texts != float32  # else equal outputs could not tell whether a door applied the options
    return texts


def test_the_cli_flags_reach_both_replicas_and_the_manifest_pins_them(tiny, fp8_texts, tmp_path, capsys):
    pq.write_table(pa.table({"q": TEXTS}), tmp_path / "in.parquet")
    run = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q", "--model", tiny,
           "--max-tokens", str(MAX_NEW), "--rows-per-shard", "2", "--no-progress"]
    assert main([*run, "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--data-parallel", "2"]) == 0, \
        capsys.readouterr().err
    assert pq.read_table(tmp_path / "out").to_pydict()["generated_text"] == fp8_texts
    # Resuming under other numerics would mix two models' rows in one output: refused, naming the difference.
    (tmp_path / "out" / "part-00002.parquet").unlink()
    assert main([*run, "--kv-cache-dtype", "auto", "--quantization", "fp8"]) == 2
    assert '--kv-cache-dtype: was "fp8", now "auto"' in capsys.readouterr().err  # the refusal names the flag


def test_bad_flag_values_name_the_flag_and_what_is_supported(tmp_path, capsys):
    pq.write_table(pa.table({"q": ["hi"]}), tmp_path / "in.parquet")
    for flags, message in ((["--quantization", "bitsandbytes"], "--quantization: invalid choice: 'bitsandbytes'"),
                           (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: invalid choice: 'int8'")):
        with pytest.raises(SystemExit) as exit_info:
            main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q", *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported; supported: 'auto'"):
        LLM(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not supported; supported: quantization='fp8'"):
        LLM(quantization="bitsandbytes")


def test_an_openai_batch_file_and_a_pandas_frame_take_engine_kwargs(tiny, fp8_texts, tmp_path):
    frame = pd.DataFrame({"q": TEXTS})
    out = batchllm.generate(frame, prompt_column="q", model=tiny, engine_kwargs=FP8, max_tokens=MAX_NEW, temperature=0,
                            use_tqdm=False)
    assert out["generated_text"].tolist() == fp8_texts
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": text, "max_tokens": MAX_NEW, "temperature": 0}})
             for i, text in enumerate(TEXTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=tiny, engine_kwargs=FP8, use_tqdm=False)
    answers = {a["custom_id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [answers[f"r{i}"]["response"]["body"]["choices"][0]["text"] for i in range(len(TEXTS))] == fp8_texts
    # The manifest pins the numerics here too.
    with pytest.raises(ManifestMismatch, match="quantization"):
        batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=tiny, use_tqdm=False)


def assert_same_path(expected, got, tolerance: float = 0.2) -> None:
    """`got`'s logprobs within `tolerance` of `expected`'s along its greedy tokens, until a token differs; a
    differing token is allowed only at a near tie (expected's top two within `tolerance`)."""
    for row, (want, have) in enumerate(zip(expected, got, strict=True)):
        for position, (token, mine) in enumerate(zip(want.token_ids, have.token_ids, strict=True)):
            if token != mine:
                first, second = sorted((lp.logprob for lp in want.logprobs[position].values()), reverse=True)[:2]
                assert first - second < tolerance, (row, position, first, second)
                break
            difference = abs(want.logprobs[position][token].logprob - have.logprobs[position][token].logprob)
            assert difference < tolerance, (row, position, difference)


def test_preemption_and_the_prefix_cache_on_fp8_blocks():
    """An FP8 KV cache under a tiny pool (preemption and recompute), a 16-token budget (chunked prefill) and the
    prefix cache (the shared prefix's FP8 blocks reused), on the asynchronous loop, against a roomy engine.

    FP8 makes chunking visible: a key computed in another chunk differs from the unchunked one in the last
    float32 bits, which now and then moves it across an E4M3 rounding boundary (on this model, prefilling a
    7-token prompt in two chunks moves the logits by 1e-3, against 1.5e-5 in float32). So the outputs are
    compared as logprobs along the roomy engine's tokens, within 0.2, until a token differs, which is allowed
    only where the roomy engine's top two were within 0.2 of each other (a near tie). Measured here: at most
    0.071 apart in three pool sizes, and one flip, at a gap of 0.064. Corrupt or misplaced FP8 blocks move
    the logprobs by whole units.
    """
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    [roomy, tight] = [LLM(kv_cache_dtype="fp8", **options) for options in
                      ({}, dict(num_kv_blocks=8, max_num_batched_tokens=16, async_scheduling=True,
                                            admission_policy="optimistic"))]
    expected = [out.outputs[0] for out in roomy.generate(TEXTS, params, use_tqdm=False)]
    got = [out.outputs[0] for out in tight.generate(TEXTS, params, use_tqdm=False)]
    stats = tight.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert_same_path(expected, got)


# Rank r of 2 on SHAPES["gqa-biases"] (4 heads of 16, 2 KV heads, a 128-wide MLP): the TP=1 rows of each fused
# column layer it holds.
TP2_COLUMN_ROWS = {
    "qkv_proj": lambda r: [*range(32 * r, 32 * r + 32), *range(64 + 16 * r, 64 + 16 * r + 16),
                           *range(96 + 16 * r, 96 + 16 * r + 16)],
    "gate_up_proj": lambda r: [*range(64 * r, 64 * r + 64), *range(128 + 64 * r, 128 + 64 * r + 64)],
}


def load_as_rank(checkpoint, rank: int, size: int, **options):
    """`load_model` as tensor-parallel rank `rank` of `size` would (no process group: only the sharding)."""
    previous = parallel_state._state
    parallel_state._state = parallel_state.TensorParallel(rank, size)
    try:
        return load_model(checkpoint, "cpu", torch.float32, **options)[0]
    finally:
        parallel_state._state = previous


def test_tensor_parallel_ranks_hold_their_rows_with_their_scales(tmp_path):
    """Each rank's FP8 rows and scales are exactly TP=1's rows for it; a row layer keeps every output scale."""
    checkpoint = write_checkpoint(tmp_path, **SHAPES["gqa-biases"])
    whole, _ = load_model(checkpoint, "cpu", torch.float32, quantization="fp8")
    for rank in range(2):
        shard = load_as_rank(checkpoint, rank, 2, quantization="fp8")
        for name, module in shard.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            full = whole.get_submodule(name)
            kind = name.rsplit(".", 1)[-1]
            if kind in TP2_COLUMN_ROWS:
                rows = TP2_COLUMN_ROWS[kind](rank)
                expected_weight, expected_scale = full.weight[rows], full.weight_scale[rows]
            else:  # o_proj, down_proj: this rank's input columns, all output channels
                width = full.weight.shape[1] // 2
                expected_weight, expected_scale = full.weight[:, rank * width:(rank + 1) * width], full.weight_scale
            assert torch.equal(module.weight.view(torch.uint8), expected_weight.contiguous().view(torch.uint8)), name
            assert torch.equal(module.weight_scale, expected_scale), name


def test_tensor_parallel_2_runs_fp8_like_one_process(tmp_path):
    """Row layers quantize each rank's slice of the activations with its own scale, so TP=2 is not bitwise
    TP=1: compared as logprobs along TP=1's greedy path (see `assert_same_path`)."""
    checkpoint = write_checkpoint(tmp_path, **SHAPES["gqa-biases"])
    prompt_list = prompts(SHAPES["gqa-biases"]["vocab_size"])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    expected, got = ([out.outputs[0] for out in engine(checkpoint, tp, **FP8).generate(prompt_list, params,
                                                                                         use_tqdm=False)]
                     for tp in (1, 2))
    assert_same_path(expected, got)
