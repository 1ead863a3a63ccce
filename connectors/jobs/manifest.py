"""The job manifest: which rows of which shards are saved, where, and for which job.

An append-only JSON-lines log. The first line is the header holding the job's fingerprint (input
identity, model and tokenizer identity, every option that changes a row's output); each later line is a
`ShardRecord`: a file (Parquet) or a region of the output file (JSONL) that is already durable, with its
size and SHA-256, so a resumed job can tell a damaged output from a good one. A record either completes
its shard or is a checkpoint of an unfinished shard holding some of its rows (`flush_seconds`). Records
are appended and fsynced only after what they describe is durable; a kill can leave at most a torn last
line, which is dropped on the next open. Appending costs O(1) however many shards the job has; the log is
rewritten (atomically) only when a resume drops records or `retry_errors` compacts a JSONL output.

Opening a manifest whose fingerprint differs from the current job's raises `ManifestMismatch` listing
the differences: resuming would mix outputs of two different jobs. A line that is not a valid record
(other than a torn last line) raises `ManifestMismatch` naming the file and the line. A manifest of an
older version (version 1 recorded no sizes or hashes, so its shards cannot be verified) is refused the
same way: delete the output to start over.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.connectors.jobs.atomic import naming_path, write_atomically

_VERSION = 2


class ManifestMismatch(ValueError):
    """The output was written by a job with other options or another input, or its manifest is unreadable.
    `differences`: what changed (empty for an unreadable manifest), which a caller may describe in its own terms
    (the CLI names flags) with `mismatch_message`."""

    def __init__(self, message: str, manifest: Path | None = None,
                 differences: Sequence[Difference] = ()) -> None:
        super().__init__(message)
        self.manifest = manifest
        self.differences = list(differences)


@dataclass(frozen=True, slots=True)
class Difference:
    key: str  # where in the fingerprint, e.g. "options.sampling_params.temperature"
    old: Any
    new: Any


def mismatch_message(manifest: Path, differences: Sequence[Difference],
                     name_of: Callable[[str], str] = lambda key: key) -> str:
    """The refusal to resume another job's output, listing what changed, each under `name_of(key)`."""
    lines = [f"{name_of(d.key)}: was {_short(d.old)}, now {_short(d.new)}" for d in differences[:8]]
    return (f"the output was started by a different job (manifest {manifest}):\n  " + "\n  ".join(lines)
            + "\nWrite to another output, or delete the old output to start over.")


@dataclass(slots=True)
class ShardRecord:
    index: int
    rows: int  # rows held by this file / region
    error_rows: int  # of those, rows with an error
    output_tokens: int
    # The shard's rows held, as [start, end) offsets within the shard, in the order they are stored.
    ranges: list[list[int]]
    complete: bool  # True: the shard is finished; False: a checkpoint of an unfinished shard
    bytes: int  # size of the file (Parquet) or of the region (JSONL)
    sha256: str
    file: str | None = None  # the file, relative to the output directory (Parquet output)
    end_offset: int | None = None  # the region is [end_offset - bytes, end_offset) of the output (JSONL output)

    @property
    def offsets(self) -> list[int]:
        return [offset for start, end in self.ranges for offset in range(start, end)]


def to_ranges(offsets: Iterable[int]) -> list[list[int]]:
    """Offsets in stored order as [start, end) runs: a whole shard is one range, however many rows it has."""
    ranges: list[list[int]] = []
    for offset in offsets:
        if ranges and ranges[-1][1] == offset:
            ranges[-1][1] += 1
        else:
            ranges.append([offset, offset + 1])
    return ranges


