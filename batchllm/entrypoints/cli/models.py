"""`batchllm run --model`: one model, or several (`--model NAME=PATH`, repeatable) with each row naming its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def job_models(given: list[tuple[str | None, str]] | None, model_column: str | None, input_format: str,
               options: dict[str, Any]) -> str | None:
    """The job's one model (its path; None: the default model), or None after putting several in `options` as
    `models` (name → path; a bare PATH is named after its directory) with the table's `model_column`. ValueError
    for a usage error, naming the flags."""
    given = given or []
    if len(given) <= 1 and model_column is None:
        return given[0][1] if given else None  # a bare PATH, or a lone NAME=PATH: nothing to route
    if input_format == "openai-batch" and model_column is not None:
        raise ValueError("--model-column does not apply to an OpenAI batch file: a request's `model` names its model")
    if not given:
        raise ValueError("--model-column needs the models it names: --model NAME=PATH (repeatable)")
    if options.get("loras"):
        raise ValueError("--lora applies to a job of one --model")
    models: dict[str, str] = {}
    for name, path in given:
        name = name or Path(path).expanduser().resolve().name
        if name in models:
            raise ValueError(f"--model names two models {name!r}: give each its own NAME=PATH")
        models[name] = path
    options["models"] = models
    if input_format != "openai-batch":
        if model_column is None:
            raise ValueError(f"several --model need --model-column NAME, the column naming each row's model (one "
                             f"of {', '.join(models)})")
        options["model_column"] = model_column
    return None
