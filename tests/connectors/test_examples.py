"""Every connector example runs as written, with tiny settings, on the default model.

Python examples run in this process (so they share the cached engine); the shell example runs the real
`batchllm` console script."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def run_example(monkeypatch, capsys, llm):
    def run(name: str, *args: str) -> str:
        monkeypatch.setattr(sys, "argv", [name, *args])
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
        return capsys.readouterr().out

    return run


def test_pandas_pipe(run_example):
    out = run_example("pandas_pipe.py", "--max-tokens", "4")
    assert "[q-geo] What is the capital of Italy?" in out and "error: prompt column 'question' is null" in out


def test_hf_datasets(run_example):
    out = run_example("hf_datasets.py", "--max-tokens", "4", "--rows", "2")
    assert "num_rows: 2" in out and out.count(" -> ") == 2


def test_parquet_job_python(run_example, tmp_path):
    out = run_example("parquet_job.py", str(tmp_path), "--rows", "5", "--max-tokens", "4")
    assert "5 rows written now, 0 were already done" in out
    out = run_example("parquet_job.py", str(tmp_path), "--rows", "5", "--max-tokens", "4")
    assert "0 rows written now, 5 were already done" in out


def test_openai_batch(run_example, tmp_path):
    out = run_example("openai_batch.py", str(tmp_path), "--max-tokens", "4")
    assert "capital: " in out and "completion: " in out and "broken: error: line 4: invalid JSON" in out


def test_synthetic_data(run_example, tmp_path):
    out = run_example("synthetic_data.py", str(tmp_path / "qa.parquet"), "--topics", "1", "--per-topic", "2",
                      "--max-tokens", "6")
    table = pq.read_table(tmp_path / "qa.parquet")
    assert table.column_names == ["topic", "question", "answer", "answer_finish_reason", "answer_error"]
    assert 1 <= table.num_rows <= 2 and f"{table.num_rows} question/answer pairs written" in out


def test_parquet_job_shell(tmp_path):
    env = {**os.environ, "MAX_TOKENS": "4", "ROWS": "3", "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(EXAMPLES / "parquet_job.sh"), str(tmp_path)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "3 rows written" in result.stderr and "nothing to do: the job is complete (3 rows in" in result.stderr
    assert result.stdout.count(" -> ") == 3
