"""`batchllm run IN OUT --dry-run`: check a job and size it, with nothing generated and nothing written.

`dry_run(input, output, **options)` takes `run_job`'s arguments and goes through the job's own steps up to the
first write: it validates the options, reads the whole input, checks the columns and the output path, makes
the engine's checks without its weights (`engine_preview.py`: tokenizer, chat template, constraints compiled,
adapters read) and plans every row with the job's planner, so each prompt is rendered (chat template included)
and tokenized exactly as the run would, in the run's batches (the fast tokenizer's batched calls). Mistakes in
the call raise what the run raises, before anything is read that need not be; rows that would fail are
counted and listed with the error the run would save for them.

The report (`DryRunReport.render`) gives the row count, the rows that would fail, the prompt tokens (those the
engine would compute, after truncation), the most output tokens, a few prompts as the model receives them and
`run_estimate.py`'s estimate of the run time. No output directory or file is created, the model's weights
are not read and no GPU memory is taken.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from batchllm.connectors.adapters import adapter_requests
from batchllm.connectors.constraints import require_compiles
from batchllm.connectors.jobs.engine_preview import EnginePreview, preview_engine
from batchllm.connectors.jobs.identity import require_chat_template
from batchllm.connectors.jobs.job import MAX_BATCH_ROWS, JobSettings, RowRequest, cap_max_tokens
from batchllm.connectors.jobs.jsonl_batch import JsonlSource, run_jsonl_job
from batchllm.connectors.jobs.openai_batch import CHAT_URL
from batchllm.connectors.jobs.parquet_job import MANIFEST_NAME, run_parquet_job, table_planner
from batchllm.connectors.jobs.run_estimate import Estimate, Workload, estimate_run, machine_for, weight_bytes
from batchllm.connectors.jobs.sources import input_format_of, open_table_source
from batchllm.connectors.options import TRUNCATE_MODES, lora_pairs, resolve_options, resolve_sampling_params
from batchllm.connectors.prompts import PromptEncoder
from batchllm.connectors.replicas.data_parallel import check_data_parallel_size
from batchllm.model.size import model_size
from batchllm.pooling_params import PoolingParams

SAMPLE_PROMPTS = 3  # the first rows that would run, shown as the model receives them
LISTED_ERRORS = 10  # the first rows that would fail, listed
_SAMPLE_CHARACTERS = 2000


@dataclass(slots=True)
class PlannedRows:
    """The planned rows, counted: the work of those that would run, the first errors of those that would fail, the
    first prompts, decoded from the token ids the engine would get."""

    work: Workload = field(default_factory=Workload)
    failures: list[tuple[int, str]] = field(default_factory=list)  # (row or line, its error): the first ones
    failed: int = 0
    samples: list[tuple[int, int, str]] = field(default_factory=list)  # (row or line, tokens, the prompt as text)
    min_prompt_tokens: int = 0
    max_prompt_tokens: int = 0

    def add(self, where: int, request: RowRequest, engine: EnginePreview, max_tokens_cap: int) -> None:
        prompt = request.prompt
        if prompt.error is not None:
            self.failed += 1
            if len(self.failures) < LISTED_ERRORS:
                self.failures.append((where, prompt.error))
            return
        length = len(prompt.token_ids)
        if isinstance(request.params, PoolingParams):
            self.work.add(length, 1, 0)
        else:  # capped as job.py's feed caps it; None (up to the model's length) is whatever room is left
            room = engine.max_model_len - length
            params = cap_max_tokens(request.params, max_tokens_cap, room)
            self.work.add(length, params.n, params.max_tokens if params.max_tokens is not None else room)
        self.min_prompt_tokens = length if self.work.prompts == 1 else min(self.min_prompt_tokens, length)
        self.max_prompt_tokens = max(self.max_prompt_tokens, length)
        if len(self.samples) < SAMPLE_PROMPTS:
            self.samples.append((where, length, engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)))


@dataclass(slots=True)
class DryRunReport:
    input: str
    input_format: str
    total_rows: int
    output: Path
    output_note: str  # what a run would do with the output path
    engine: EnginePreview
    rows: PlannedRows
    estimate: Estimate
    row_word: str  # "row" (tables, numbered from 0) or "line" (OpenAI batch files, numbered from 1)

    def render(self) -> str:
        """The report as the command prints it."""
        engine, rows, work, estimate, unit = self.engine, self.rows, self.rows.work, self.estimate, self.row_word
        size = model_size(engine.model_config)
        weights = weight_bytes(size, engine)
        stored_as = engine.dtype_name
        if engine.linear_weight_bits != 8 * engine.dtype_bytes:
            stored_as += f" with {engine.linear_weight_bits}-bit linear weights (experts included)"
        if size.experts and engine.expert_weight_bits != engine.linear_weight_bits:  # the experts alone
            # MXFP4 (4.25 bits: its scales counted), or 4- / 8-bit integer experts where the CPU dequantized the
            # other linears.
            if float(engine.expert_weight_bits).is_integer():
                stored_as += f" with {engine.expert_weight_bits}-bit integer experts"
            else:
                stored_as += f" with {engine.expert_weight_bits:g}-bit MXFP4 experts (scales included)"
        facts = [("input", f"{self.input} ({self.input_format}): {self.total_rows:,} {unit}s"),
                 ("output", f"{self.output}: {self.output_note}"),
                 ("model", f"{engine.model_path}: {engine.model_config.architecture}, {size.parameters:,} parameters, "
                           f"{weights / 1e9:.2f} GB as {stored_as} on {engine.device_type}, max_model_len "
                           f"{engine.max_model_len:,}"),
                 (f"{unit}s", f"{work.prompts:,} would run, {rows.failed:,} would fail")]
        if work.prompts:
            mean = work.prompt_tokens / work.prompts
            facts.append(("prompt tokens", f"{work.prompt_tokens:,} (per {unit}: min {rows.min_prompt_tokens:,}, mean "
                                           f"{mean:,.1f}, max {rows.max_prompt_tokens:,})"))
        if engine.pooling_params is not None:
            facts.append(("vectors", f"one of {engine.embedding_dim:,} floats per {unit} ({engine.task}), nothing "
                                    f"generated"))
            phases = f"prefill only, {_duration(estimate.prefill_seconds)}"
        else:
            facts.append(("output tokens", f"at most {work.output_tokens:,} ({work.sequences:,} completions each "
                                           f"running to its max_tokens; most stop earlier)"))
            phases = (f"prefill {_duration(estimate.prefill_seconds)}, decode {_duration(estimate.decode_seconds)} "
                      f"with {estimate.concurrency:,} sequences at once")
        facts.append(("estimate", f"{_duration(estimate.seconds)} on {estimate.machine.description} ({phases}), "
                                  f"model load not counted; a rough roofline estimate, its assumptions in "
                                  f"batchllm/connectors/jobs/run_estimate.py"))
        lines = ["batchllm: dry run: nothing was generated and nothing was written",
                 *(f"{label + ':':<15}{value}" for label, value in facts)]
        if rows.failures:
            where = "the error column" if unit == "row" else "the error of its response line"
            lines += ["", f"{unit}s that would fail ({where} says why; the others run):"]
            lines += [f"  {unit} {number}: {error}" for number, error in rows.failures]
            if rows.failed > len(rows.failures):
                lines.append(f"  ... and {rows.failed - len(rows.failures):,} more")
        if rows.samples:
            lines += ["", "prompts as the model receives them (chat template applied, special tokens shown):"]
            for number, tokens, text in rows.samples:
                shown = text if len(text) <= _SAMPLE_CHARACTERS else (
                    f"{text[:_SAMPLE_CHARACTERS]}... ({len(text) - _SAMPLE_CHARACTERS:,} more characters)")
                lines += [f"--- {unit} {number}: {tokens:,} tokens ---", shown]
        return "\n".join(lines)


def dry_run(input: str | Path, output: str | Path, *, input_format: str = "auto", **options: Any) -> DryRunReport:
    """Check and size the job `run_job(input, output, input_format=input_format, **options)` would run; see the
    module docstring. Raises what the job would raise before generating."""
    kind = input_format_of(input, input_format)
    if kind == "openai-batch":
        return _dry_run_batch_file(input, output, options)
    return _dry_run_table(input, output, kind, options)


def print_dry_run(input: str | Path, output: str | Path, **options: Any) -> int:
    """The command's dry run: the report on stdout; exit status 1 when rows would fail, else 0."""
    report = dry_run(input, output, **options)
    print(report.render())
    return 1 if report.rows.failed else 0


