"""Structured outputs in the connectors: a JSON schema per row, OpenAI's `response_format`, compile checks
before generation, and the parsed JSON of a constrained row.

A call-wide constraint (`structured_outputs=` / a CLI flag) is compiled before anything is generated
(`require_compiles`, through `LLM.check_structured_outputs`): one the grammar engine rejects raises its
`GrammarError` (a ValueError) with the engine's message, and nothing runs. With data parallelism a replica's
engine compiles it (`ReplicaPool.check_structured_outputs`): the parent process builds no grammar engine.

A per-row constraint (a schema column's value, a request line's `response_format`) goes to the engine with
its row: the engine compiles each distinct constraint once (it caches rejections too) and answers a row
whose constraint it rejects with that row's error, the engine's message, in one process and in replicas
alike. What the connectors check per row is the value's shape (`SchemaColumn`, `response_format_constraint`):
a malformed one fails its row before the engine sees it.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from batchllm.connectors.cells import RowError, is_missing, to_plain
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams

JSON_KINDS = ("json", "json_object")
_CACHE_ENTRIES = 4096  # distinct constraints remembered per call / job; each holds its canonical text

V = TypeVar("V")


class _Lru(Generic[V]):
    def __init__(self, size: int = _CACHE_ENTRIES) -> None:
        self._size = size
        self._items: OrderedDict[Any, V] = OrderedDict()

    def get(self, key: Any) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Any, value: V) -> V:
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self._size:
            self._items.popitem(last=False)
        return value


def require_compiles(engine: Any, constraint: StructuredOutputsParams | None) -> None:
    """Compile the call-wide `constraint` on `engine` (an `LLM` or a `ReplicaPool`) before any generation;
    raises the engine's GrammarError (a ValueError) when it cannot be compiled. The engine keeps it compiled
    for the rows."""
    if constraint is not None:
        engine.check_structured_outputs(constraint)


class SchemaColumn:
    """The sampling parameters of each row from its value in a schema column: the call's parameters with that
    row's JSON schema as `structured_outputs`, one `SamplingParams` per distinct schema.

    A value is a JSON schema as a dict or as JSON text, or a `StructuredOutputsParams` (any kind); null (None,
    NaN, NA) leaves the row unconstrained. Anything else, and JSON text that does not parse or is not an
    object, fail that row (`RowError`); whether a well-formed schema compiles is the engine's to say.
    """

    def __init__(self, column: str, base: SamplingParams) -> None:
        self.column = column
        self.base = base
        self._by_text: _Lru[SamplingParams | RowError] = _Lru()
        self._by_key: _Lru[SamplingParams | RowError] = _Lru()

    def params(self, value: Any) -> SamplingParams:
        """The row's parameters; raises RowError for a value that cannot constrain the row."""
        if isinstance(value, str):  # JSON text: the raw text is the cheapest cache key
            found = self._by_text.get(value)
            if found is None:
                found = self._by_text.put(value, self._from_text(value))
        else:
            found = self._from_value(value)
        if isinstance(found, RowError):
            raise found
        return found

    def rows(self, values: Sequence[Any], name_rows: bool = False) -> list[SamplingParams | RowError]:
        """`params` of each value, with a RowError in place of a bad one (see `row_params` for `name_rows`)."""
        params: list[SamplingParams | RowError] = []
        for index, value in enumerate(values):
            try:
                params.append(self.params(value))
            except RowError as exc:
                params.append(RowError(f"row {index}: {exc}") if name_rows else exc)
        return params

    def _from_text(self, text: str) -> SamplingParams | RowError:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            return RowError(f"schema column {self.column!r} holds text that is not valid JSON ({exc})")
        if not isinstance(schema, dict):
            return RowError(f"schema column {self.column!r} holds JSON {type(schema).__name__} text; a JSON schema "
                            f"is an object")
        return self._for(StructuredOutputsParams(json=schema))

    def _from_value(self, value: Any) -> SamplingParams | RowError:
        if isinstance(value, StructuredOutputsParams):
            return self._for(value)
        value = to_plain(value)
        if is_missing(value):
            return self.base
        if not isinstance(value, dict):
            return RowError(f"schema column {self.column!r} must hold a JSON schema (an object or its JSON text) or "
                            f"null, got {type(value).__name__}")
        return self._for(StructuredOutputsParams(json=value))

    def _for(self, constraint: StructuredOutputsParams) -> SamplingParams | RowError:
        found = self._by_key.get(constraint.key)
        if found is None:
            found = self._by_key.put(constraint.key, dataclasses.replace(self.base, structured_outputs=constraint))
        return found


