"""The Batch API's records: one OpenAI batch object per batch, persisted as `DATA_DIR/batches/<id>.json`.

Status moves validating → in_progress → finalizing → completed, or to failed, or (on cancel) from validating /
in_progress to cancelling → cancelled; each step stamps its `*_at` time. Every change is written atomically
before it is visible to readers, so a restarted server sees each batch in a state it really reached, and
resumes the unfinished ones (`UNFINISHED`).

Ids are `batch_` + the creation time in nanoseconds (16 hex digits) + 8 random hex digits: sorting ids sorts
batches by creation.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchllm.connectors.jobs.atomic import remove_stale_temporaries, write_atomically

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE = ("validating", "in_progress")
COMPLETION_WINDOW_SECONDS = 24 * 3600
_STAMPS = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
           "failed": "failed_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at"}


@dataclass(slots=True)
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(slots=True)
class BatchRecord:
    """OpenAI's batch object (`openai.types.Batch`), plus `rows_per_shard`, which is not shown: the job's manifest
    pins it, so a batch resumes under the value it started with whatever the server's setting is now."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    rows_per_shard: int
    metadata: dict[str, str] | None = None
    status: str = "validating"
    errors: dict[str, Any] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    expires_at: int | None = None
    expired_at: int | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)

    def to_openai(self, counts: RequestCounts | None = None) -> dict[str, Any]:
        """The object as the API returns it; `counts` overrides the stored request_counts (live progress)."""
        fields = dataclasses.asdict(self)
        del fields["rows_per_shard"]
        if counts is not None:
            fields["request_counts"] = dataclasses.asdict(counts)
        return {"object": "batch", **fields}

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> BatchRecord:
        return cls(**{**fields, "request_counts": RequestCounts(**fields["request_counts"])})


def new_batch_id() -> str:
    return f"batch_{time.time_ns():016x}{secrets.token_hex(4)}"


class BatchStore:
    """Thread-safe: the HTTP handlers and the batch worker share it. Readers get (shallow) copies, never the
    live records; changes go through `update`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)
        self._lock = threading.Lock()
        self._records: dict[str, BatchRecord] = {}
        for path in root.glob("batch_*.json"):
            record = BatchRecord.from_json(json.loads(path.read_text()))
            self._records[record.id] = record

    def job_dir(self, batch_id: str) -> Path:
        return self.root / batch_id

    def add(self, record: BatchRecord) -> BatchRecord:
        with self._lock:
            self._save(record)
            self._records[record.id] = record
            return dataclasses.replace(record)

    def get(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            record = self._records.get(batch_id)
            return None if record is None else dataclasses.replace(record)

    def list(self) -> list[BatchRecord]:
        """Newest first."""
        with self._lock:
            records = [dataclasses.replace(r) for r in self._records.values()]
        return sorted(records, key=lambda r: r.id, reverse=True)

    def update(self, batch_id: str, *, only_from: tuple[str, ...] | None = None, **changes: Any) -> BatchRecord | None:
        """Apply `changes` (a new `status` stamps its time) and persist; None, and nothing changed, when the
        batch's status is not one of `only_from`."""
        with self._lock:
            record = self._records[batch_id]
            if only_from is not None and record.status not in only_from:
                return None
            updated = dataclasses.replace(record, **changes)
            stamp = _STAMPS.get(changes.get("status", ""))
            if stamp is not None:
                setattr(updated, stamp, int(time.time()))
            self._save(updated)
            self._records[batch_id] = updated
            return dataclasses.replace(updated)

    def references(self, file_id: str) -> list[str]:
        """The unfinished batches that read `file_id` as their input."""
        with self._lock:
            return [r.id for r in self._records.values() if r.input_file_id == file_id and r.status in UNFINISHED]

    def _save(self, record: BatchRecord) -> None:
        data = json.dumps(dataclasses.asdict(record)).encode()
        write_atomically(self.root / f"{record.id}.json", lambda file: file.write(data))
