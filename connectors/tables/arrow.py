"""pyarrow `Table` / `RecordBatch` ↔ columns: the same type comes back with typed output columns appended.
Duplicate column names are refused, as for pandas."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchllm.connectors.options import MapOptions
from batchllm.connectors.results import output_schema


def accepts(data: Any) -> bool:
    return isinstance(data, (pa.Table, pa.RecordBatch))


def read_columns(data: pa.Table | pa.RecordBatch, options: MapOptions) -> tuple[dict[str, list], int]:
    names = data.schema.names
    duplicated = list(dict.fromkeys(name for name in names if names.count(name) > 1))
    if duplicated:  # data.column(name) is ambiguous for them
        raise ValueError(f"the {type(data).__name__} has duplicate column names {duplicated}; rename them first")
    needed = options.check_input_columns(names)
    return {name: data.column(name).to_pylist() for name in needed}, data.num_rows


def attach_outputs(data: pa.Table | pa.RecordBatch, arrays: list[pa.Array],
                   options: MapOptions) -> pa.Table | pa.RecordBatch:
    for field, array in zip(output_schema(options), arrays):
        data = data.append_column(field, array)
    return data
