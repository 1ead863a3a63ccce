"""The manifest log: durable records, a torn tail from a kill is dropped, another job's output is refused,
a corrupted line is named with the way out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from batchllm.connectors.jobs.manifest import Manifest, ManifestMismatch, ShardRecord, to_ranges

FINGERPRINT = {"job": "parquet", "options": {"temperature": 0.0, "stop": ("a",)}, "rows_per_shard": 8}


def _record(index: int, rows: int = 8, **fields) -> ShardRecord:
    return ShardRecord(index, rows, 0, 4 * rows, [[0, rows]], True, 100, "0" * 64, **fields)


def test_records_survive_reopening(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    manifest = Manifest.open(path, FINGERPRINT, tmp_path)
    manifest.record(_record(2, file="part-00002.parquet"))
    checkpoint = ShardRecord(0, 3, 1, 7, [[0, 2], [5, 6]], False, 50, "1" * 64, file="_partial/part-00000.2.parquet")
    manifest.record(checkpoint)
    reopened = Manifest.open(path, FINGERPRINT, tmp_path)  # tuples equal lists after the JSON round trip
    assert reopened.records == manifest.records and [r.index for r in reopened.records] == [2, 0]
    assert reopened.records[1].offsets == [0, 1, 5]


def test_ranges_keep_the_stored_order():
    assert to_ranges([0, 1, 2, 5, 6, 3]) == [[0, 3], [5, 7], [3, 4]]
    assert to_ranges(range(5000)) == [[0, 5000]]


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    Manifest.open(path, FINGERPRINT, tmp_path).record(_record(0))
    with open(path, "ab") as file:
        file.write(b'{"index": 1, "rows": 8, "err')  # a kill in the middle of an append
    manifest = Manifest.open(path, FINGERPRINT, tmp_path)
    assert [r.index for r in manifest.records] == [0]
    manifest.record(_record(1))
    assert [r.index for r in Manifest.open(path, FINGERPRINT, tmp_path).records] == [0, 1]


@pytest.mark.parametrize("line, why", [
    ("{not json", "invalid JSON"),
    (json.dumps({"index": 1}), "no 'rows'"),
    (json.dumps({**dataclasses.asdict(_record(1)), "shard": 1}), "unknown field 'shard'"),
    (json.dumps({**dataclasses.asdict(_record(1)), "bytes": "100"}), 'bytes is "100"'),
    ("[1, 2]", "a record is a JSON object"),
])
def test_a_corrupted_line_is_named_with_the_way_out(tmp_path, line, why):
    path = tmp_path / "_manifest.jsonl"
    manifest = Manifest.open(path, FINGERPRINT, tmp_path)
    manifest.record(_record(0))
    with open(path, "a") as file:
        file.write(line + "\n")  # a complete line (it ends in a newline): not a torn append
    manifest.record(_record(2))
    with pytest.raises(ManifestMismatch) as error:
        Manifest.open(path, FINGERPRINT, tmp_path)
    message = str(error.value)
    assert message.startswith(f"{path} line 3 is not a valid record (") and why in message
    assert f"delete {tmp_path} to start over, or remove that line to redo its shard" in message


def test_a_record_that_contradicts_itself_is_corrupt(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    Manifest.open(path, FINGERPRINT, tmp_path)
    bad = {**dataclasses.asdict(_record(0)), "rows": 9}
    with open(path, "a") as file:
        file.write(json.dumps(bad) + "\n")
    with pytest.raises(ManifestMismatch, match=r"line 2 is not a valid record \(its ranges hold 8 rows, not 9\)"):
        Manifest.open(path, FINGERPRINT, tmp_path)


def test_a_manifest_of_the_previous_version_is_refused(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    path.write_text(json.dumps({"batchllm_manifest": 1, "fingerprint": FINGERPRINT}) + "\n")
    with pytest.raises(ManifestMismatch, match=f"not a batchllm manifest of version 2.*delete {tmp_path} to start"):
        Manifest.open(path, FINGERPRINT, tmp_path)


def test_another_jobs_manifest_is_refused_with_the_differences(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    Manifest.open(path, FINGERPRINT, tmp_path)
    other = {**FINGERPRINT, "options": {"temperature": 0.7, "stop": ["a"]}, "rows_per_shard": 16}
    with pytest.raises(ManifestMismatch) as error:
        Manifest.open(path, other, tmp_path)
    message = str(error.value)
    assert "options.temperature: was 0.0, now 0.7" in message and "rows_per_shard: was 8, now 16" in message
    assert "delete the old output to start over" in message
