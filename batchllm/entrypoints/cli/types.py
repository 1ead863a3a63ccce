"""The CLI's argument types: each parses one flag's value, or raises argparse.ArgumentTypeError saying why."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from batchllm.engine.prefill_decode_build import parse_layout
from batchllm.engine.speculative.config import parse_speculative_config
from batchllm.structured_outputs import StructuredOutputsParams


def json_schema_file(path: str) -> StructuredOutputsParams:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the JSON schema file {path!r}: "
                                         f"{getattr(exc, 'strerror', None) or exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{path!r} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{path!r} holds a JSON {type(schema).__name__}; a JSON schema is an "
                                         f"object") from None
    return StructuredOutputsParams(json=schema)


def _choices(text: str) -> list[str]:
    """`A,B,C`, or a JSON array of strings for choices that hold commas: `["Paris, France", "Rome"]`."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} starts like a JSON array but is not valid JSON: {exc}") \
                from None
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise argparse.ArgumentTypeError(f"a JSON array of choices must hold non-empty strings; got {text!r}")
        return value
    value = text.split(",")
    if not all(value):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-empty strings, e.g. yes,no (or a JSON array "
                                         f"of strings); got {text!r}")
    return value


def constraint_of(kind: str):
    def parse(text: str) -> StructuredOutputsParams:
        value: Any = _choices(text) if kind == "choice" else text
        try:
            return StructuredOutputsParams(**{kind: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace("StructuredOutputsParams.", "")) from None

    parse.__name__ = kind
    return parse


def token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, e.g. 1,2; got {text!r}") from None


def adapter(text: str) -> tuple[str, str]:
    """`NAME=PATH`: a LoRA adapter directory registered under a name (`--lora`)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter name and its PEFT directory), got {text!r}")
    return name.strip(), path


def served_model(text: str) -> tuple[str | None, str]:
    """`PATH` or `NAME=PATH` (`--model` of `batchllm run` and `batchllm serve`): a model directory, under NAME when
    one is given. NAME holds no path separator, so a path with "=" in it stays a path."""
    name, sep, path = text.partition("=")
    if sep and name.strip() and "/" not in name and path:
        return name.strip(), path
    return None, text


def disaggregated_layout(text: str) -> dict[str, Any]:
    """`--disaggregated JSON`, e.g. '{"prefill": 1, "decode": 1}': checked here, passed on as the dict."""
    try:
        layout = json.loads(text)
        parse_layout(layout)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("LLM argument disaggregated", "--disaggregated")) from None
    return layout


def speculative_config(text: str) -> dict[str, Any]:
    """`--speculative-config JSON`: checked here, passed on as the dict (picklable for data-parallel replicas)."""
    try:
        parse_speculative_config(text, "--speculative-config")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return json.loads(text)
