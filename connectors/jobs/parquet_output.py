"""The Parquet job's output directory: shard files, checkpoint files, and what a resumed job trusts of them.

`part-00003.parquet` is shard 3, complete, rows in input order. `_partial/part-00003.<n>.parquet` is a
checkpoint of unfinished shard 3: some of its finished rows (offsets ascending, as its manifest record
lists them), with the same columns. When the shard completes, its final file is assembled, in input
order, from its checkpoints and the rows finished since, written atomically, recorded, and only then are
the checkpoints deleted. With `retry_errors` a complete shard holding error rows is reopened the same way:
its file is the oldest source and the re-run rows replace their old results.

Every file is recorded with its size and SHA-256, and verified on resume: a file that is missing, of
another size or another hash is deleted and its rows are redone, with a warning on stderr. Files under
`_partial/` that no live record names (left by a kill, or by a completed shard) are deleted on resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.connectors.jobs.atomic import fsync_directory, write_atomically
from batchllm.connectors.jobs.job import ResumeState
from batchllm.connectors.jobs.manifest import Manifest, ShardRecord, to_ranges
from batchllm.connectors.options import MapOptions
from batchllm.connectors.results import RowOutcome, output_arrays, output_schema

PARTIAL_DIR = "_partial"


class ParquetSink:
    def __init__(self, directory: Path, manifest: Manifest, options: MapOptions, total_rows: int,
                 rows_per_shard: int, retry_errors: bool) -> None:
        self.path = directory
        self.manifest = manifest
        self.options = options
        self._rows_per_shard = rows_per_shard
        self._total_rows = total_rows
        self._width = max(5, len(str(max(0, -(-total_rows // rows_per_shard) - 1))))
        # Unfinished shards: the verified files holding their saved rows, oldest first (a later one wins).
        self._sources: dict[int, list[ShardRecord]] = {}
        self.resume = self._resume(retry_errors)

    def write(self, shard: int, rows: pa.Table, outcomes: list[RowOutcome], offsets: list[int],
              complete: bool) -> None:
        table = rows
        for field, array in zip(output_schema(self.options), output_arrays(outcomes, self.options)):
            table = table.append_column(field, array)
        if not complete:
            (self.path / PARTIAL_DIR).mkdir(exist_ok=True)
            fsync_directory(self.path)
            name = f"{PARTIAL_DIR}/{self._name(shard).removesuffix('.parquet')}.{len(self.manifest.records)}.parquet"
            self._sources.setdefault(shard, []).append(self._save(shard, name, table, to_ranges(offsets), False))
            return
        sources = self._sources.pop(shard, [])
        table = self._assemble(shard, sources, table, offsets)
        self._save(shard, self._name(shard), table, [[0, table.num_rows]], True)
        for record in sources:  # the shard's own older file was just replaced; checkpoints go
            if not record.complete:
                (self.path / record.file).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other shards may still have checkpoints there
            (self.path / PARTIAL_DIR).rmdir()

    def _resume(self, retry_errors: bool) -> ResumeState:
        finals: dict[int, ShardRecord] = {}
        checkpoints: dict[int, list[ShardRecord]] = {}  # those recorded after the shard's last final record
        for record in self.manifest.records:
            if record.complete:
                finals[record.index] = record
                checkpoints.pop(record.index, None)
            else:
                checkpoints.setdefault(record.index, []).append(record)
        self._remove_unreferenced_checkpoints({r.file for records in checkpoints.values() for r in records})
        done: set[int] = set()
        saved: dict[int, frozenset[int]] = {}
        resumed = 0
        for index in sorted(set(finals) | set(checkpoints)):
            final = finals.get(index)
            if final is not None and not self._intact(final):
                final = None
            later = checkpoints.get(index, [])
            if final is not None and not (retry_errors and (final.error_rows or later)):
                done.add(index)
                resumed += final.rows
                continue
            sources = ([final] if final is not None else []) + [r for r in later if self._intact(r)]
            errors: dict[int, bool] = {}
            for record in sources:
                column = pq.read_table(self.path / record.file, columns=[self.options.names.error]).column(0)
                errors.update(zip(record.offsets, (value is not None for value in column.to_pylist())))
            kept = frozenset(offset for offset, failed in errors.items() if not (retry_errors and failed))
            self._sources[index] = sources
            saved[index] = kept
            resumed += len(kept)
        return ResumeState(frozenset(done), saved, resumed)

    def _intact(self, record: ShardRecord) -> bool:
        """Whether `record`'s file is as recorded; if not, it is deleted (its rows are redone) with a warning."""
        path = self.path / record.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problem = None
        else:
            if size != record.bytes:
                problem = f"{size} bytes, the manifest records {record.bytes}"
            elif _file_sha256(path) != record.sha256:
                problem = "its SHA-256 differs from the manifest's"
            else:
                return True
        what = "is missing" if problem is None else f"is damaged ({problem})"
        print(f"batchllm: warning: {record.file} {what}: redoing its rows", file=sys.stderr, flush=True)
        path.unlink(missing_ok=True)
        return False

    def _assemble(self, shard: int, sources: list[ShardRecord], new_rows: pa.Table, offsets: list[int]) -> pa.Table:
        """The shard's rows in input order: each offset from the newest table that holds it."""
        tables = [pq.read_table(self.path / r.file).cast(new_rows.schema) for r in sources] + [new_rows]
        position: dict[int, int] = {}  # offset → row in the concatenation of `tables`
        start = 0
        for table, held in zip(tables, [r.offsets for r in sources] + [offsets]):
            position.update((offset, start + i) for i, offset in enumerate(held))
            start += table.num_rows
        expected = min(self._rows_per_shard, self._total_rows - shard * self._rows_per_shard)
        if sorted(position) != list(range(expected)):
            raise RuntimeError(f"shard {shard}: {len(position)} of its {expected} rows are saved; cannot complete it")
        return pa.concat_tables(tables).take([position[offset] for offset in range(expected)])

    def _save(self, shard: int, name: str, table: pa.Table, ranges: list[list[int]], complete: bool) -> ShardRecord:
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer)
        data = buffer.getvalue()
        write_atomically(self.path / name, lambda file: file.write(data))
        names = self.options.names
        tokens = 0 if self.options.pools else _token_sum(table.column(names.completion_tokens))  # pooled: none made
        record = ShardRecord(shard, table.num_rows, table.num_rows - table.column(names.error).null_count,
                             tokens, ranges, complete, data.size,
                             hashlib.sha256(data).hexdigest(), file=name)
        self.manifest.record(record)
        return record

    def _remove_unreferenced_checkpoints(self, referenced: set[str | None]) -> None:
        directory = self.path / PARTIAL_DIR
        if directory.is_dir():
            for path in directory.iterdir():
                if f"{PARTIAL_DIR}/{path.name}" not in referenced:
                    path.unlink(missing_ok=True)

    def _name(self, shard: int) -> str:
        return f"part-{shard:0{self._width}d}.parquet"


def _token_sum(column: pa.ChunkedArray) -> int:
    values = pc.list_flatten(column) if pa.types.is_list(column.type) else column
    return pc.sum(values).as_py() or 0


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
