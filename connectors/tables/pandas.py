"""pandas `DataFrame` ↔ columns: the frame comes back with the output columns added, index untouched.
A frame with duplicate column names is refused (which of the two would the prompt read?); a `Series` is
not taken at all (`batchllm.generate` says how to pass one).

Output dtypes: text columns use pandas' default string dtype (missing = NA/NaN), token counts the
nullable `Int32`, list and logprob columns hold Python lists (object dtype). The `parsed` column
(parse_json=True) holds each row's JSON value as a Python object (dict, list, str, number, bool) or None
(object dtype); a list of them per row when n > 1. An `embedding` column (pooling tasks) keeps Arrow's
fixed_size_list<float32> as pandas' `ArrowDtype`, so a million vectors are one buffer, not a million objects
(`np.stack(series)` or `series.list.flatten()` get at them; missing where the row failed).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import pyarrow as pa

from batchllm.connectors.constraints import parsed_values
from batchllm.connectors.options import MapOptions
from batchllm.connectors.results import output_schema


def accepts(data: Any) -> bool:
    return isinstance(data, pd.DataFrame)


def read_columns(frame: pd.DataFrame, options: MapOptions) -> tuple[dict[Any, list], int]:
    duplicated = list(dict.fromkeys(frame.columns[frame.columns.duplicated()]))
    if duplicated:  # frame[name] would be a frame, and a row dict would keep only one of the values
        raise ValueError(f"the DataFrame has duplicate column names {duplicated}; rename them first")
    needed = options.check_input_columns(list(frame.columns))
    return {name: frame[name].tolist() for name in needed}, len(frame)


def attach_outputs(frame: pd.DataFrame, arrays: list[pa.Array], options: MapOptions) -> pd.DataFrame:
    # assign() adds columns to a new frame and leaves the caller's untouched; the index carries over.
    return frame.assign(**{field.name: _series(array, frame.index) if field.name != options.names.parsed or not
                           options.parse_json else pd.Series(parsed_values(array), index=frame.index, dtype=object)
                           for field, array in zip(output_schema(options), arrays)})


def _series(array: pa.Array, index: pd.Index) -> pd.Series:
    if pa.types.is_fixed_size_list(array.type):
        return pd.Series(pd.arrays.ArrowExtensionArray(array), index=index)
    if pa.types.is_integer(array.type):
        return pd.Series(pd.array(array.to_pylist(), dtype="Int32"), index=index)
    if pa.types.is_string(array.type):
        return pd.Series(array.to_pandas().array, index=index)
    return pd.Series(array.to_pylist(), index=index, dtype=object)
