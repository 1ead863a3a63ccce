"""The `batchllm` command's argument handling; jobs themselves are covered by the job tests."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm import SamplingParams
from batchllm.connectors import engine_cache
from batchllm.entrypoints.cli.main import main
from tests.connectors.jobs import write_parquet_input


def test_help_lists_the_options(tmp_path):
    # Not from the repo root, whose kernels/ folder `python -m` would put on sys.path ahead of HF's `kernels`.
    result = subprocess.run([sys.executable, "-m", "batchllm", "run", "--help"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode == 0
    for flag in ("--prompt-column", "--messages-column", "--template", "--max-tokens", "--temperature", "--seed",
                 "--rows-per-shard", "--model"):
        assert flag in result.stdout


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"batchllm {importlib.metadata.version('batchllm')}\n"


def test_version_from_a_source_tree_that_is_not_installed(capsys, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"batchllm {batchllm.__version__}\n"


def test_help_shows_the_default_of_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entry = re.compile(r"^  (-[^\s,]+)(.*?)(?=^  -|\Z)", re.M | re.S)  # a flag's lines, up to the next flag
    entries = {m[1]: " ".join(m[2].split()) for m in entry.finditer(options)}
    assert [flag for flag, text in entries.items() if flag != "-h" and "(default: " not in text] == []
    expected = {"--max-tokens": "256", "--temperature": "0.0", "--top-p": "1.0", "--n": "1", "--seed": "None",
                "--skip-special-tokens": "True", "--load-format": "auto", "--max-num-seqs": "None",
                "--rows-per-shard": "5000", "--truncate": "None", "--output-column": "generated_text"}
    assert {flag: re.search(r"\(default: (\S+)\)", entries[flag])[1] for flag in expected} == expected
    for flag in ("--system-prompt", "--stop-token-ids", "--no-skip-special-tokens", "--load-format"):
        assert flag in options


@pytest.mark.parametrize("args, message", [
    (["--prompt-column", "nope"], "unknown column 'nope'"),
    (["--prompt-column", "q", "--temperature", "-1"], "error: --temperature must be >= 0, got -1.0"),
    (["--prompt-column", "q", "--rows-per-shard", "0"], "error: --rows-per-shard must be an int >= 1, got 0"),
    ([], "error: pass exactly one of --prompt-column, --messages-column or --template\n"),
    (["--messages-column", "q", "--chat"], "error: --chat applies to --prompt-column or --template; --messages-column"),
    (["--prompt-column", "q", "--system-prompt", "Be brief."],
     "error: --system-prompt applies to chat prompts: pass --chat or --messages-column\n"),
])
def test_bad_options_exit_2_before_any_work_naming_flags(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", pytest.fail)
    write_parquet_input(tmp_path / "in", [2])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err


class _Called(Exception):
    """Stands in for run_job: carries the options the command passed."""


def _run_job_arguments(monkeypatch, *flags: str) -> dict:
    def run_job(input, output, **options):
        raise _Called(options)

    monkeypatch.setattr("batchllm.entrypoints.api.run_job", run_job)
    with pytest.raises(_Called) as called:
        main(["run", "in/", "out/", "--prompt-column", "q", *flags])
    return called.value.args[0]


def test_a_bare_run_is_greedy_with_room_for_an_answer_and_the_default_engine(monkeypatch):
    options = _run_job_arguments(monkeypatch)
    assert (options["max_tokens"], options["temperature"], options["engine_kwargs"]) == (256, 0, None)
    # The rest are vLLM's SamplingParams defaults, as in the Python API.
    assert [options[name] for name in ("top_p", "n", "skip_special_tokens", "ignore_eos")] == [1, 1, True, False]


def test_new_flags_reach_the_job(monkeypatch):
    options = _run_job_arguments(monkeypatch, "--stop-token-ids", "1,2", "--no-skip-special-tokens",
                                 "--load-format", "dummy", "--chat", "--system-prompt", "Be brief.")
    assert options["stop_token_ids"] == [1, 2] and options["skip_special_tokens"] is False
    assert options["engine_kwargs"] == {"load_format": "dummy"}
    assert (options["chat"], options["system_prompt"]) == (True, "Be brief.")


def test_bad_token_ids_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["run", "in/", "out/", "--prompt-column", "q", "--stop-token-ids", "1,x"])
    assert exit.value.code == 2 and "comma-separated token ids" in capsys.readouterr().err


def test_system_prompt_job_sends_it_first(llm, tmp_path):
    write_parquet_input(tmp_path / "in", [1])
    question = pq.read_table(tmp_path / "in").column("q")[0].as_py()
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--chat",
                 "--system-prompt", "Reply in French.", "--max-tokens", "2", "--no-progress"]) == 0
    conversation = [{"role": "system", "content": "Reply in French."}, {"role": "user", "content": question}]
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    shard = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    prompt_tokens = len(llm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert shard.column("prompt_tokens").to_pylist() == [prompt_tokens]
    reply = llm.chat([conversation], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert shard.column("generated_text").to_pylist() == [reply]
    manifest_header = json.loads((tmp_path / "out" / "_manifest.jsonl").read_text().splitlines()[0])
    assert "Reply in French." in json.dumps(manifest_header)  # a rerun with another system prompt is refused


def test_a_model_without_a_tokenizer_exits_2_naming_its_directory(llm, tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((llm.model_path / "config.json").read_bytes())
    write_parquet_input(tmp_path / "in", [1])
    # Asking for another model empties the engine cache; give the tests after this one the default engine back.
    monkeypatch.setattr(engine_cache, "_cached", engine_cache._cached)
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--model", str(model),
                 "--no-progress"]) == 2
    assert f"error: {model} has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--prompt-column", "q"], ["--system-prompt", "Be brief."]])
def test_prompt_options_do_not_apply_to_openai_batch_files(tmp_path, capsys, flag):
    (tmp_path / "requests.jsonl").write_text("")
    assert main(["run", str(tmp_path / "requests.jsonl"), str(tmp_path / "out.jsonl"), *flag]) == 2
    assert "do not apply to an OpenAI batch file" in capsys.readouterr().err


def test_two_prompt_sources_are_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["run", "in", "out", "--prompt-column", "q", "--template", "{q}"])
    assert exit.value.code == 2
