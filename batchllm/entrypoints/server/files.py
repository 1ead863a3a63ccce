"""The Files API's storage: uploaded batch inputs and the batches' output / error files, under `DATA_DIR/files/`.

A file is `files/<id>` (its bytes) and `files/<id>.json` (its OpenAI file object). Both are written atomically
(temporary file, fsync, rename: `connectors/jobs/atomic.py`), content first: a file exists once its metadata
does, so a kill leaves either a whole file or an orphaned content file, which `FileStore` removes on opening.

Ids are `file-` + the creation time in nanoseconds (16 hex digits) + 8 random hex digits, so sorting ids sorts
uploads by time. The files of a batch's results get ids derived from the batch (`derived_id`), so a batch
finalized again after a restart rewrites the same files instead of leaving orphans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from batchllm.connectors.jobs.atomic import remove_stale_temporaries, write_atomically

INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
_CHUNK = 1 << 20


class FileTooLarge(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than the server's limit of {limit} bytes")
        self.limit = limit


@dataclass(slots=True)
class FileRecord:
    """OpenAI's file object (`openai.types.FileObject`)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    def to_openai(self) -> dict:
        return dataclasses.asdict(self)


def new_file_id() -> str:
    return f"file-{time.time_ns():016x}{secrets.token_hex(4)}"


def derived_id(owner: str, kind: str) -> str:
    """A stable file id for `owner`'s `kind` file (e.g. a batch's "output")."""
    return "file-" + hashlib.sha256(f"{owner}/{kind}".encode()).hexdigest()[:24]


class FileStore:
    """Thread-safe: the HTTP handlers and the batch worker share it. Metadata is indexed in memory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)
        self._lock = threading.Lock()
        self._records: dict[str, FileRecord] = {}
        for meta in root.glob("file-*.json"):
            record = FileRecord(**json.loads(meta.read_text()))
            self._records[record.id] = record
        for content in root.glob("file-*"):
            if content.suffix != ".json" and content.name not in self._records:
                content.unlink()  # its metadata was never written: the upload did not finish

    def content_path(self, file_id: str) -> Path:
        return self.root / file_id

    def get(self, file_id: str) -> FileRecord | None:
        with self._lock:
            return self._records.get(file_id)

    def upload(self, source: BinaryIO, filename: str, purpose: str, limit: int) -> FileRecord:
        """Copy `source` into a new file; FileTooLarge (and nothing kept) past `limit` bytes."""
        def copy(target: BinaryIO) -> None:
            size = 0
            while chunk := source.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise FileTooLarge(limit)
                target.write(chunk)

        return self.write(new_file_id(), filename, purpose, copy)

    def write(self, file_id: str, filename: str, purpose: str, write: Callable[[BinaryIO], None]) -> FileRecord:
        """Create (or replace) the file `file_id` with what `write` writes."""
        path = self.content_path(file_id)
        write_atomically(path, write)
        record = FileRecord(file_id, path.stat().st_size, int(time.time()), filename, purpose)
        data = json.dumps(record.to_openai()).encode()
        write_atomically(self.root / f"{file_id}.json", lambda file: file.write(data))
        with self._lock:
            self._records[file_id] = record
        return record

    def list(self, purpose: str | None = None) -> list[FileRecord]:
        """Newest first."""
        with self._lock:
            records = [r for r in self._records.values() if purpose is None or r.purpose == purpose]
        return sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)

    def delete(self, file_id: str) -> bool:
        with self._lock:
            if self._records.pop(file_id, None) is None:
                return False
        (self.root / f"{file_id}.json").unlink(missing_ok=True)  # metadata first: no half-visible file
        self.content_path(file_id).unlink(missing_ok=True)
        return True
