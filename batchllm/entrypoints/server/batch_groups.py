"""A batch's request lines by the served model that runs them (a line's `body.model`: a model, one of its adapters,
or none for the default model), each group one resumable JSONL job on that model's engine.

A batch whose lines all go to one model, as they are, runs one job on the input file itself, its answers in
`JOB_DIR/output.jsonl` (the layout of a one-model server). Otherwise each model's job reads
`JOB_DIR/models/NAME/input.jsonl`: the input with the other models' lines blanked, so every line keeps its number
(the job skips blank lines) and a restart writes the same file again; its answers go to
`JOB_DIR/models/NAME/output.jsonl`. The jobs run at once, each on its own engine. A line that names its model by a
served name the job does not know (the job knows the model directory's name and the adapters') has that `model`
dropped in its group's file: it means the base model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchllm.connectors.jobs.openai_batch import parse_envelope

# A served model's name for a line's `body.model` (None: none given); None for a name the server does not serve.
Route = Callable[[str | None], str | None]


@dataclass(frozen=True, slots=True)
class BatchGroup:
    model: str  # the served model's name
    input: Path
    output: Path


@dataclass(frozen=True, slots=True)
class _Line:
    model: str | None  # the served model; None: a line the job answers with an error, or an unserved model
    drop_model: bool  # its body's `model` is to be dropped (see the module's docstring)


def line_models(path: Path, route: Route, unknown_to_job: Callable[[str, str], bool] | None = None
                ) -> dict[int, _Line]:
    """The served model of each request line, by line number. `unknown_to_job(served name, body.model)`: whether
    that line's job would refuse its `model`."""
    lines: dict[int, _Line] = {}
    with open(path, "rb") as file:
        for number, data in enumerate(file, start=1):
            if not data.strip():
                continue
            try:
                envelope = parse_envelope(data.decode("utf-8-sig" if number == 1 else "utf-8"))
            except UnicodeDecodeError:
                lines[number] = _Line(None, False)
                continue
            if envelope.error is not None:
                lines[number] = _Line(None, False)
                continue
            model = envelope.body.get("model")
            model = model if isinstance(model, str) else None
            served = route(model)
            drop = served is not None and model is not None and unknown_to_job is not None \
                and unknown_to_job(served, model)
            lines[number] = _Line(served, drop)
    return lines


def plan_groups(input_path: Path, job_dir: Path, route: Route, default: str,
                unknown_to_job: Callable[[str, str], bool]) -> list[BatchGroup]:
    """One group per model that runs some of the batch's lines; the lines the job answers with an error go with the
    default model's."""
    lines = line_models(input_path, route, unknown_to_job)
    by_line = {number: line.model or default for number, line in lines.items()}
    names = sorted(set(by_line.values())) or [default]
    if len(names) == 1 and not any(line.drop_model for line in lines.values()):
        return [BatchGroup(names[0], input_path, job_dir / "output.jsonl")]
    groups = []
    for name in names:
        folder = job_dir / "models" / name.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        keep = {number for number, model in by_line.items() if model == name}
        drop = {number for number, line in lines.items() if line.drop_model}
        _write_subset(input_path, folder / "input.jsonl", keep, drop)
        groups.append(BatchGroup(name, folder / "input.jsonl", folder / "output.jsonl"))
    return groups


def group_outputs(job_dir: Path) -> list[Path]:
    """The answer files a batch's jobs write (whether or not they exist yet)."""
    return [job_dir / "output.jsonl", *sorted(job_dir.glob("models/*/output.jsonl"))]


def _write_subset(source: Path, target: Path, keep: set[int], drop_model: set[int]) -> None:
    temporary = target.with_name(target.name + ".tmp")
    with open(source, "rb") as reader, open(temporary, "wb") as writer:
        for number, data in enumerate(reader, start=1):
            if number not in keep:
                data = b"\n"
            elif number in drop_model:
                request = json.loads(data.decode("utf-8-sig" if number == 1 else "utf-8"))
                del request["body"]["model"]
                data = json.dumps(request).encode() + b"\n"
            writer.write(data)
    temporary.replace(target)
