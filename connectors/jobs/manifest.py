"""The job manifest: which shards are finished, and for which job.

An append-only JSON-lines log. The first line is the header holding the job's fingerprint (input
identity, model identity, every option that changes a row's output); each later line records one
finished shard and is appended and fsynced only after the shard itself is durable. A kill can leave at
most a torn last line, which is dropped on the next open. A shard is done if and only if it has a record;
appending costs O(1) however many shards the job has.

Opening a manifest whose fingerprint differs from the current job's raises `ManifestMismatch` listing
the differences: resuming would mix outputs of two different jobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.connectors.jobs.atomic import write_atomically

_VERSION = 1


class ManifestMismatch(ValueError):
    """The output was written by a job with other options or another input."""


@dataclass(slots=True)
class ShardRecord:
    index: int
    rows: int
    error_rows: int
    output_tokens: int
    file: str | None = None  # the shard's file (Parquet output)
    end_offset: int | None = None  # output file size once this shard was appended (JSONL output)


class Manifest:
    def __init__(self, path: Path, fingerprint: dict[str, Any], shards: dict[int, ShardRecord]) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.shards = shards

    @classmethod
    def open(cls, path: Path, fingerprint: dict[str, Any]) -> Manifest:
        """Load the manifest at `path` (checking it belongs to this job), or create it."""
        fingerprint = json.loads(json.dumps(fingerprint))  # compare in JSON terms: tuples are lists there
        if not path.exists():
            header = json.dumps({"batchllm_manifest": _VERSION, "fingerprint": fingerprint}) + "\n"
            write_atomically(path, lambda file: file.write(header.encode()))
            return cls(path, fingerprint, {})
        header, records = _read(path)
        if header.get("batchllm_manifest") != _VERSION:
            raise ManifestMismatch(f"{path} is not a batchllm manifest of version {_VERSION}")
        differences = _differences(header["fingerprint"], fingerprint)
        if differences:
            raise ManifestMismatch(
                f"the output was started by a different job (manifest {path}):\n  " + "\n  ".join(differences[:8])
                + "\nWrite to another output, or delete the old output to start over.")
        return cls(path, fingerprint, {r.index: r for r in records})

    def record(self, record: ShardRecord) -> None:
        line = json.dumps(dataclasses.asdict(record)) + "\n"
        with open(self.path, "ab") as file:
            file.write(line.encode())
            file.flush()
            os.fsync(file.fileno())
        self.shards[record.index] = record


def _read(path: Path) -> tuple[dict[str, Any], list[ShardRecord]]:
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):  # a torn last line from a kill mid-append: drop it before appending again
        with open(path, "r+b") as file:
            file.truncate(len(complete))
            os.fsync(file.fileno())
    lines = complete.decode().splitlines()
    if not lines:
        raise ManifestMismatch(f"{path} is empty: not a batchllm manifest")
    return json.loads(lines[0]), [ShardRecord(**json.loads(line)) for line in lines[1:]]


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in dict.fromkeys([*old, *new])
                for d in _differences(old.get(key), new.get(key), f"{where}.{key}" if where else key)]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: was {_short(old)}, now {_short(new)}"]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
