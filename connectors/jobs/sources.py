"""Job inputs: which format an input is, and its rows as a fixed-order stream of record batches.

Formats (`input_format=` / `--input-format`; "auto" picks by name):

- **parquet**: a file; a directory (every `*.parquet` below it, skipping names that start with "." or "_",
  as Spark and pyarrow do); or a glob (`data/*.parquet`, `**` allowed). Files are read in sorted path
  order, row group by row group, through `pyarrow.dataset`. They must share one schema, up to string vs
  large_string (pandas 3 writes the latter), nullability and a pandas index column: such files are cast
  to the first file's schema as they are read; an index column (`__index_level_0__`) is kept when every
  file has it and dropped otherwise. Hive partition values in directory names are not added as columns.
- **csv** (`*.csv`, header row) and **jsonl-table** (`*.jsonl` / `*.json`, one JSON object per line, its
  keys the columns): one file, streamed in blocks by `pyarrow.csv` / `pyarrow.json`. Column types are
  inferred from the first block; when a later block does not fit them (a column that turns from numbers
  to text, a key first seen late) the whole file is read once to infer them.
- **openai-batch**: an OpenAI Batch API request file (`jsonl_batch.py`); "auto" takes a `*.jsonl` /
  `*.json` file for one when its first non-blank line is an object with `custom_id` and `body` (or when it
  has no such line: an empty batch).

A file that does not parse as its format raises a ValueError naming the file and the format.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.dataset as ds
import pyarrow.json as pa_json
import pyarrow.parquet as pq

INPUT_FORMATS = ("auto", "parquet", "csv", "jsonl-table", "openai-batch")
_FORMAT_NAMES = {"csv": "CSV", "jsonl-table": "a JSON-lines table (one JSON object per line)"}
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")
_BLOCK_BYTES = 4 << 20  # CSV / JSON read unit, and the sample their column types are inferred from


def input_format_of(input: str | Path, input_format: str = "auto") -> str:
    """The format of `input`: `input_format` itself unless it is "auto" (see the module docstring)."""
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {', '.join(INPUT_FORMATS)}, got {input_format!r}")
    if input_format != "auto":
        return input_format
    path = Path(input).expanduser()
    suffix = "" if path.is_dir() else path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".json"):
        return "openai-batch" if not path.is_file() or _looks_like_batch_requests(path) else "jsonl-table"
    return "parquet"  # a .parquet file, a directory or a glob; anything else fails there, naming the path


def open_table_source(input: str | Path, input_format: str = "auto") -> ParquetSource | TextTableSource:
    kind = input_format_of(input, input_format)
    if kind == "parquet":
        return ParquetSource(input)
    if kind in _FORMAT_NAMES:
        return TextTableSource(Path(input), kind)
    raise ValueError(f"{input} is an OpenAI batch request file; it is answered by its own job, not as a table")


def _looks_like_batch_requests(path: Path) -> bool:
    with open(path, "rb") as file:
        for data in file:
            if data.strip():
                try:
                    first = json.loads(data.decode("utf-8-sig"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    return False  # read as a table, whose parse error then names the file
                return isinstance(first, dict) and "custom_id" in first and "body" in first
    return True


class ParquetSource:
    """The input files in a fixed order, their total row count and identity, read as a batch stream."""

    def __init__(self, input: str | Path) -> None:
        self.files = resolve_parquet_files(input)
        metadata = []
        for file in self.files:
            try:
                metadata.append(pq.read_metadata(file))
            except pa.ArrowException as exc:
                raise ValueError(f"{file} cannot be read as Parquet: {exc}") from exc
        self.schema = _unified_schema(self.files, [meta.schema.to_arrow_schema() for meta in metadata])
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
                    # Little readahead: memory is bounded by what the job holds, not by the scanner. The
                    # schema casts each file to the unified one.
                    for batch in group.to_batches(schema=self.schema, batch_size=batch_size, batch_readahead=1,
                                                  fragment_readahead=1):
                        yield position, batch
                        position += batch.num_rows
                start += rows


def _unified_schema(files: list[Path], schemas: list[pa.Schema]) -> pa.Schema:
    """The first file's schema, once every file is known to differ from it at most in string vs large_string,
    nullability (a field is nullable where any file's is) and pandas index columns (kept only if in all)."""
    index_everywhere = set.intersection(*({n for n in s.names if _PANDAS_INDEX.fullmatch(n)} for s in schemas))
    drop = {n for s in schemas for n in s.names if _PANDAS_INDEX.fullmatch(n)} - index_everywhere
    first = schemas[0]
    for file, schema in zip(files, schemas):
        if _comparable(schema, drop) != _comparable(first, drop):
            raise ValueError(f"{file} has another schema than {files[0]}; all input files must share one:\n"
                             f"{schema}\nvs\n{first}")
    nullable = {f.name for s in schemas for f in s if f.nullable}
    fields = [f.with_nullable(f.name in nullable) for f in first if f.name not in drop]
    # pandas metadata naming a dropped index column would make pandas look for it when reading the output.
    return pa.schema(fields, metadata=None if drop & set(first.names) else first.metadata)


def _comparable(schema: pa.Schema, drop: set[str]) -> pa.Schema:
    return pa.schema([pa.field(f.name, _plain_type(f.type)) for f in schema if f.name not in drop])


def _plain_type(kind: pa.DataType) -> pa.DataType:
    """`kind` with large string / binary types as the plain ones, nested fields nullable and unnamed lists."""
    if pa.types.is_large_string(kind):
        return pa.string()
    if pa.types.is_large_binary(kind):
        return pa.binary()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.list_(_plain_type(kind.value_type))
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(f.name, _plain_type(f.type)) for f in kind])
    return kind


