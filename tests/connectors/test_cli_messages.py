"""What `batchllm run` says when it refuses or fails: one line naming flags and paths, and nothing left behind by a
run refused before any work."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest

from batchllm.connectors import engine_cache
from batchllm.entrypoints.cli.main import _parser, main
from tests.connectors.jobs import write_parquet_input


def _request_file(path, rows: int) -> None:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": f"Say {i}:"}}) + "\n" for i in range(rows)))


@pytest.fixture
def keep_cached_engine(monkeypatch):
    """A run asking for another engine empties the engine cache: give the tests after it the default one back."""
    monkeypatch.setattr(engine_cache, "_cached", engine_cache._cached)


@pytest.fixture
def unsupported_model(llm, tmp_path):
    """The default model's config and tokenizer, under an architecture nobody implements."""
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((llm.model_path / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NopeForCausalLM"]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((llm.model_path / name).read_bytes())
    return model


@pytest.mark.parametrize("flags, message", [
    (["--dtype", "float99"], "--dtype 'float99' must be"),
    (["--model", "no/such/model"], "model 'no/such/model' is not a local directory"),
    (["--model", "UNSUPPORTED"], "Model architecture 'NopeForCausalLM' is not supported"),
])
@pytest.mark.parametrize("table", [True, False], ids=["table", "openai-batch"])
def test_a_run_refused_before_any_work_creates_nothing(tmp_path, capsys, keep_cached_engine, unsupported_model,
                                                       flags, message, table):
    flags = [str(unsupported_model) if flag == "UNSUPPORTED" else flag for flag in flags]
    if table:
        write_parquet_input(tmp_path / "in", [2])
        input, output, prompt = tmp_path / "in", tmp_path / "new" / "deeper" / "out", ["--prompt-column", "q"]
    else:
        _request_file(tmp_path / "requests.jsonl", 2)
        input, output, prompt = tmp_path / "requests.jsonl", tmp_path / "new" / "deeper" / "out.jsonl", []
    assert main(["run", str(input), str(output), *prompt, *flags, "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_refused_run_keeps_an_output_directory_that_was_there(tmp_path, keep_cached_engine):
    write_parquet_input(tmp_path / "in", [2])
    (tmp_path / "out").mkdir()
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--dtype", "x"]) == 2
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "out").iterdir())


def test_a_bad_model_path_advises_leaving_the_flag_out(tmp_path, capsys, keep_cached_engine):
    write_parquet_input(tmp_path / "in", [1])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "leave out --model for the default model" in err and "--model None" not in err


@pytest.mark.parametrize("written_as, named, table", [
    (r"\.part-00000\.parquet\.tmp-\d+", "part-00000.parquet", True),  # a shard, through a temporary file
    (r"_manifest\.jsonl", "_manifest.jsonl", True),  # a record appended to the manifest
    (r"out\.jsonl", "out.jsonl", False),  # an OpenAI batch job's answers, appended
])
def test_a_full_disk_names_the_file(llm, tmp_path, capsys, monkeypatch, written_as, named, table):
    if table:
        write_parquet_input(tmp_path / "in", [2])
        input, output, prompt = tmp_path / "in", tmp_path / "out", ["--prompt-column", "q"]
        named = output / named
    else:
        _request_file(tmp_path / "requests.jsonl", 2)
        input, output, prompt = tmp_path / "requests.jsonl", tmp_path / named, []
        named = output
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the disk fills up under one file: its fsync is where the kernel says so
        if re.fullmatch(written_as, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert main(["run", str(input), str(output), *prompt, "--max-tokens", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"batchllm: error: No space left on device: {named}\n"


def test_a_refused_resume_names_the_flags_that_changed(llm, tmp_path, capsys):
    write_parquet_input(tmp_path / "in", [2])
    run = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--max-tokens", "2", "--no-progress"]
    assert main([*run, "--prompt-column", "q"]) == 0
    assert main([*run, "--template", "Q: {q}", "--temperature", "0.5", "--top-p", "0.9", "--stop", "."]) == 2
    err = capsys.readouterr().err
    changes = re.findall(r"^  (.*)$", err, re.M)
    assert changes == ['--prompt-column: was "q", now null', '--template: was null, now "Q: {q}"',
                       "--temperature: was 0.0, now 0.5", "--top-p: was 1.0, now 0.9", '--stop: was null, now ["."]']


@pytest.mark.parametrize("key, name", [
    ("options.sampling_params.top_k", "--top-k"),
    ("options.sampling_params.structured_outputs.spec", "--json-schema / --regex / --choice"),
    ("options.sampling_params", "--task"),  # there are sampling options only when generating
    ("options.prompt.prompt_template", "--template"),
    ("options.prompt.system_prompt", "--system-prompt"),
    ("options.pooling.normalize", "--normalize"),
    ("options.pooling.classify", "--task"),
    ("options.loras[0]", "--lora"),
    ("options.output_column", "--output-column"),
    ("defaults.stop_token_ids", "--stop-token-ids"),
    ("quantization.kv_cache_dtype", "--kv-cache-dtype"),
    ("quantization", "--quantization / --kv-cache-dtype"),
    ("max_model_len", "--max-model-len"),
    ("max_tokens_cap", "--max-tokens-cap"),
    ("input.files[0].footer_sha256", "INPUT (input.files[0].footer_sha256)"),
    ("tokenizer.chat_template_sha256", "--model (tokenizer.chat_template_sha256)"),
    ("adapters.fr.adapter_config.json", "--lora (adapters.fr.adapter_config.json)"),
    ("options.sampling_params.include_stop_str_in_output", "options.sampling_params.include_stop_str_in_output"),
])
def test_each_manifest_key_reads_as_its_flag(key, name):
    from batchllm.connectors.jobs.manifest import Difference, ManifestMismatch
    from batchllm.entrypoints.cli.resume import changed_options_message

    flags = _parser().parse_args(["run", "in", "out"]).flags_by_python_name
    mismatch = ManifestMismatch("", Path("m.jsonl"), [Difference(key, 1, 2)])
    assert re.findall(r"^  (.*)$", changed_options_message(mismatch, flags), re.M) == [f"{name}: was 1, now 2"]


def test_a_refused_batch_file_resume_names_the_flags_that_changed(llm, tmp_path, capsys):
    _request_file(tmp_path / "requests.jsonl", 1)
    run = ["run", str(tmp_path / "requests.jsonl"), str(tmp_path / "out.jsonl"), "--no-progress"]
    assert main([*run, "--max-tokens", "2"]) == 0
    assert main([*run, "--max-tokens", "3", "--seed", "7"]) == 2
    assert re.findall(r"^  (.*)$", capsys.readouterr().err, re.M) == ["--seed: was null, now 7",
                                                                     "--max-tokens: was 2, now 3"]


def test_a_job_with_nothing_left_says_it_is_complete(llm, tmp_path, capsys):
    write_parquet_input(tmp_path / "in", [3])
    run = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--max-tokens", "2",
           "--rows-per-shard", "2", "--no-progress"]
    assert main(run) == 0
    capsys.readouterr()
    assert main(run) == 0
    assert capsys.readouterr().err == f"batchllm: nothing to do: the job is complete (3 rows in {tmp_path / 'out'})\n"


@pytest.mark.parametrize("flags, message", [
    (["--json-schema", "missing.json"],
     "argument --json-schema: cannot read the JSON schema file 'missing.json': No such file or directory"),
    (["--choice", "a,b", "--regex", "x"], "argument --regex: not allowed with argument --choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_argument_errors_are_one_line(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(["run", "in", "out", "--prompt-column", "q", *flags])
    assert exit.value.code == 2
    assert capsys.readouterr().err == f"batchllm: error: {message}\n"


def test_parse_json_help_names_every_flag_it_works_with(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = re.search(r"^  --parse-json\s+(.*)$", capsys.readouterr().out, re.M)[1]
    for flag in ("--json-schema", "--schema-column", "--regex", "--choice", "--output-column", "--n"):
        assert flag in help_text
