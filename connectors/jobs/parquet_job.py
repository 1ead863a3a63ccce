"""Table job: a table (Parquet, CSV or JSON lines) in → a directory of Parquet shards out, resumable.

Input: a Parquet file, directory or glob, a CSV file or a JSON-lines table, streamed as record batches;
`sources.py` has the formats, how "auto" tells them apart and how Parquet files' schemas are unified.

Output: `OUTPUT/part-00000.parquet`, ... — shard `i` holds input rows `[i * rows_per_shard,
(i + 1) * rows_per_shard)` in input order, with every input column followed by the output columns
(`batchllm.connectors.results`). Each shard is written atomically (temporary file, fsync, rename) and
then recorded, with its size and SHA-256, in `OUTPUT/_manifest.jsonl` (`manifest.py`); readers that skip
"_" and "." files (pyarrow, Spark, DuckDB globs on `*.parquet`) see only finished shards. Every
`flush_seconds` the finished rows of unfinished shards are checkpointed under `OUTPUT/_partial/`
(`parquet_output.py`). While a job runs it holds `OUTPUT/_lock` (`lock.py`): a second job on the same
output fails at once with `OutputInUse`.

Resuming: re-run the same job. Recorded shards are skipped (whole row groups inside finished shards are
not even read) and checkpointed rows are not run again; a recorded file that is missing or damaged is
deleted and its rows redone, with a warning. `retry_errors=True` re-runs the rows saved with an `error`
and rewrites their shards in place (same file names, rows in input order). The manifest's fingerprint
pins the input (relative paths, sizes, row counts and a hash of each Parquet footer, so moving the input
directory is fine but any rewrite is caught; a CSV / JSON file's name, size and SHA-256), the model
(config hash and weight size), the tokenizer and its chat template (`identity.py`), `max_model_len`, the
prompt options, the sampling parameters (a call-wide constraint's canonical text among them),
`schema_column` and `parse_json` (when set), `lora_column` and `loras` (with each adapter's files' SHA-256),
`truncate`, `output_column`, `rows_per_shard` and `max_tokens_cap`; a mismatch is refused. Per-row schemas
and adapter names are input data, pinned with the input. A job with images (`image_column`, or messages with image
parts) also pins a hash of every image's bytes, files named by path included (`image_identity.py`).
Engine-only options (device, dtype, batch limits, `max_in_flight`, `flush_seconds`) may change between runs.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa

from batchllm.connectors.adapters import adapter_requests, adapters_identity, row_adapters
from batchllm.connectors.cells import RowError
from batchllm.connectors.constraints import SchemaColumn, require_compiles
from batchllm.connectors.images import refuse_uncarried
from batchllm.connectors.jobs.atomic import is_temporary, remove_stale_temporaries
from batchllm.connectors.jobs.identity import (
    model_identity,
    quantization_identity,
    require_chat_template,
    tokenizer_identity,
)
from batchllm.connectors.jobs.image_identity import images_identity
from batchllm.connectors.jobs.job import (
    DEFAULT_FLUSH_SECONDS,
    DEFAULT_MAX_TOKENS_CAP,
    DEFAULT_ROWS_PER_SHARD,
    JobResult,
    JobSettings,
    Planner,
    RowRequest,
    cap_max_tokens,
    run_sharded_job,
)
from batchllm.connectors.jobs.lock import output_lock
from batchllm.connectors.jobs.manifest import Manifest
from batchllm.connectors.jobs.model_router import check_models, model_engines
from batchllm.connectors.jobs.output_directory import created_for_the_job
from batchllm.connectors.jobs.parquet_output import ParquetSink
from batchllm.connectors.jobs.sources import ParquetSource, TextTableSource, open_table_source
from batchllm.connectors.options import DEFAULT_OUTPUT_COLUMN, MapOptions, Template, resolve_options
from batchllm.connectors.prompts import EncodedPrompt, PromptEncoder, encode_rows
from batchllm.connectors.replicas.data_parallel import check_data_parallel_size, engine_for
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.entrypoints.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.sampling_params import SamplingParams

MANIFEST_NAME = "_manifest.jsonl"
LOCK_NAME = "_lock"


def run_parquet_job(input: str | Path, output: str | Path, *, model: str | Path | None = None,
                    llm: LLM | None = None, engine_kwargs: Mapping[str, Any] | None = None,
                    prompt_column: str | None = None, messages_column: str | None = None,
                    prompt_template: Template | None = None, chat: bool = False,
                    sampling_params: SamplingParams | None = None, output_column: str = DEFAULT_OUTPUT_COLUMN,
                    truncate: str | None = None, rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
                    max_in_flight: int | None = None, max_buffered_rows: int | None = None, use_tqdm: bool = True,
                    data_parallel_size: int = 1, input_format: str = "auto", retry_errors: bool = False,
                    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP, flush_seconds: float = DEFAULT_FLUSH_SECONDS,
                    schema_column: str | None = None, parse_json: bool = False, lora_column: str | None = None,
                    loras: Mapping[str, str | Path] | None = None,
                    models: Mapping[str, str | Path | LLM | None] | None = None, model_column: str | None = None,
                    image_column: str | None = None, **sampling_fields: Any) -> JobResult:
    """Generate for every row of the table `input` (read as `input_format`, see `sources.py`) into shards under
    the directory `output`.

    Prompt, sampling, engine and output options are those of `batchllm.generate`. `rows_per_shard` sets
    the unit of output and of resumption; `max_in_flight` the prompts kept in the engine (default: twice
    its max_num_seqs; with data_parallel_size > 1, in each replica's engine); `max_buffered_rows` the
    input rows held in memory (see `job.py`); `data_parallel_size` the engine processes
    (`data_parallel.py`). `lora_column` names each row's adapter among `loras` (see `batchllm.generate`;
    the engine needs enable_lora=True). `retry_errors` re-runs the rows saved with an error; `max_tokens_cap`
    bounds every row's output tokens; `flush_seconds` is the checkpoint interval (see `job.py`). Several models:
    `models={name: directory}` (instead of `model=`) and `model_column` naming each row's (`table_models.py`).
    Raises `JobInterrupted` after SIGINT / SIGTERM, `ManifestMismatch` when `output` belongs to another job,
    `OutputInUse` while another job writes it, `ReplicaPoolError` when every replica died (finished rows are
    saved), and ValueError before generating when chat prompts are asked of a model without a chat template.

    An engine with a pooling task (`engine_kwargs={"task": "embed"}`, or such an `llm`) embeds each row's prompt
    instead (see `batchllm.embed`): no sampling options, `truncate` "right" by default (else "error").
    """
    check_data_parallel_size(data_parallel_size, llm)
    refuse_uncarried(image_column, models is not None)
    task = llm.task if llm is not None else dict(engine_kwargs or {}).get("task", "generate")
    if truncate is None:
        truncate = "error" if task == "generate" else "right"
    options = resolve_options(prompt_column=prompt_column, messages_column=messages_column,
                              prompt_template=prompt_template, chat=chat, sampling_params=sampling_params,
                              output_column=output_column, truncate=truncate, schema_column=schema_column,
                              parse_json=parse_json, lora_column=lora_column, loras=loras,
                              sampling_fields=sampling_fields, task=task, image_column=image_column)
    settings = JobSettings(rows_per_shard, max_in_flight, max_buffered_rows, use_tqdm, max_tokens_cap, flush_seconds,
                           retry_errors)
    if models is not None or model_column is not None:
        from batchllm.connectors.jobs import table_models

        if models is None or model_column is None:
            raise ValueError("models= ({name: model directory}) and model_column= (the column naming each row's "
                             "model) go together: pass both or neither")
        models = check_models(models, model=model, llm=llm, task=task, data_parallel_size=data_parallel_size,
                              loras=loras)
    source = open_table_source(input, input_format)
    needed = options.check_input_columns(source.schema.names)
    if models is not None:
        model_output = table_models.model_output_column(options, model_column, source.schema.names)
    directory = _check_output(Path(output), input)
    # A job refused before it writes anything (say the model does not load) leaves no directory behind.
    with created_for_the_job(directory), output_lock(directory / LOCK_NAME, directory):
        remove_stale_temporaries(directory)  # only now: they could be another job's files in flight
        if models is not None:
            with model_engines(models, engine_kwargs) as engines:
                return table_models.run_table_models(source, directory, directory / MANIFEST_NAME, engines, options,
                                                     settings, needed, model_column, model_output)
        with engine_for(data_parallel_size, model, llm, engine_kwargs, max_in_flight) as engine:
            return _run(source, directory, engine, options.with_engine(engine), settings, needed)


def _run(source: ParquetSource | TextTableSource, directory: Path, engine: LLM | ReplicaPool, options: MapOptions,
         settings: JobSettings, needed: list[str]) -> JobResult:
    if options.prompt.chat or options.prompt.messages_column is not None:
        require_chat_template(engine, "chat=True / messages_column= prompts")
    # The fingerprint keeps the options as asked; rows run with max_tokens capped, before prompts are fitted.
    capped = options if options.pools else dataclasses.replace(
        options, sampling_params=cap_max_tokens(options.sampling_params, settings.max_tokens_cap))
    if not options.pools:
        require_compiles(engine, options.sampling_params.structured_outputs)
    encoder = PromptEncoder.for_llm(engine, capped)
    adapters = adapter_requests(options.loras, engine) if options.lora_column is not None else {}
    fingerprint = {"job": "parquet", "input": source.fingerprint(), "model": model_identity(engine.model_path),
                   "tokenizer": tokenizer_identity(engine.tokenizer), "max_model_len": engine.max_model_len,
                   "options": options.describe(), "rows_per_shard": settings.rows_per_shard,
                   "max_tokens_cap": settings.max_tokens_cap}
    if adapters:
        fingerprint["adapters"] = adapters_identity(options.loras)
    numerics = quantization_identity(engine)
    if numerics is not None:
        fingerprint["quantization"] = numerics
    images = images_identity(source, options.prompt)
    if images is not None:  # only with images: the manifests of text jobs stay as they were
        fingerprint["images"] = images
    manifest = Manifest.open(directory / MANIFEST_NAME, fingerprint, directory)
    sink = ParquetSink(directory, manifest, options, source.total_rows, settings.rows_per_shard,
                       settings.retry_errors)

    plan = table_planner(options, capped, encoder, adapters, needed)
    return run_sharded_job(source, plan, sink, engine, settings)


def table_planner(options: MapOptions, capped: MapOptions, encoder: PromptEncoder, adapters: dict[str, LoRARequest],
                  needed: list[str]) -> Planner:
    """Each row's request, or the error that keeps it from the engine (a bad prompt, schema value or adapter name):
    what a table job (and its dry run) hands the engine. `capped`: the options with max_tokens capped."""
    schemas = None if options.schema_column is None else SchemaColumn(options.schema_column, capped.sampling_params)

    def plan(batch: pa.RecordBatch) -> list[RowRequest]:
        columns = {name: batch.column(name).to_pylist() for name in needed}
        prompts = encode_rows(columns, batch.num_rows, capped, encoder)
        params_list = ([options.pooling if options.pools else capped.sampling_params] * batch.num_rows
                       if schemas is None else schemas.rows(columns[options.schema_column]))
        loras = ([None] * batch.num_rows if not adapters
                 else row_adapters(columns[options.lora_column], adapters, "lora_column", name_rows=False))
        requests = []
        for prompt, params, lora in zip(prompts, params_list, loras):
            # A malformed schema value or an unknown adapter: the row fails, as a bad prompt would.
            error = next((str(e) for e in (params, lora) if isinstance(e, RowError)), None)
            if error is not None:
                prompt = prompt if prompt.error is not None else EncodedPrompt(prompt.token_ids, error)
                params, lora = capped.sampling_params, None
            requests.append(RowRequest(prompt, params, lora))
        return requests

    return plan


def _check_output(directory: Path, input: str | Path) -> Path:
    """The output directory, resolved, once it is known to be one this job may write (it may not exist yet)."""
    directory = directory.expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"output {directory} exists and is not a directory")
    if _input_would_include(input, directory / "part-0.parquet"):
        raise ValueError(f"output {directory} is inside the input {str(input)!r}: its shards would be read as "
                         f"input when the job is resumed")
    # A lock file (and a temporary manifest) alone: a job that has not created its manifest yet, or was killed
    # before it did.
    if directory.exists() and not (directory / MANIFEST_NAME).exists() and any(
            p.name != LOCK_NAME and not is_temporary(p) for p in directory.iterdir()):
        raise FileExistsError(f"output directory {directory} is not empty and holds no batchllm manifest; "
                              f"refusing to write into it")
    return directory


def _input_would_include(input: str | Path, file: Path) -> bool:
    path = Path(input).expanduser()
    if path.is_file():
        return False
    if path.is_dir():
        root = path.resolve()
        return file.is_relative_to(root) and not any(p.startswith((".", "_")) for p in file.relative_to(root).parts)
    return fnmatch.fnmatch(str(file), os.path.abspath(path))  # "*" matches "/" here too: errs on the safe side
