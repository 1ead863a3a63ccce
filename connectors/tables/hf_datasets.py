"""Hugging Face `datasets.Dataset` ↔ columns: a new Dataset with the output columns, in the input's row order.

Only the prompt columns are read (as Arrow, honouring a `select` / `shuffle` indices mapping); the output
columns are joined column-wise, so the rest of the dataset is not copied. The input's format (e.g.
"torch", "numpy") is kept. Everything is in memory: for data larger than memory, write it to Parquet and
use `batchllm.run_job`.
"""

from __future__ import annotations

from typing import Any

import datasets
import pyarrow as pa
from datasets.table import InMemoryTable

from batchllm.connectors.options import MapOptions
from batchllm.connectors.results import output_schema


def accepts(data: Any) -> bool:
    return isinstance(data, datasets.Dataset)


def read_columns(dataset: datasets.Dataset, options: MapOptions) -> tuple[dict[str, list], int]:
    needed = options.check_input_columns(dataset.column_names)
    table = dataset.select_columns(needed).with_format("arrow")[:]
    return {name: table.column(name).to_pylist() for name in needed}, dataset.num_rows


def attach_outputs(dataset: datasets.Dataset, arrays: list[pa.Array], options: MapOptions) -> datasets.Dataset:
    outputs = datasets.Dataset(InMemoryTable(pa.Table.from_arrays(arrays, schema=output_schema(options))))
    joined = datasets.concatenate_datasets([dataset.with_format(None), outputs], axis=1)
    return joined.with_format(dataset.format["type"], **dataset.format["format_kwargs"])
