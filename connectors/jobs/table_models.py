"""A table job of several models: `models={name: directory}` (`--model NAME=PATH`, repeatable) and a `model_column`
(`--model-column`) naming each row's model.

Each row runs on the model its column value names, with that model's tokenizer, chat template and length; a value
that names none of the job's models, or a null, fails that row alone (its `error` says which column, what it held
and which names the job serves); the job goes on. The output keeps every input column, then a `model` column (named
after the output column like the others: `answer_model`) with the name of the model that ran each row, null where
the row named none, then the usual output columns. When the model column is itself called `model`, it already says
that and no second one is added.

The manifest pins every name's model, tokenizer and length (`model_router.models_identity`) and the model column;
a resume under another model map is refused like any other changed option. Resuming, interruption and retries are
those of every table job (`parquet_job.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa

from batchllm.connectors.cells import is_missing
from batchllm.connectors.constraints import require_compiles
from batchllm.connectors.jobs.identity import require_chat_template
from batchllm.connectors.jobs.job import JobResult, JobSettings, Planner, RowRequest, cap_max_tokens, run_sharded_job
from batchllm.connectors.jobs.manifest import Manifest
from batchllm.connectors.jobs.model_router import ModelRouter, models_identity, plan_by_model
from batchllm.connectors.jobs.parquet_job import table_planner
from batchllm.connectors.jobs.parquet_output import ParquetSink
from batchllm.connectors.jobs.sources import ParquetSource, TextTableSource
from batchllm.connectors.options import MapOptions
from batchllm.connectors.prompts import EncodedPrompt, PromptEncoder
from batchllm.connectors.results import RowOutcome
from batchllm.entrypoints.llm import LLM
from batchllm.sampling_params import SamplingParams


def model_output_column(options: MapOptions, model_column: str, available: list[str]) -> str | None:
    """The output column naming each row's model (None: the input's model column is called that already); fails
    fast on an unknown model column or an input that already has the output column."""
    if not isinstance(model_column, str) or not model_column:
        raise ValueError(f"model_column must be a non-empty string, got {model_column!r}")
    if model_column not in available:
        raise ValueError(f"unknown column {model_column!r} (model_column=); the input has {available}")
    name = options.names.error.removesuffix("error") + "model"  # the other output columns' prefix
    if name == model_column:
        return None
    if name in available:
        raise ValueError(f"the input already has a column {name!r}, the output column naming each row's model; pass "
                         f"another output_column= (the other output columns take it as a prefix) or drop it first")
    return name


def run_table_models(source: ParquetSource | TextTableSource, directory: Path, manifest_path: Path,
                     engines: dict[str, LLM], options: MapOptions, settings: JobSettings, needed: list[str],
                     model_column: str, output_column: str | None) -> JobResult:
    """`parquet_job._run` for several models: `engines` by name, the rows routed by `model_column`."""
    capped = dataclasses.replace(options, sampling_params=cap_max_tokens(options.sampling_params,
                                                                         settings.max_tokens_cap))
    planners: dict[str, Planner] = {}
    for name, engine in engines.items():
        options.with_engine(engine)  # each engine generates
        if options.prompt.chat or options.prompt.messages_column is not None:
            require_chat_template(engine, "chat=True / messages_column= prompts")
        require_compiles(engine, options.sampling_params.structured_outputs)
        planners[name] = table_planner(options, capped, PromptEncoder.for_llm(engine, capped), {}, needed)
    fingerprint = {"job": "parquet", "input": source.fingerprint(), "models": models_identity(engines),
                   "model_column": model_column, "options": options.describe(),
                   "rows_per_shard": settings.rows_per_shard, "max_tokens_cap": settings.max_tokens_cap}
    manifest = Manifest.open(manifest_path, fingerprint, directory)
    sink = ParquetSink(directory, manifest, options, source.total_rows, settings.rows_per_shard,
                       settings.retry_errors)
    if output_column is not None:
        sink = _WithModelColumn(sink, model_column, output_column, frozenset(engines))
    plan = _routed_planner(planners, model_column, capped.sampling_params)
    return run_sharded_job(source, plan, sink, ModelRouter(engines, settings.max_in_flight), settings)


def _routed_planner(planners: dict[str, Planner], column: str, params: SamplingParams) -> Planner:
    """Each model's rows planned by its own planner (its tokenizer and template), in one batch per model; a row
    whose column value names no model gets that error (`params`: the ones an unplanned row carries)."""
    names = ", ".join(planners)

    def unplanned(value: object) -> RowRequest:
        what = "is null" if is_missing(value) else f"names {value!r}, which is not one of the job's models"
        return RowRequest(EncodedPrompt(None, f"model column {column!r} {what}; the models are {names}"), params)

    def plan(batch: pa.RecordBatch) -> list[RowRequest]:
        return plan_by_model(batch, batch.column(column).to_pylist(), planners, unplanned)

    return plan


class _WithModelColumn:
    """A sink whose rows get the output column naming the model each row ran on, after the input columns."""

    def __init__(self, sink: ParquetSink, model_column: str, output_column: str, names: frozenset[str]) -> None:
        self._sink, self._model_column, self._output_column, self._names = sink, model_column, output_column, names
        self.path, self.resume = sink.path, sink.resume

    def write(self, shard: int, rows: pa.Table, outcomes: list[RowOutcome], offsets: list[int],
              complete: bool) -> None:
        values = [value if isinstance(value, str) and value in self._names else None
                  for value in rows.column(self._model_column).to_pylist()]
        self._sink.write(shard, rows.append_column(self._output_column, pa.array(values, pa.string())), outcomes,
                         offsets, complete)
