"""Data parallelism with two CPU replicas: results equal the in-process single-engine path (which shares no code
with the replica pool), a replica that dies mid-job has its rows re-run by the other, and no replica process
outlives its call. The point is the pool's bookkeeping, not the weights: the engines run a tiny random Llama
with the default model's tokenizer (tests/tiny_models.py)."""

from __future__ import annotations

import json
import multiprocessing
import warnings

import pandas as pd
import psutil
import pytest

import batchllm
from batchllm.connectors.replicas.devices import gpu_groups
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.connectors.replicas.replica import EXIT_AFTER_ROWS_ENV
from batchllm.entrypoints.cli.main import main
from tests.connectors.helpers import GREEDY
from tests.connectors.jobs import read_shards, write_parquet_input
from tests.tiny_models import TINY_LLAMA_TP3, write_tiny_llama

JOB = {"prompt_column": "q", "rows_per_shard": 4, "use_tqdm": False, **GREEDY}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, keep_the_engine_cache) -> str:
    """The session's tiny Llama, as `model=`: it replaces the engine cache's entry, put back after the module."""
    return str(tiny_llama_dir)


@pytest.fixture(autouse=True)
def no_replica_outlives_its_call(monkeypatch):
    pids = []
    start = ReplicaPool._start

    def recording_start(self, *args):
        replica = start(self, *args)
        pids.append(replica.pid)
        return replica

    monkeypatch.setattr(ReplicaPool, "_start", recording_start)
    yield pids
    assert multiprocessing.active_children() == []
    assert [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"] == []


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dp") / "in"
    return directory, write_parquet_input(directory, [7, 5], row_group_size=4)  # 12 rows: 3 shards, 2 files


@pytest.fixture(scope="module")
def single(job_input, tmp_path_factory, tiny):
    """The single-engine job's output directory: the reference."""
    output = tmp_path_factory.mktemp("single") / "out"
    batchllm.run_job(job_input[0], output, model=tiny, **JOB)
    return output


def _manifest(directory):
    header, *records = [json.loads(line) for line in (directory / "_manifest.jsonl").read_text().splitlines()]
    return header, sorted(records, key=lambda r: r["index"])  # shards finish, and are recorded, in any order


def _shard_files(directory):
    return {p.name: p for p in directory.glob("part-*.parquet")}


def test_generate_equals_one_engine_with_bad_rows_and_seeded_sampling(tiny, no_replica_outlives_its_call):
    prompts = [f"Item {i}: a word about {w}:" for i, w in enumerate(["tea", "rain", "maps"] * 4)]
    prompts[5], prompts[11] = None, "   "  # bad rows are answered in the parent, never sent to a replica
    frame = pd.DataFrame({"q": prompts}, index=pd.Index(range(100, 112), name="key")).iloc[::-1]
    # Seeded sampling: every row draws from its own generator, so replicas must agree with one engine.
    options = {"prompt_column": "q", "model": tiny, "max_tokens": 6, "temperature": 0.9, "seed": 11, "use_tqdm": False}
    expected = batchllm.generate(frame, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a replica failure would warn
        got = batchllm.generate(frame, data_parallel_size=2, **options)
    pd.testing.assert_frame_equal(got, expected)
    assert got.error.notna().sum() == 2 and got.generated_text.notna().sum() == 10
    assert len(no_replica_outlives_its_call) == 2


def test_replicas_may_each_be_tensor_parallel(keep_the_engine_cache, no_replica_outlives_its_call, tmp_path):
    """tp × dp on the CPU: two replicas, each running a tiny Llama (6 heads, 3 KV heads) over three gloo ranks."""
    model = str(write_tiny_llama(tmp_path / "tiny-tp3", **TINY_LLAMA_TP3))
    frame = pd.DataFrame({"q": ["Name a colour.", "Name a fruit.", "Name a city.", "Name a tree."]})
    options = {"prompt_column": "q", "model": model, "max_tokens": 4, "temperature": 0, "use_tqdm": False}
    expected = batchllm.generate(frame, **options)
    got = batchllm.generate(frame, data_parallel_size=2, engine_kwargs={"tensor_parallel_size": 3, "device": "cpu"},
                            **options)
    pd.testing.assert_frame_equal(got, expected)
    assert len(no_replica_outlives_its_call) == 2
    # The replicas' own tensor-parallel workers are gone too, not just the replicas.
    # (multiprocessing's resource tracker, started by the first spawn, lives as long as this process.)
    children = psutil.Process().children(recursive=True)
    assert [p for p in children if p.status() != "zombie" and "resource_tracker" not in " ".join(p.cmdline())] == []


def test_parquet_job_equals_one_engine_and_resumes_through_the_cli(job_input, single, tiny, tmp_path, capsys):
    output = tmp_path / "out"
    result = batchllm.run_job(job_input[0], output, model=tiny, data_parallel_size=2, **JOB)
    assert (result.written_rows, result.resumed_rows, result.num_shards, result.replica_failures) == (12, 0, 3, [])
    assert read_shards(output).equals(read_shards(single))  # shards in input order, rows in input order
    files, reference = _shard_files(output), _shard_files(single)
    assert sorted(files) == sorted(reference)
    for name, path in files.items():
        assert path.read_bytes() == reference[name].read_bytes(), name
    assert _manifest(output) == _manifest(single)  # same fingerprint, same shard records

    manifest = (output / "_manifest.jsonl").read_bytes()
    code = main(["run", str(job_input[0]), str(output), "--model", tiny, "--prompt-column", "q",
                 "--rows-per-shard", "4", "--max-tokens", str(GREEDY["max_tokens"]), "--temperature", "0",
                 "--no-progress", "--data-parallel", "2"])
    assert code == 0
    assert f"nothing to do: the job is complete (12 rows in {output})" in capsys.readouterr().err
    assert (output / "_manifest.jsonl").read_bytes() == manifest


def test_a_replica_dying_mid_job_has_its_rows_rerun_by_the_other(job_input, single, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(EXIT_AFTER_ROWS_ENV, "3")  # replica 0 sends 3 results, then exits with status 1
    output = tmp_path / "out"
    with pytest.warns(RuntimeWarning, match=r"replica 0 \(pid \d+\) exited with status 1; its \d+ unfinished"):
        result = batchllm.run_job(job_input[0], output, model=tiny, data_parallel_size=2, **JOB)
    assert result.complete and result.written_rows == 12
    [failure] = result.replica_failures
    assert (failure.replica, failure.exitcode) == (0, 1) and failure.requeued_rows > 0
    shards = read_shards(output)
    assert sorted(shards.column("id").to_pylist()) == list(range(12))  # every row exactly once
    assert shards.equals(read_shards(single))
    assert _manifest(output) == _manifest(single)


def test_an_engine_that_cannot_be_built_raises_its_error_in_the_caller():
    with pytest.raises(ValueError, match="max_model_len must be an int >= 2") as error:
        batchllm.generate(["hello"], engine_kwargs={"max_model_len": 1}, data_parallel_size=2, use_tqdm=False)
    assert "data-parallel replica" in "".join(getattr(error.value, "__notes__", ["data-parallel replica"]))


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", True, None])
def test_a_bad_size_is_refused_before_any_work(size, tmp_path, monkeypatch):
    monkeypatch.setattr(ReplicaPool, "__init__", pytest.fail)
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        batchllm.generate(["hello"], data_parallel_size=size)
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="q", data_parallel_size=size)
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", data_parallel_size=size)


def test_an_existing_engine_cannot_be_replicated(llm, tmp_path, capsys):
    with pytest.raises(ValueError, match="an existing llm= cannot be replicated"):
        batchllm.generate(["hello"], llm=llm, data_parallel_size=2)
    with pytest.raises(ValueError, match="an existing llm= cannot be replicated"):
        batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", llm=llm, prompt_column="q", data_parallel_size=2)
    write_parquet_input(tmp_path / "in", [2])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q",
                 "--data-parallel", "0"]) == 2
    assert "--data-parallel must be an int >= 1, got 0" in capsys.readouterr().err


def test_gpu_groups_index_into_the_visible_devices():
    assert gpu_groups(2, 1, 2, None) == ["0", "1"]
    assert gpu_groups(2, 2, 4, "4,5,6,7") == ["4,5", "6,7"]
    assert gpu_groups(3, 1, 4, "GPU-a, GPU-b,GPU-c,GPU-d") == ["GPU-a", "GPU-b", "GPU-c"]
    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs, but 3"):
        gpu_groups(2, 2, 3, None)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        gpu_groups(2, 0, 4, None)
