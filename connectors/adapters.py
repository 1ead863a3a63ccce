"""Which LoRA adapter each row runs under, for the map operator and the jobs: rows name adapters registered by
name (`loras={name: directory}`); an empty or missing name is the base model."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchllm.connectors.cells import RowError, is_missing
from batchllm.lora.request import LoRARequest


def adapter_requests(loras: Sequence[tuple[str, str]], engine: Any) -> dict[str, LoRARequest]:
    """A `LoRARequest` per registered name (ids in name order, so every run agrees), each checked by the engine
    now: an adapter it cannot apply fails the call (LoRAError names it) before any row runs."""
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(loras))}
    for request in requests.values():
        engine.check_lora(request)
    return requests


def row_adapters(values: Sequence[Any], requests: dict[str, LoRARequest], field: str,
                 name_rows: bool) -> list[LoRARequest | RowError | None]:
    """Each value's adapter (None: the base model), or the error of a value naming no registered adapter.
    `name_rows`: the error starts with the row's position ("row 3: ...")."""
    out: list[LoRARequest | RowError | None] = []
    for i, value in enumerate(values):
        if is_missing(value) or (isinstance(value, str) and not value):
            out.append(None)
        elif isinstance(value, str) and value in requests:
            out.append(requests[value])
        else:
            known = ", ".join(requests) or "none"
            out.append(RowError(f"{f'row {i}: ' if name_rows else ''}{field} names {value!r}, which is not one of "
                                f"loras= ({known})"))
    return out


def adapters_identity(loras: Sequence[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """What pins a job's adapters in its manifest: each file's SHA-256, so a retrained adapter under the same
    name and path is caught on resume."""
    return {name: {file: hashlib.sha256((Path(path) / file).read_bytes()).hexdigest()
                   for file in ("adapter_config.json", "adapter_model.safetensors")}
            for name, path in sorted(loras)}
