"""A `batchllm run` subprocess killed at several points (SIGKILL: no cleanup at all) and resumed: every
input row ends up exactly once in the output, equal to an uninterrupted run. SIGINT stops gracefully.

The point is the job's bookkeeping, so it runs on the session's tiny random Llama, the reference being the same model
run uninterrupted in this process. Its decode steps cost ~1-3 ms, so each row asks for many tokens (EOS ignored):
the job must still be generating for a second or more, long enough for three kills at different points."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

import batchllm
from batchllm import LLM
from tests.connectors.jobs import read_shards, write_parquet_input

ROWS_PER_SHARD = 4
GREEDY = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
# What the job needs; by default the tiny model would get 65,536 blocks (512 MB) in every process.
KV_BLOCKS = 64
JOB = {"prompt_column": "q", "rows_per_shard": ROWS_PER_SHARD, "max_in_flight": 4, **GREEDY}


def _command(model: Path, input: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "batchllm", "run", str(input), str(output), "--model", str(model),
            "--prompt-column", "q", "--max-tokens", str(GREEDY["max_tokens"]),
            "--temperature", str(GREEDY["temperature"]), "--ignore-eos",
            "--num-kv-blocks", str(KV_BLOCKS), "--rows-per-shard", str(ROWS_PER_SHARD),
            "--max-in-flight", str(JOB["max_in_flight"])]


def _records(output: Path) -> int:
    manifest = output / "_manifest.jsonl"
    return max(0, len(manifest.read_bytes().split(b"\n")) - 2) if manifest.exists() else 0


def _start(model: Path, input: Path, output: Path, log: Path) -> subprocess.Popen:
    # Not from the repo root: `python -m` puts the cwd on sys.path, and the root's kernels/ shadows HF's `kernels`.
    return subprocess.Popen(_command(model, input, output), cwd=log.parent, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)


def _wait_until(process: subprocess.Popen, condition, timeout: float = 600) -> bool:
    """Poll until `condition()`; False if the job exited first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def job_input(tmp_path_factory) -> tuple[Path, pa.Table]:
    directory = tmp_path_factory.mktemp("kill") / "in"
    table = write_parquet_input(directory, [11, 9, 7], row_group_size=5)  # 27 rows: 7 shards, across files
    return directory, table


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, device="cpu", num_kv_blocks=KV_BLOCKS)


@pytest.fixture(scope="module")
def uninterrupted(job_input, tmp_path_factory, tiny) -> pa.Table:
    output = tmp_path_factory.mktemp("reference") / "out"
    batchllm.run_job(job_input[0], output, llm=tiny, use_tqdm=False, **JOB)
    return read_shards(output).sort_by("id")


def _check_exactly_once(output: Path, table: pa.Table, uninterrupted: pa.Table) -> None:
    shards = read_shards(output)
    assert sorted(shards.column("id").to_pylist()) == table.column("id").to_pylist()  # each row once
    assert shards.sort_by("id").equals(uninterrupted)
    assert not [p.name for p in output.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_sigkill_at_several_points_then_resume(tiny_llama_dir, job_input, uninterrupted, tmp_path):
    input, table = job_input
    output, log = tmp_path / "out", tmp_path / "job.log"
    kills = []

    def kill(process: subprocess.Popen, point: str) -> None:
        assert process.poll() is None, f"the job ended before the kill {point}: {log.read_text()}"
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=600) == -signal.SIGKILL
        kills.append((point, _records(output)))

    # 1: at a random moment once generation has started (the progress bar appears after the engine loads).
    process = _start(tiny_llama_dir, input, output, log)
    assert _wait_until(process, lambda: "generating:" in log.read_text()), log.read_text()
    time.sleep(random.uniform(0, 0.5))
    kill(process, "at a random moment")
    # 2 and 3: right after the resumed job records one more shard (often while it writes the next one).
    for point in ("after one more shard", "after yet another shard"):
        before = _records(output)
        process = _start(tiny_llama_dir, input, output, log)
        assert _wait_until(process, lambda: _records(output) > before), log.read_text()
        kill(process, point)
    assert len({records for _, records in kills}) == 3, kills  # three different points of the job

    final = _start(tiny_llama_dir, input, output, log)
    assert final.wait(timeout=600) == 0, log.read_text()
    assert log.read_text().rstrip().splitlines()[-1].startswith("batchllm: done:")
    _check_exactly_once(output, table, uninterrupted)


def test_sigint_flushes_completed_shards_and_says_how_to_resume(tiny_llama_dir, tiny, job_input, uninterrupted,
                                                                 tmp_path):
    input, table = job_input
    output, log = tmp_path / "out", tmp_path / "job.log"
    process = _start(tiny_llama_dir, input, output, log)
    assert _wait_until(process, lambda: _records(output) >= 1), log.read_text()
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=600)
    text = log.read_text()
    if code == 0:
        pytest.skip("the job finished before the signal arrived")
    assert code == 128 + signal.SIGINT, text
    assert "SIGINT: no new rows are admitted" in text and "run the same job again to resume" in text
    assert f"batchllm run {input} {output}" in text
    # Completed shards, plus checkpoints of the finished rows of the shards the signal left unfinished.
    records = [json.loads(line) for line in (output / "_manifest.jsonl").read_text().splitlines()[1:]]
    assert sorted(p.name for p in output.glob("part-*.parquet")) == sorted(r["file"] for r in records if r["complete"])
    assert sorted(f"_partial/{p.name}" for p in output.glob("_partial/*")) == sorted(
        r["file"] for r in records if not r["complete"])

    result = batchllm.run_job(input, output, llm=tiny, use_tqdm=False, **JOB)
    assert result.resumed_rows == sum(r["rows"] for r in records) and result.complete
    _check_exactly_once(output, table, uninterrupted)
