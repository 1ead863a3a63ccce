"""The `batchllm` command's argument handling; jobs themselves are covered by the job tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchllm.cli import main
from tests.connectors.jobs import write_parquet_input


def test_help_lists_the_options():
    result = subprocess.run([sys.executable, "-m", "batchllm", "run", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for flag in ("--prompt-column", "--messages-column", "--template", "--max-tokens", "--temperature", "--seed",
                 "--rows-per-shard", "--model"):
        assert flag in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--prompt-column", "nope"], "unknown column 'nope'"),
    (["--prompt-column", "q", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt-column", "q", "--rows-per-shard", "0"], "rows_per_shard must be an int >= 1"),
    ([], "pass exactly one of prompt_column="),
])
def test_bad_options_exit_2_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", pytest.fail)
    write_parquet_input(tmp_path / "in", [2])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err


def test_prompt_options_do_not_apply_to_openai_batch_files(tmp_path, capsys):
    (tmp_path / "requests.jsonl").write_text("")
    assert main(["run", str(tmp_path / "requests.jsonl"), str(tmp_path / "out.jsonl"), "--prompt-column", "q"]) == 2
    assert "do not apply to an OpenAI batch file" in capsys.readouterr().err


def test_two_prompt_sources_are_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["run", "in", "out", "--prompt-column", "q", "--template", "{q}"])
    assert exit.value.code == 2
