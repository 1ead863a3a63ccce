"""The Parquet job in-process: output equals the map operator, resumption, refusals, bounded memory."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.connectors.jobs.parquet_job import ParquetSink, ParquetSource
from tests.connectors.helpers import GREEDY
from tests.connectors.jobs import read_shards, write_parquet_input

JOB = {"prompt_column": "q", "rows_per_shard": 4, "use_tqdm": False, **GREEDY}


def test_job_output_equals_generate_and_reruns_do_nothing(tmp_path):
    table = write_parquet_input(tmp_path / "in", [5, 4])
    result = batchllm.run_job(tmp_path / "in", tmp_path / "out", **JOB)
    assert (result.total_rows, result.num_shards, result.written_rows, result.resumed_rows) == (9, 3, 9, 0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "_manifest.jsonl", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [pq.read_metadata(tmp_path / "out" / f"part-0000{i}.parquet").num_rows for i in range(3)] == [4, 4, 1]

    output = read_shards(tmp_path / "out")
    expected = batchllm.generate(table, prompt_column="q", use_tqdm=False, **GREEDY)
    assert output.equals(expected)  # input columns then output columns, rows in input order

    again = batchllm.run_job(tmp_path / "in", tmp_path / "out", **JOB)
    assert (again.written_rows, again.resumed_rows, again.complete) == (0, 9, True)


def test_deleted_shard_is_redone_and_others_are_not_read(tmp_path, monkeypatch):
    write_parquet_input(tmp_path / "in", [8, 4], row_group_size=4)
    batchllm.run_job(tmp_path / "in", tmp_path / "out", **JOB)
    before = read_shards(tmp_path / "out")
    (tmp_path / "out" / "part-00001.parquet").unlink()

    read_ranges = []
    original = ParquetSource.batches

    def recording(self, batch_size, skip):
        for start, batch in original(self, batch_size, skip):
            read_ranges.append((start, start + batch.num_rows))
            yield start, batch

    monkeypatch.setattr(ParquetSource, "batches", recording)
    result = batchllm.run_job(tmp_path / "in", tmp_path / "out", **JOB)
    assert (result.written_rows, result.resumed_rows) == (4, 8)
    assert read_ranges == [(4, 8)]  # row groups of finished shards are skipped, not read
    assert read_shards(tmp_path / "out").sort_by("id").equals(before.sort_by("id"))


def test_refusals(tmp_path):
    write_parquet_input(tmp_path / "in", [3])
    batchllm.run_job(tmp_path / "in", tmp_path / "out", **JOB)
    with pytest.raises(ManifestMismatch, match="options.sampling_params.max_tokens: was 4, now 5"):
        batchllm.run_job(tmp_path / "in", tmp_path / "out", **{**JOB, "max_tokens": 5})
    with pytest.raises(ManifestMismatch, match="rows_per_shard: was 4, now 2"):
        batchllm.run_job(tmp_path / "in", tmp_path / "out", **{**JOB, "rows_per_shard": 2})
    write_parquet_input(tmp_path / "in", [4])  # the input changed under the output
    with pytest.raises(ManifestMismatch, match=r"input.files\[0\].rows: was 3, now 4"):
        batchllm.run_job(tmp_path / "in", tmp_path / "out", **JOB)

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty and holds no batchllm manifest"):
        batchllm.run_job(tmp_path / "in", tmp_path / "busy", **JOB)
    with pytest.raises(ValueError, match="inside the input"):
        batchllm.run_job(tmp_path / "in", tmp_path / "in" / "out", **JOB)
    with pytest.raises(FileNotFoundError, match="no Parquet files"):
        batchllm.run_job(tmp_path / "nothing-*.parquet", tmp_path / "o", **JOB)
    with pytest.raises(ValueError, match="unknown column 'question'"):
        batchllm.run_job(tmp_path / "in", tmp_path / "o", **{**JOB, "prompt_column": "question"})


def test_memory_stays_bounded_on_an_input_larger_than_a_shard(tmp_path, monkeypatch):
    write_parquet_input(tmp_path / "in", [16, 12, 12], row_group_size=8)
    rows_per_shard, max_in_flight = 4, 4
    max_buffered = max_in_flight + 2 * rows_per_shard  # the job's default
    held, counts = [], {"read": 0, "written": 0}
    read, write = ParquetSource.batches, ParquetSink.write

    def counting_read(self, batch_size, skip):
        for start, batch in read(self, batch_size, skip):
            counts["read"] += batch.num_rows
            held.append(counts["read"] - counts["written"])
            yield start, batch

    def counting_write(self, shard, rows, *rest):
        counts["written"] += rows.num_rows
        return write(self, shard, rows, *rest)

    monkeypatch.setattr(ParquetSource, "batches", counting_read)
    monkeypatch.setattr(ParquetSink, "write", counting_write)
    result = batchllm.run_job(tmp_path / "in", tmp_path / "out", prompt_column="q", rows_per_shard=rows_per_shard,
                              max_in_flight=max_in_flight, max_tokens=1, use_tqdm=False)
    assert counts == {"read": 40, "written": 40} and result.complete
    bound = max_buffered + rows_per_shard  # + one reader batch (batch size = rows per shard here)
    assert max(held) <= bound < 40
    assert result.peak_buffered_rows <= bound
    assert sorted(read_shards(tmp_path / "out").column("id").to_pylist()) == list(range(40))


def test_engine_stays_full_across_shard_boundaries(tmp_path, monkeypatch, llm):
    write_parquet_input(tmp_path / "in", [7, 9], row_group_size=3)
    engine, added, occupancy = llm.engine, [], []
    add_request, step = engine.add_request, engine.step

    def counting_add(request_id, *args, **kwargs):
        added.append(request_id)
        return add_request(request_id, *args, **kwargs)

    def recording_step():
        occupancy.append((len(added), len(engine.scheduler.waiting) + len(engine.scheduler.running)))
        return step()

    monkeypatch.setattr(engine, "add_request", counting_add)
    monkeypatch.setattr(engine, "step", recording_step)
    batchllm.run_job(tmp_path / "in", tmp_path / "out", prompt_column="q", rows_per_shard=2, max_in_flight=4,
                     max_tokens=2, temperature=0, use_tqdm=False)
    # Until the last row is admitted, every step runs with all 4 slots taken: no drain at the 8 shard
    # boundaries nor at the file boundary.
    assert [held for admitted, held in occupancy if admitted < 16] == [4] * sum(a < 16 for a, _ in occupancy)
    assert len(added) == 16
