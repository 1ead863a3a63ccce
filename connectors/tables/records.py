"""Plain Python lists: of prompt strings, or of row dicts. A list of new dicts comes back, outputs added.

A list of strings is a one-column table named "prompt" (the default prompt source for it); each result is
`{"prompt": ..., "generated_text": ..., "finish_reason": ..., ...}`. Row dicts may have different keys:
a key missing from a row reads as null there, so that row gets an error. With parse_json=True, `parsed`
holds Python objects, as for pandas.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchllm.connectors.constraints import parsed_values
from batchllm.connectors.options import MapOptions
from batchllm.connectors.results import output_schema

PROMPT_KEY = "prompt"


def accepts(data: Any) -> bool:
    return isinstance(data, list) and (all(isinstance(r, str) for r in data) or all(isinstance(r, dict) for r in data))


def read_columns(data: list, options: MapOptions) -> tuple[dict[str, list], int]:
    rows = _as_dicts(data)
    available = list(dict.fromkeys(key for row in rows for key in row))
    needed = options.check_input_columns(available)
    return {name: [row.get(name) for row in rows] for name in needed}, len(rows)


def attach_outputs(data: list, arrays: list[pa.Array], options: MapOptions) -> list[dict[str, Any]]:
    names = output_schema(options).names
    values = [parsed_values(array) if options.parse_json and name == options.names.parsed else array.to_pylist()
              for name, array in zip(names, arrays)]
    return [{**row, **dict(zip(names, row_values))} for row, row_values in zip(_as_dicts(data), zip(*values))]


def _as_dicts(data: list) -> list[dict[str, Any]]:
    return [{PROMPT_KEY: item} if isinstance(item, str) else item for item in data]