def _dry_run_table(input: str | Path, output: str | Path, kind: str, options: Mapping[str, Any]) -> DryRunReport:
    from batchllm.connectors.jobs.parquet_job import _check_output  # the job's own checks, without its mkdir
    from batchllm.entrypoints.api import _check_shard_directory  # run_job's own check of the output's name

    _check_shard_directory(Path(output))
    a = _arguments(run_parquet_job, input, output, options)
    if a["llm"] is not None:
        raise ValueError("a dry run builds no engine: pass model= and engine_kwargs=, not llm=")
    check_data_parallel_size(a["data_parallel_size"])
    engine_kwargs = dict(a["engine_kwargs"] or {})
    task = engine_kwargs.get("task", "generate")
    truncate = a["truncate"] or ("error" if task == "generate" else "right")
    map_options = resolve_options(
        prompt_column=a["prompt_column"], messages_column=a["messages_column"], prompt_template=a["prompt_template"],
        chat=a["chat"], sampling_params=a["sampling_params"], output_column=a["output_column"], truncate=truncate,
        schema_column=a["schema_column"], parse_json=a["parse_json"], lora_column=a["lora_column"], loras=a["loras"],
        sampling_fields=a["sampling_fields"], task=task)
    settings = _settings(a)
    source = open_table_source(input, kind)
    needed = map_options.check_input_columns(source.schema.names)
    directory = _check_output(Path(output), input)
    engine = preview_engine(a["model"], engine_kwargs)
    map_options = map_options.with_engine(engine)
    # From here on, parquet_job._run's steps up to its manifest.
    if map_options.prompt.chat or map_options.prompt.messages_column is not None:
        require_chat_template(engine, "chat=True / messages_column= prompts")
    capped = map_options if map_options.pools else dataclasses.replace(
        map_options, sampling_params=cap_max_tokens(map_options.sampling_params, settings.max_tokens_cap))
    if not map_options.pools:
        require_compiles(engine, map_options.sampling_params.structured_outputs)
    encoder = PromptEncoder.for_llm(engine, capped)
    adapters = adapter_requests(map_options.loras, engine) if map_options.lora_column is not None else {}
    plan = table_planner(map_options, capped, encoder, adapters, needed)
    note = ("holds a job's manifest: a run resumes that job, if it is this one" if (directory / MANIFEST_NAME).exists()
            else "a run creates it" if not directory.exists() else "empty: a run writes its shards there")

    def planned() -> Iterator[tuple[int, RowRequest]]:
        for start, batch in source.batches(MAX_BATCH_ROWS, lambda first, end: False):
            yield from enumerate(plan(batch), start)

    rows = _count(planned(), engine, settings.max_tokens_cap)
    return DryRunReport(str(input), kind, source.total_rows, directory, note, engine, rows,
                        estimate_run(rows.work, engine, machine_for(engine, a["data_parallel_size"])), "row")


