"""The map operator `generate` and the resumable job `run_job`: batchllm's data-pipeline surface."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Mapping

from batchllm.connectors.jobs.identity import require_chat_template
from batchllm.connectors.jobs.job import JobResult
from batchllm.connectors.options import DEFAULT_EMBEDDING_COLUMN, DEFAULT_OUTPUT_COLUMN, Template, resolve_options
from batchllm.connectors.replicas.data_parallel import check_data_parallel_size, engine_for
from batchllm.connectors.tables.mapper import map_columns
from batchllm.entrypoints.llm import LLM
from batchllm.sampling_params import SamplingParams

# (module that must already be imported for the data to be of its kind, connector module)
_CONNECTORS = (("pandas", "pandas"), ("pyarrow", "arrow"), ("datasets", "hf_datasets"), (None, "records"))


def generate(data: Any, *, prompt_column: str | None = None, messages_column: str | None = None,
             prompt_template: Template | None = None, chat: bool = False, system_prompt: str | None = None,
             model: str | Path | None = None, llm: LLM | None = None, engine_kwargs: Mapping[str, Any] | None = None,
             sampling_params: SamplingParams | None = None, output_column: str = DEFAULT_OUTPUT_COLUMN,
             truncate: str = "error", use_tqdm: bool = True, data_parallel_size: int = 1,
             schema_column: str | None = None, parse_json: bool = False, lora_column: str | None = None,
             loras: Mapping[str, str | Path] | None = None, image_column: str | None = None,
             **sampling_fields: Any) -> Any:
    """Generate a completion per row and return the same kind of object with output columns added.

        df.pipe(batchllm.generate, prompt_column="question", max_tokens=64, temperature=0)

    `data`: a pandas DataFrame (index and order kept), a pyarrow Table or RecordBatch, a Hugging Face
    `datasets.Dataset`, a list of prompt strings or a list of row dicts (a list of new dicts comes back).

    The prompt is one of: `prompt_column` (text), `messages_column` (a list of {role, content}, rendered
    with the model's chat template) or `prompt_template` (a `str.format` template over the row's columns,
    or a callable taking the row as a dict and returning text or a list of messages). `chat=True` sends
    the text of a prompt column or template as one user message through the chat template. A list of
    strings needs none of them. `system_prompt` puts a system message first in every chat prompt (with
    `chat=True` or `messages_column`), except in conversations that already start with their own.

    Images (a vision-language model, e.g. Qwen2.5-VL): `image_column="img"` names a column holding each row's
    image or list of images (bytes, PIL images, paths, `data:` URLs, HF `Image` values), and messages may carry
    OpenAI image parts (`{"type": "image_url", "image_url": {"url": ...}}`, `{"type": "image", "image": ...}`).
    A prompt without the model's image placeholder gets its images first, in a user message rendered with the
    chat template: `prompt_template="Describe the image."` captions every row. A row whose image is missing,
    corrupt or too large gets its `error` (`batchllm/connectors/images.py`).

    Sampling: `sampling_params=SamplingParams(...)` or its fields as keywords (`max_tokens=64`,
    `temperature=0`, `n=2`, `logprobs=3`, ...). The engine: `llm=` an existing `LLM`, or `model=` (a
    local HF directory; None: the default model) with `engine_kwargs` for `LLM(...)`; that engine is built
    once per process and reused while later calls ask for the same model and options.

    Output columns (see `batchllm.connectors.results`): `output_column` (default "generated_text"),
    `finish_reason`, `prompt_tokens`, `completion_tokens`, `error` and, with logprobs, `logprobs`; with
    another `output_column` the other names take it as a prefix. `truncate` ("error", "left", "right")
    decides what happens to prompts that leave no room for `max_tokens` within the model's length.

    Structured outputs: `structured_outputs=StructuredOutputsParams(json=Model)` (a sampling field; also
    regex=, choice=, grammar=, json_object=True) constrains every row; it is compiled before anything is
    generated, and one the grammar engine cannot compile raises its `GrammarError` (a ValueError).
    `schema_column="schema"` gives each row its own JSON schema instead: a dict or JSON text (a
    `StructuredOutputsParams` of any kind also works); null leaves that row unconstrained; a value that is not
    JSON or not an object, or a schema that does not compile, fails that row alone (its `error`). In Arrow
    / Parquet keep the schemas as JSON text: a struct column gives each row every key of the others' schemas,
    as nulls, which changes them. The two
    exclude each other. `parse_json=True` (with a JSON constraint) adds a `parsed` column: Python objects
    for pandas and lists of dicts, canonical JSON text for Arrow and datasets (per-row schemas have no
    common struct type); null where the row failed, finished with "length" (cut short) or does not parse.

    Adapters (an engine with `enable_lora=True`, e.g. `engine_kwargs={"enable_lora": True, "max_loras": 4}`):
    `loras={"name": "/path/to/peft/adapter", ...}` with `lora_column="adapter"`, a column naming each row's
    adapter (null or empty: the base model). Every adapter is checked before generation (a bad one fails the
    call, naming it); a row naming an adapter that is not in `loras` fails alone.

    A bad row (null / non-string / empty prompt, malformed messages, a null template field, an over-long
    prompt under truncate="error") gets an `error` and no text; every other row completes. A problem with
    the call itself (no or several prompt sources, an unknown column, a bad sampling value, an output
    column that already exists, chat prompts on a model without a chat template) raises before any generation.

    `data_parallel_size=N` (N > 1) runs N engine processes for this call, one per GPU or per share of the
    CPU cores, with the same results as one engine for greedy and seeded sampling (see
    `batchllm.connectors.replicas.data_parallel`); it takes `model=` / `engine_kwargs=`, not `llm=`.
    """
    check_data_parallel_size(data_parallel_size, llm)
    connector = _connector_for(data)
    if prompt_column is messages_column is prompt_template is None and _is_string_list(data):
        prompt_column = "prompt"
    options = resolve_options(prompt_column=prompt_column, messages_column=messages_column,
                              prompt_template=prompt_template, chat=chat, system_prompt=system_prompt,
                              sampling_params=sampling_params, output_column=output_column, truncate=truncate,
                              schema_column=schema_column, parse_json=parse_json, lora_column=lora_column,
                              loras=loras, sampling_fields=sampling_fields, image_column=image_column)
    columns, num_rows = connector.read_columns(data, options)
    with engine_for(data_parallel_size, model, llm, engine_kwargs) as engine:
        options = options.with_engine(engine)
        if options.prompt.chat or options.prompt.messages_column is not None:
            require_chat_template(engine, "chat=True / messages_column= prompts")
        arrays = map_columns(columns, num_rows, options, engine, use_tqdm)
    return connector.attach_outputs(data, arrays, options)


def embed(data: Any, *, text_column: str | None = None, prompt_template: Template | None = None,
          model: str | Path | None = None, llm: LLM | None = None, engine_kwargs: Mapping[str, Any] | None = None,
          output_column: str = DEFAULT_EMBEDDING_COLUMN, truncate: str = "right", use_tqdm: bool = True,
          data_parallel_size: int = 1, task: str = "embed", pooling: str | None = None,
          normalize: bool | None = None) -> Any:
    """Embed a text per row and return the same kind of object with `embedding` (+ `prompt_tokens`, `error`)
    columns added: fixed_size_list<float32, dim> in Arrow, pandas' ArrowDtype of it, lists in row dicts.

        df = df.pipe(batchllm.embed, text_column="doc")

    `data` and the engine (`llm=`, or `model=` with `engine_kwargs`) as for `generate`; the engine is built with
    `task` ("embed", or "classify": a `*ForSequenceClassification` model's logits per row), `pooling` and
    `normalize` (None: what the model directory says; see `LLM`). `prompt_template` ("query: {doc}") formats
    the row's columns; `truncate="right"` (the default) keeps a long text's first max_model_len tokens, "left"
    its last, "error" fails the row. A null, non-string or empty text fails its row (`error`, null vector).
    """
    check_data_parallel_size(data_parallel_size, llm)
    connector = _connector_for(data)
    if text_column is prompt_template is None and _is_string_list(data):
        text_column = "prompt"
    options = resolve_options(prompt_column=text_column, prompt_template=prompt_template, output_column=output_column,
                              truncate=truncate, task=task)
    columns, num_rows = connector.read_columns(data, options)
    if llm is None:
        engine_kwargs = {**(engine_kwargs or {}), "task": task,
                         **{name: value for name, value in (("pooling", pooling), ("normalize", normalize))
                            if value is not None}}
    elif pooling is not None or normalize is not None:
        raise ValueError("pooling= and normalize= build the engine: pass them with model= / engine_kwargs=, not llm=")
    with engine_for(data_parallel_size, model, llm, engine_kwargs) as engine:
        options = options.with_engine(engine)
        arrays = map_columns(columns, num_rows, options, engine, use_tqdm)
    return connector.attach_outputs(data, arrays, options)


def run_job(input: str | Path, output: str | Path, *, input_format: str = "auto", **options: Any) -> JobResult:
    """Run a resumable batch job: a table in → Parquet shards out, or OpenAI batch JSONL in → JSONL out.

    `input_format` ("auto", "parquet", "csv", "jsonl-table", "openai-batch"; see
    `batchllm.connectors.jobs.sources`): "auto" reads a `.csv` file as CSV, a `.jsonl` / `.json` file as an
    OpenAI Batch API request file (`batchllm.connectors.jobs.jsonl_batch`) when its first line is a request
    and as a JSON-lines table otherwise, and anything else as a Parquet file, directory or glob. A table's
    output is a directory of Parquet shards (`batchllm.connectors.jobs.parquet_job` documents the options,
    the layout, resumption and interruption). Re-running the same call resumes where it stopped.
    `data_parallel_size=N` runs N engine processes (see `generate`); a replica that dies has its rows re-run
    by the others and is listed in `JobResult.replica_failures`.
    """
    from batchllm.connectors.jobs.sources import input_format_of

    kind = input_format_of(input, input_format)
    if kind == "openai-batch":
        from batchllm.connectors.jobs.jsonl_batch import run_jsonl_job

        return run_jsonl_job(input, output, **options)
    from batchllm.connectors.jobs.parquet_job import run_parquet_job

    _check_shard_directory(Path(output))
    return run_parquet_job(input, output, input_format=kind, **options)


def _check_shard_directory(output: Path) -> None:
    """A table job writes a directory: refuse a file-like name (e.g. `out.parquet`) before making a directory of it,
    unless that directory already exists (an earlier job's output, resumed)."""
    if output.suffix.lower() in (".parquet", ".csv", ".jsonl", ".json") and not output.is_dir():
        raise ValueError(f"output {str(output)!r} is a directory of Parquet shards; pass a directory path, e.g. "
                         f"{str(output.with_suffix(''))!r}")


def _connector_for(data: Any):
    for required, name in _CONNECTORS:
        # A DataFrame can only exist if pandas was imported: never import a library just to type-check.
        if required is not None and required not in sys.modules:
            continue
        try:
            module = importlib.import_module(f"batchllm.connectors.tables.{name}")
        except ImportError:
            continue
        if module.accepts(data):
            return module
    hint = ""
    if "pandas" in sys.modules and isinstance(data, sys.modules["pandas"].Series):
        hint = "; for a Series of prompts pass series.to_frame('prompt') with prompt_column='prompt'"
    raise TypeError(f"batchllm.generate takes a pandas DataFrame, a pyarrow Table or RecordBatch, a datasets.Dataset "
                    f"or a list of strings / dicts, got {type(data).__name__}{hint}")


def _is_string_list(data: Any) -> bool:
    return isinstance(data, list) and all(isinstance(item, str) for item in data)