def row_params(columns: Mapping[str, Sequence[Any]], num_rows: int, base: SamplingParams, schema_column: str | None,
               name_rows: bool = False) -> list[SamplingParams | RowError]:
    """Each row's sampling parameters, or its error: `base` for every row without a schema column, else
    `SchemaColumn`'s. `name_rows`: a malformed value's error starts with the row's position ("row 3: ..."),
    which the map operator knows and a job's batch does not (a job's output row is its input row anyway)."""
    if schema_column is None:
        return [base] * num_rows
    return SchemaColumn(schema_column, base).rows(columns[schema_column], name_rows)


# -- OpenAI response_format ---------------------------------------------------------------------------------

_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def response_format_constraint(value: Any) -> StructuredOutputsParams | None:
    """The constraint of an OpenAI `response_format`: {"type": "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}} → a JSON schema, {"type": "json_object"} → any JSON object, {"type": "text"} →
    none. Raises RowError for anything else. The schema is always enforced (`strict` is accepted, not needed)."""
    if not isinstance(value, dict):
        raise RowError(f"response_format must be an object with a type, got {type(value).__name__}")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise RowError(f"response_format has unsupported field{'s' if len(extra) > 1 else ''} "
                       f"{', '.join(extra or ['json_schema'])}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RowError(f"response_format type {kind!r} is not supported; the types are text, json_object and "
                       f"json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RowError("response_format.json_schema must be an object holding the schema")
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise RowError(f"response_format.json_schema has unsupported field{'s' if len(unknown) > 1 else ''} "
                       f"{', '.join(unknown)}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RowError(f"response_format.json_schema.schema must be a JSON schema object, got "
                       f"{type(schema).__name__ if 'schema' in spec else 'none'}")
    if "strict" in spec and not isinstance(spec["strict"], bool) and spec["strict"] is not None:
        raise RowError(f"response_format.json_schema.strict must be a boolean, got {spec['strict']!r}")
    return StructuredOutputsParams(json=schema)


# -- parse_json ---------------------------------------------------------------------------------------------


def is_json_constraint(constraint: StructuredOutputsParams | None) -> bool:
    return constraint is not None and constraint.kind in JSON_KINDS


def parsed_json_text(text: str | None, finish_reason: str | None, error: str | None) -> str | None:
    """The completion's JSON value as canonical text (compact separators, keys in the order generated, non-ASCII
    as is), or None when the completion failed, did not finish with "stop" (a "length" stop cut it short) or is
    not strict JSON (NaN / Infinity are not JSON). Nothing is repaired or guessed."""
    if text is None or error is not None or finish_reason != "stop":
        return None
    try:
        value = json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):  # JSONDecodeError; nesting deeper than the interpreter's stack
        return None
    return _canonical_text(value)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def parsed_text(cell: Any) -> Any:
    """A `parsed` cell of Python objects (one value, or a list of them when n > 1) back as canonical JSON text;
    the inverse of `parsed_values` for one cell. None stays None."""
    if isinstance(cell, list):
        return [None if value is None else _canonical_text(value) for value in cell]
    return None if cell is None else _canonical_text(cell)


def _canonical_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parsed_values(array: Any) -> list[Any]:
    """The `parsed` column's canonical JSON texts (a pyarrow array, list<string> when n > 1) as Python objects."""
    def load(text: str | None) -> Any:
        return None if text is None else json.loads(text)

    return [[load(t) for t in cell] if isinstance(cell, list) else load(cell) for cell in array.to_pylist()]
