"""Inputs and readers shared by the job tests."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

SUBJECTS = ["the sun", "a cat", "rain", "music", "bread", "the sea", "a forest", "snow", "coffee", "a train"]


def write_parquet_input(directory: Path, file_rows: list[int], row_group_size: int = 4) -> pa.Table:
    """Files of `file_rows` rows each (ids run on across files); returns the whole input in order."""
    directory.mkdir(parents=True, exist_ok=True)
    tables, start = [], 0
    for index, rows in enumerate(file_rows):
        ids = list(range(start, start + rows))
        table = pa.table({"id": ids, "q": [f"Row {i}: a short sentence about {SUBJECTS[i % 10]}:" for i in ids]})
        pq.write_table(table, directory / f"input-{index}.parquet", row_group_size=row_group_size)
        tables.append(table)
        start += rows
    return pa.concat_tables(tables)


def read_shards(directory: Path) -> pa.Table:
    """Every output shard (the manifest and temporaries are skipped, as any Parquet reader does)."""
    return ds.dataset(directory, format="parquet").to_table()
