"""Job inputs: the files of a Parquet input, read as a fixed-order stream of record batches.

Input: a file; a directory (every `*.parquet` below it, skipping names that start with "." or "_", as
Spark and pyarrow do); or a glob (`data/*.parquet`, `**` allowed). Files are read in sorted path order,
row group by row group, as a stream of record batches through `pyarrow.dataset`; all files must share one
schema. Hive partition values in directory names are not added as columns.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq


class ParquetSource:
    """The input files in a fixed order, their total row count and identity, read as a batch stream."""

    def __init__(self, input: str | Path) -> None:
        self.files = resolve_parquet_files(input)
        metadata = [pq.read_metadata(f) for f in self.files]
        self.schema = metadata[0].schema.to_arrow_schema()
        for file, meta in zip(self.files, metadata):
            if not meta.schema.to_arrow_schema().equals(self.schema, check_metadata=False):
                raise ValueError(f"{file} has another schema than {self.files[0]}; all input files must share one:\n"
                                 f"{meta.schema.to_arrow_schema()}\nvs\n{self.schema}")
        self.file_rows = [meta.num_rows for meta in metadata]
        self.total_rows = sum(self.file_rows)
        self._dataset = ds.dataset([str(f) for f in self.files], schema=self.schema, format="parquet")

    def fingerprint(self) -> dict[str, Any]:
        root = _common_parent(self.files)
        return {"files": [{"path": str(f.relative_to(root)), "bytes": f.stat().st_size, "rows": rows,
                           "footer_sha256": _footer_hash(f)} for f, rows in zip(self.files, self.file_rows)]}

    def batches(self, batch_size: int, skip: Callable[[int, int], bool]) -> Iterator[tuple[int, pa.RecordBatch]]:
        start = 0
        for fragment in self._dataset.get_fragments():  # in the order of self.files
            for group in fragment.split_by_row_group():
                rows = group.row_groups[0].num_rows
                if rows and not skip(start, start + rows):
                    position = start
                    # Little readahead: memory is bounded by what the job holds, not by the scanner.
                    for batch in group.to_batches(batch_size=batch_size, batch_readahead=1, fragment_readahead=1):
                        yield position, batch
                        position += batch.num_rows
                start += rows


def resolve_parquet_files(input: str | Path) -> list[Path]:
    path = Path(input).expanduser()
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        files = [f for f in path.rglob("*.parquet")
                 if f.is_file() and not any(part.startswith((".", "_")) for part in f.relative_to(path).parts)]
    else:
        files = [Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file()]
    if not files:
        raise FileNotFoundError(f"no Parquet files at {str(input)!r} (a file, a directory or a glob)")
    return sorted(f.resolve() for f in files)


def _common_parent(files: list[Path]) -> Path:
    return Path(os.path.commonpath([str(f.parent) for f in files]))


def _footer_hash(path: Path) -> str:
    """Hash of the Parquet footer (schema, row groups, offsets, statistics): changes with any rewrite of the
    file, and costs one small read instead of hashing the whole file."""
    with open(path, "rb") as file:
        file.seek(-8, 2)
        tail = file.read(8)
        length = int.from_bytes(tail[:4], "little")
        file.seek(-8 - length, 2)
        return hashlib.sha256(file.read(length)).hexdigest()