class Manifest:
    def __init__(self, path: Path, fingerprint: dict[str, Any], records: list[ShardRecord]) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.records = records  # in the order they were appended

    @classmethod
    def open(cls, path: Path, fingerprint: dict[str, Any], output: Path) -> Manifest:
        """Load the manifest at `path` of the job writing `output` (checking it belongs to this job), or create it."""
        fingerprint = json.loads(json.dumps(fingerprint))  # compare in JSON terms: tuples are lists there
        if not path.exists():
            manifest = cls(path, fingerprint, [])
            manifest.rewrite([])
            return manifest
        header, records = _read(path, output)
        differences = _differences(header["fingerprint"], fingerprint)
        if differences:
            raise ManifestMismatch(mismatch_message(path, differences), path, differences)
        return cls(path, fingerprint, records)

    def record(self, record: ShardRecord) -> None:
        line = json.dumps(dataclasses.asdict(record)) + "\n"
        with naming_path(self.path), open(self.path, "ab") as file:
            file.write(line.encode())
            file.flush()
            os.fsync(file.fileno())
        self.records.append(record)

    def rewrite(self, records: Sequence[ShardRecord]) -> None:
        """Replace the log by the header and `records`, atomically."""
        lines = [json.dumps({"batchllm_manifest": _VERSION, "fingerprint": self.fingerprint})]
        lines += [json.dumps(dataclasses.asdict(r)) for r in records]
        data = ("\n".join(lines) + "\n").encode()
        write_atomically(self.path, lambda file: file.write(data))
        self.records = list(records)


def _read(path: Path, output: Path) -> tuple[dict[str, Any], list[ShardRecord]]:
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):  # a torn last line from a kill mid-append: drop it before appending again
        with open(path, "r+b") as file:
            file.truncate(len(complete))
            os.fsync(file.fileno())
    lines = complete.decode(errors="replace").splitlines()
    if not lines:
        raise ManifestMismatch(f"{path} is empty: not a batchllm manifest; delete {output} to start over")
    header = _json_line(path, 1, lines[0], output, "is not a batchllm manifest header")
    version = header.get("batchllm_manifest") if isinstance(header, dict) else None
    if version != _VERSION or not isinstance(header.get("fingerprint"), dict):
        raise ManifestMismatch(f"{path} is not a batchllm manifest of version {_VERSION} (found {version!r}; "
                               f"older ones record no shard sizes and hashes to verify): delete {output} to start "
                               f"over")
    records = []
    for number, line in enumerate(lines[1:], start=2):
        fields = _json_line(path, number, line, output, "is not a valid record")
        problem = _record_problem(fields)
        if problem is not None:
            raise ManifestMismatch(_corrupt(path, number, output, "is not a valid record", problem))
        records.append(ShardRecord(**fields))
    return header, records


def _json_line(path: Path, number: int, line: str, output: Path, what: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ManifestMismatch(_corrupt(path, number, output, what, f"invalid JSON: {exc}")) from None


def _corrupt(path: Path, number: int, output: Path, what: str, why: str) -> str:
    remedy = f"delete {output} to start over" + (", or remove that line to redo its shard" if number > 1 else "")
    return f"{path} line {number} {what} ({why}): {remedy}"


_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "index": (int,), "rows": (int,), "error_rows": (int,), "output_tokens": (int,), "ranges": (list,),
    "complete": (bool,), "bytes": (int,), "sha256": (str,), "file": (str, type(None)),
    "end_offset": (int, type(None))}


def _record_problem(fields: Any) -> str | None:
    if not isinstance(fields, dict):
        return f"a record is a JSON object, got {type(fields).__name__}"
    missing, unknown = sorted(set(_RECORD_TYPES) - set(fields)), sorted(set(fields) - set(_RECORD_TYPES))
    if missing or unknown:
        return ", ".join([*(f"no {name!r}" for name in missing), *(f"unknown field {name!r}" for name in unknown)])
    for name, types in _RECORD_TYPES.items():
        value = fields[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{name} is {json.dumps(value)[:40]}"
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            return f"{name} is negative"
    if not all(isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r) and 0 <= r[0] < r[1]
               for r in fields["ranges"]):
        return "ranges must be [start, end) pairs of offsets"
    held = sum(end - start for start, end in fields["ranges"])
    if held != fields["rows"]:
        return f"its ranges hold {held} rows, not {fields['rows']}"
    return None


def _differences(old: Any, new: Any, where: str = "") -> list[Difference]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in dict.fromkeys([*old, *new])
                for d in _differences(old.get(key), new.get(key), f"{where}.{key}" if where else key)]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [Difference(where, old, new)]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
