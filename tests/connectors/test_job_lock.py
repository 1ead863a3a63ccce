"""One job per output: a second `batchllm run` on an output in use fails at once (rc 2, naming the output and
the holder's pid) and touches nothing; a lock file left by a killed job is no obstacle; OS errors end as
`batchllm: error: ...` with rc 2, never a traceback."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

import batchllm
from batchllm.connectors.jobs.atomic import write_atomically
from batchllm.connectors.jobs.lock import OutputInUse, output_lock
from batchllm.entrypoints.cli.main import main
from tests.connectors.jobs import write_parquet_input

FLAGS = ["--max-tokens", "2", "--rows-per-shard", "2", "--no-progress"]


def _requests(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": f"Number {i} is"}}) + "\n" for i in range(count)))
    return path


def _custom_ids(path: Path) -> list[str]:
    return sorted(json.loads(line)["custom_id"] for line in path.read_text().splitlines())


def test_a_second_parquet_job_on_a_busy_output_fails_before_touching_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", pytest.fail)  # no engine is built
    write_parquet_input(tmp_path / "in", [3])
    output = tmp_path / "out"
    output.mkdir()
    (output / ".part-00000.parquet.tmp-1").write_bytes(b"another job's file in flight")
    with output_lock(output / "_lock", output):
        code = main(["run", str(tmp_path / "in"), str(output), "--prompt-column", "q", *FLAGS])
        with pytest.raises(OutputInUse):
            batchllm.run_job(tmp_path / "in", output, prompt_column="q", use_tqdm=False)
    error = capsys.readouterr().err
    assert code == 2 and error.startswith(f"batchllm: error: output {output} is in use by another batchllm job "
                                          f"(pid {os.getpid()}")
    # Its temporary file is untouched (stale-temporary cleanup comes after the lock); no manifest was started.
    assert sorted(p.name for p in output.iterdir()) == [".part-00000.parquet.tmp-1"]


def test_a_second_jsonl_job_is_refused_and_nothing_is_answered_twice(tmp_path, capsys, llm):
    requests, results = _requests(tmp_path / "requests.jsonl", 3), tmp_path / "results.jsonl"
    command = ["run", str(requests), str(results), *FLAGS]
    lock = tmp_path / "results.jsonl.lock"
    lock.write_text("4242\n")  # left by a job killed with -9: the file remains, its flock died with it
    assert main(command) == 0
    assert _custom_ids(results) == ["r0", "r1", "r2"] and not lock.exists()
    digest = hashlib.sha256(results.read_bytes()).hexdigest()
    with output_lock(lock, results):
        assert main([*command, "--retry-errors"]) == 2
    assert f"output {results} is in use by another batchllm job (pid {os.getpid()}" in capsys.readouterr().err
    assert hashlib.sha256(results.read_bytes()).hexdigest() == digest  # every custom_id still exactly once
    assert main(command) == 0 and _custom_ids(results) == ["r0", "r1", "r2"]


def test_os_errors_are_reported_not_raised(tmp_path, capsys, monkeypatch, llm):
    write_parquet_input(tmp_path / "in", [1])
    (tmp_path / "file").write_text("")
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "file" / "out"), "--prompt-column", "q", *FLAGS]) == 2
    error = capsys.readouterr().err
    assert error == f"batchllm: error: Not a directory: {tmp_path / 'file' / 'out'}\n"

    def read_only(source, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(target))

    monkeypatch.setattr(os, "replace", read_only)  # where the manifest is first written
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", *FLAGS]) == 2
    error = capsys.readouterr().err
    assert error == f"batchllm: error: Read-only file system: {tmp_path / 'out' / '_manifest.jsonl'}\n"


def test_write_atomically_keeps_the_original_error_when_cleanup_fails_too(tmp_path, monkeypatch):
    def full_disk(file):
        raise OSError(errno.ENOSPC, "No space left on device")

    def unremovable(path, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "unlink", unremovable)
    with pytest.raises(OSError) as error:
        write_atomically(tmp_path / "x", full_disk)
    assert error.value.errno == errno.ENOSPC and error.value.__context__ is None
