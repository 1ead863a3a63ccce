"""The manifest log: durable records, a torn tail from a kill is dropped, another job's output is refused."""

from __future__ import annotations

import pytest

from batchllm.connectors.jobs.manifest import Manifest, ManifestMismatch, ShardRecord

FINGERPRINT = {"job": "parquet", "options": {"temperature": 0.0, "stop": ("a",)}, "rows_per_shard": 8}


def test_records_survive_reopening(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    manifest = Manifest.open(path, FINGERPRINT)
    manifest.record(ShardRecord(2, 8, 1, 30, file="part-00002.parquet"))
    manifest.record(ShardRecord(0, 8, 0, 32, file="part-00000.parquet"))
    reopened = Manifest.open(path, FINGERPRINT)  # tuples and lists compare equal after the JSON round trip
    assert reopened.shards == manifest.shards and set(reopened.shards) == {0, 2}


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    Manifest.open(path, FINGERPRINT).record(ShardRecord(0, 8, 0, 32))
    with open(path, "ab") as file:
        file.write(b'{"index": 1, "rows": 8, "err')  # a kill in the middle of an append
    manifest = Manifest.open(path, FINGERPRINT)
    assert set(manifest.shards) == {0}
    manifest.record(ShardRecord(1, 8, 0, 31))
    assert set(Manifest.open(path, FINGERPRINT).shards) == {0, 1}


def test_another_jobs_manifest_is_refused_with_the_differences(tmp_path):
    path = tmp_path / "_manifest.jsonl"
    Manifest.open(path, FINGERPRINT)
    other = {**FINGERPRINT, "options": {"temperature": 0.7, "stop": ["a"]}, "rows_per_shard": 16}
    with pytest.raises(ManifestMismatch) as error:
        Manifest.open(path, other)
    message = str(error.value)
    assert "options.temperature: was 0.0, now 0.7" in message and "rows_per_shard: was 8, now 16" in message
    assert "delete the old output to start over" in message
