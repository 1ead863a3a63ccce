"""One table cell as a prompt's part: a row's error, the missing values of every table library, plain containers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class RowError(ValueError):
    """What is wrong with one row's prompt; it becomes that row's `error`."""


def check_text(value: Any, what: str) -> str:
    if is_missing(value):
        raise RowError(f"{what} is null")
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"{what} is empty")
    return value


def to_plain(value: Any) -> Any:
    """`value` with the containers pandas, numpy and pyarrow hand over turned into lists and dicts, recursively:
    a Parquet list cell read by pandas is a numpy array of dicts whose own list fields are numpy arrays."""
    if isinstance(value, Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or (getattr(value, "ndim", None) == 1 and hasattr(value, "tolist")):
        return [to_plain(item) for item in value]
    if callable(getattr(value, "as_py", None)):  # a pyarrow scalar
        return to_plain(value.as_py())
    return value


def is_missing(value: Any) -> bool:
    """None, a float NaN (numpy's included) or pandas' NA / NaT, without importing pandas."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return type(value).__name__ in ("NAType", "NaTType")
