"""Ctrl-C (SIGINT) stops a job within an engine step even when every row is in flight at once (fewer rows than
--max-in-flight): the rows in flight are aborted, what finished is kept, and a resume runs every other row exactly
once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import batchllm
from batchllm.connectors.jobs.job import JobInterrupted
from tests.connectors.helpers import reference_texts
from tests.connectors.jobs import read_shards, write_parquet_input

# Every row generates exactly max_tokens tokens (ignore_eos), so none can finish early by chance.
SAMPLING = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _saved_rows(output: Path) -> int:
    lines = (output / "_manifest.jsonl").read_text().splitlines()[1:]
    return sum(json.loads(line)["rows"] for line in lines)


@pytest.fixture
def steps(llm, monkeypatch):
    """Counts the engine's steps; `steps.sigint_at = k` sends this process SIGINT as step k starts."""
    class Steps(list):
        sigint_at: int | None = None

    calls, real_step = Steps(), llm.engine.step

    def step():
        calls.append(len(calls) + 1)
        if len(calls) == calls.sigint_at:
            signal.raise_signal(signal.SIGINT)  # its handler has run when this returns
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    return calls


def test_sigint_aborts_the_rows_in_flight_within_a_step_then_resume_runs_each_row_once(llm, tmp_path, steps):
    table = write_parquet_input(tmp_path / "in", [6])
    job = {"prompt_column": "q", "rows_per_shard": 2, "use_tqdm": False, **SAMPLING}
    steps.sigint_at = 2  # all 6 rows are in the engine (the default max_in_flight is 512); each needs 6 steps
    with pytest.raises(JobInterrupted) as interrupted:
        batchllm.run_job(tmp_path / "in", tmp_path / "out", **job)
    assert len(steps) <= steps.sigint_at + 1  # the step under way, and at most one launched before the signal
    pool = llm.engine.scheduler.kv_cache.pool
    assert not llm.engine.has_unfinished() and pool.num_free_blocks == pool.num_blocks  # aborted, nothing leaked
    assert interrupted.value.result.written_rows == _saved_rows(tmp_path / "out") == 0

    steps.sigint_at = None
    result = batchllm.run_job(tmp_path / "in", tmp_path / "out", **job)
    assert (result.resumed_rows, result.written_rows, result.complete) == (0, 6, True)
    shards = read_shards(tmp_path / "out").sort_by("id")
    assert shards.column("id").to_pylist() == table.column("id").to_pylist()  # each row exactly once
    assert shards.column("generated_text").to_pylist() == reference_texts(llm, table.column("q").to_pylist(),
                                                                          **SAMPLING)


def test_sigint_keeps_the_rows_that_finished_and_resume_answers_the_others_once(llm, tmp_path, steps):
    """An OpenAI batch file whose first two requests want one token and the other four six, all in flight at once:
    the signal comes once the short ones are done."""
    prompts = [f"Line {i}: the weather today is" for i in range(6)]
    budgets = [1, 1, 6, 6, 6, 6]
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": prompt, "max_tokens": budget, "temperature": 0, "ignore_eos": True}}) + "\n"
        for i, (prompt, budget) in enumerate(zip(prompts, budgets))))
    steps.sigint_at = 3
    with pytest.raises(JobInterrupted) as interrupted:
        batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", rows_per_shard=2, use_tqdm=False)
    assert len(steps) <= steps.sigint_at + 1
    assert interrupted.value.result.written_rows == 2  # the two short answers, kept

    steps.sigint_at = None
    result = batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", rows_per_shard=2, use_tqdm=False)
    assert (result.resumed_rows, result.written_rows, result.complete) == (2, 4, True)
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"r{i}" for i in range(6)]  # each request exactly once
    texts = {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers}
    expected = [*reference_texts(llm, prompts[:2], **{**SAMPLING, "max_tokens": 1}),
                *reference_texts(llm, prompts[2:], **SAMPLING)]
    assert [texts[f"r{i}"] for i in range(6)] == expected


def test_ctrl_c_on_the_command_line_exits_130_long_before_the_rows_finish(llm, tiny_llama_dir, tmp_path):
    write_parquet_input(tmp_path / "in", [8])
    output, log = tmp_path / "out", tmp_path / "job.log"
    # 8 rows, all in flight at once (the default --max-in-flight is 512), each 2000 tokens: 2000 steps or more of the
    # session's tiny Llama (~1-3 ms each; the point is the signal, not the weights), with room in its KV cache for
    # them all (by default 65,536 blocks, 512 MB).
    command = [sys.executable, "-m", "batchllm", "run", str(tmp_path / "in"), str(output), "--prompt-column", "q",
               "--model", str(tiny_llama_dir), "--num-kv-blocks", "1024", "--max-tokens", "2000", "--ignore-eos",
               "--rows-per-shard", "4"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "generating:" not in log.read_text():  # the progress bar: the engine is up and the rows are going in
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=600) == 128 + signal.SIGINT, log.read_text()
    assert _saved_rows(output) == 0 and not list(output.glob("*.parquet"))  # no row ran to its end
    text = log.read_text()
    assert "SIGINT: no new rows are admitted; the rows in flight stop after this step" in text
    assert "interrupted by SIGINT: 0 of 8 rows are saved" in text and "run the same job again to resume" in text