def _dry_run_batch_file(input: str | Path, output: str | Path, options: Mapping[str, Any]) -> DryRunReport:
    from batchllm.connectors.jobs.jsonl_batch import _AdapterOfModel, _planner  # the job's own request planner

    a = _arguments(run_jsonl_job, input, output, options)
    if a["llm"] is not None:
        raise ValueError("a dry run builds no engine: pass model= and engine_kwargs=, not llm=")
    check_data_parallel_size(a["data_parallel_size"])
    fields = dict(a["sampling_fields"])
    for name in ("schema_column", "parse_json"):  # as run_jsonl_job: accepted only when unset
        if not fields.get(name):
            fields.pop(name, None)
    adapter_dirs = lora_pairs(a["loras"])
    defaults = resolve_sampling_params(a["sampling_params"], fields)
    if a["truncate"] is not None and a["truncate"] not in TRUNCATE_MODES:
        raise ValueError(f"truncate must be one of {TRUNCATE_MODES}, got {a['truncate']!r}")
    settings = _settings(a)
    source = JsonlSource(Path(input))
    path = Path(output).expanduser().resolve()
    if path.is_dir():
        raise IsADirectoryError(f"output {path} is a directory; an OpenAI batch job writes one JSONL file")
    manifest = path.with_name(path.name + ".manifest.jsonl")
    if path.exists() and not manifest.exists():
        raise FileExistsError(f"output {path} exists and has no batchllm manifest beside it; refusing to overwrite")
    engine = preview_engine(a["model"], a["engine_kwargs"])
    # From here on, jsonl_batch._run's steps up to its manifest.
    if source.chat_requests:
        require_chat_template(engine, f"the {source.chat_requests} {CHAT_URL} requests in {source.path.name}")
    pooling = engine.pooling_params
    truncate = a["truncate"] or ("error" if pooling is None else "right")
    require_compiles(engine, defaults.structured_outputs)
    adapters = adapter_requests(adapter_dirs, engine) if adapter_dirs else {}
    encoder = PromptEncoder(engine.tokenizer, engine.max_model_len, truncate)
    plan = _planner(encoder, defaults, source.duplicates, settings.max_tokens_cap,
                    _AdapterOfModel(adapters, engine.model_path.name), pooling, engine.embedding_dim)
    note = ("has a manifest beside it: a run resumes that job, if it is this one" if manifest.exists()
            else "a run creates it")

    def planned() -> Iterator[tuple[int, RowRequest]]:
        for _, batch in source.batches(MAX_BATCH_ROWS, lambda first, end: False):
            yield from zip(batch.column("line").to_pylist(), plan(batch))

    rows = _count(planned(), engine, settings.max_tokens_cap)
    return DryRunReport(str(input), "openai-batch", source.total_rows, path, note, engine, rows,
                        estimate_run(rows.work, engine, machine_for(engine, a["data_parallel_size"])), "line")


def _count(planned: Iterator[tuple[int, RowRequest]], engine: EnginePreview, max_tokens_cap: int) -> PlannedRows:
    rows = PlannedRows()
    for where, request in planned:
        rows.add(where, request, engine, max_tokens_cap)
    return rows


def _arguments(job: Callable[..., Any], input: Any, output: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The job's arguments with its defaults filled in; its other keywords under "sampling_fields"."""
    bound = inspect.signature(job).bind(input, output, **options)
    bound.apply_defaults()
    return dict(bound.arguments)


def _settings(a: Mapping[str, Any]) -> JobSettings:
    return JobSettings(a["rows_per_shard"], a["max_in_flight"], a["max_buffered_rows"], False, a["max_tokens_cap"],
                       a["flush_seconds"], a["retry_errors"])


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 60:
        return f"about {seconds:.0f} s"
    if seconds < 3600:
        return f"about {int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"about {int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