class TextTableSource:
    """A CSV or JSON-lines table file: its schema and row count from one read at open, then a batch stream."""

    def __init__(self, path: Path, input_format: str) -> None:
        self.path = path.expanduser().resolve()
        self.input_format = input_format
        if not self.path.is_file():
            raise FileNotFoundError(f"no {input_format} file at {str(path)!r}")
        try:
            try:
                self.schema, self.total_rows = self._scan(None)
            except pa.ArrowInvalid:
                # The streaming readers fix the types from the first block; take those of the whole file.
                reader = pa_csv.read_csv if input_format == "csv" else pa_json.read_json
                self.schema, self.total_rows = self._scan(reader(self.path).schema)
        except (pa.ArrowException, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path} cannot be read as {_FORMAT_NAMES[input_format]}: {exc}") from exc
        # pyarrow.csv types a column holding bytes that are not UTF-8 as binary instead of failing.
        not_text = [field.name for field in self.schema if pa.types.is_binary(field.type)]
        if not_text:
            raise ValueError(f"{self.path} cannot be read as CSV: columns {not_text} are not valid UTF-8 text")
        self._sha256 = _file_hash(self.path)

    def fingerprint(self) -> dict[str, Any]:
        return {"format": self.input_format, "name": self.path.name, "bytes": self.path.stat().st_size,
                "sha256": self._sha256}

    def batches(self, batch_size: int, skip: Callable[[int, int], bool]) -> Iterator[tuple[int, pa.RecordBatch]]:
        start = 0
        for block in self._open(self.schema):  # the text must be parsed in order, even where rows are skipped
            for offset in range(0, block.num_rows, batch_size):
                batch = block.slice(offset, batch_size)
                if not skip(start, start + batch.num_rows):
                    yield start, batch
                start += batch.num_rows

    def _scan(self, schema: pa.Schema | None) -> tuple[pa.Schema, int]:
        reader = self._open(schema)
        return reader.schema, sum(block.num_rows for block in reader)

    def _open(self, schema: pa.Schema | None) -> Any:
        if self.input_format == "csv":
            return pa_csv.open_csv(self.path, read_options=pa_csv.ReadOptions(block_size=_BLOCK_BYTES),
                                   convert_options=pa_csv.ConvertOptions(column_types=schema))
        return pa_json.open_json(self.path, read_options=pa_json.ReadOptions(block_size=_BLOCK_BYTES),
                                 parse_options=pa_json.ParseOptions(explicit_schema=schema))


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


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
