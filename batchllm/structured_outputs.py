"""`StructuredOutputsParams`: the constraint a request's output must satisfy (vLLM-compatible names).

Exactly one of `json`, `regex`, `choice`, `grammar` or `json_object` is set. Construction validates the
shape of the value and turns it into a canonical `(kind, spec)` pair: a JSON schema given as a dict, a JSON
string or a pydantic model class becomes one compact JSON text, so equal constraints share one compiled
grammar whatever form they came in. Keys keep their order: the grammar has the output's fields in the order
the schema lists them (a "reasoning" field before "answer" is how users make a model think first). Whether
the grammar engine can compile the spec (a regex that does not parse, a schema feature it lacks) is known only
when it is compiled, before generation.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(eq=False)
class StructuredOutputsParams:
    json: dict | str | type | None = None  # a JSON schema: dict, JSON text or a pydantic model class
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF-style EBNF text
    json_object: bool = False  # any JSON object
    kind: str = field(init=False)
    spec: str = field(init=False)  # canonical text of the constraint; with `kind`, the compile-cache key

    def __post_init__(self) -> None:
        given = [name for name in KINDS if _is_set(name, getattr(self, name))]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                             f"json_object; got {', '.join(given) if given else 'none'}")
        self.kind = given[0]
        self.spec = _canonical(self.kind, getattr(self, self.kind))

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec

    def describe(self) -> dict[str, Any]:
        """A JSON-able identity (job manifests, logs)."""
        return {"kind": self.kind, "spec": self.spec}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __reduce__(self):
        # Pickles (data-parallel replicas, tensor-parallel workers) carry the canonical text, not a pydantic class.
        values = [getattr(self, name) for name in KINDS]
        if self.kind == "json":
            values[0] = self.spec
        return StructuredOutputsParams, tuple(values)


def _is_set(name: str, value: Any) -> bool:
    if name == "json_object":
        if not isinstance(value, bool):
            raise ValueError(f"StructuredOutputsParams.json_object must be a bool, got {value!r}")
        return value
    return value is not None


def _canonical(kind: str, value: Any) -> str:
    if kind == "json":
        return json_module.dumps(_schema_dict(value), separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of strings, got {value!r}")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"StructuredOutputsParams.choice must hold non-empty strings, got {value!r}")
        return json_module.dumps(list(value), ensure_ascii=False)
    if kind == "json_object":
        return ""
    if not isinstance(value, str) or not value:
        raise ValueError(f"StructuredOutputsParams.{kind} must be a non-empty string, got {value!r}")
    return value


def _schema_dict(value: Any) -> dict:
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic v2 model class
        value = value.model_json_schema()
    elif isinstance(value, str):
        try:
            value = json_module.loads(value)
        except json_module.JSONDecodeError as error:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("StructuredOutputsParams.json must be a JSON schema (a dict, JSON text or a pydantic "
                         f"model class), got {type(value).__name__}")
    return value
