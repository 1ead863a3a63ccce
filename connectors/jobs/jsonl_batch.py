"""OpenAI Batch API job: a request JSONL file in → a response JSONL file out, resumable.

Every non-blank input line gets exactly one output line (`openai_batch.py` has both formats); a line
that is not valid JSON, not a valid request, a repeated `custom_id`, or a prompt that cannot be served
is answered with its `error` set, and the other lines are unaffected. Output lines come shard by shard
(a shard is `rows_per_shard` consecutive request lines), in input order within a shard; match them to
requests by `custom_id`, as with OpenAI's own output.

Durability: a finished shard's lines are appended to OUTPUT and fsynced, then recorded as a region (its
end, size and SHA-256) in `OUTPUT.manifest.jsonl` (`manifest.py`); every `flush_seconds` the finished
lines of unfinished shards are appended and recorded the same way. On resume every region is verified
and the output is cut back to the last good one (`jsonl_output.py`); recorded lines are not run again.
`retry_errors=True` removes the error lines and answers those requests again: every custom_id stays in
the output exactly once. While a job runs it holds `OUTPUT.lock` (`lock.py`): a second job on the same
output fails at once with `OutputInUse`. The fingerprint pins the input file's SHA-256, the model, the
tokenizer and its chat template, `max_model_len`, the default sampling parameters (the default constraint
among them, when there is one), the adapters of `loras` (their files' SHA-256), `truncate`, `rows_per_shard`
and `max_tokens_cap`. A request's max_tokens above the cap (or null) gets the cap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa

from batchllm.connectors.adapters import adapter_requests, adapters_identity
from batchllm.connectors.cells import RowError
from batchllm.connectors.constraints import require_compiles
from batchllm.connectors.jobs.identity import (
    model_identity,
    quantization_identity,
    require_chat_template,
    tokenizer_identity,
)
from batchllm.connectors.jobs.job import (
    DEFAULT_FLUSH_SECONDS,
    DEFAULT_MAX_TOKENS_CAP,
    DEFAULT_ROWS_PER_SHARD,
    JobResult,
    JobSettings,
    RowRequest,
    cap_max_tokens,
    run_sharded_job,
)
from batchllm.connectors.jobs.jsonl_output import JsonlSink
from batchllm.connectors.jobs.lock import output_lock
from batchllm.connectors.jobs.manifest import Manifest
from batchllm.connectors.jobs.model_router import check_models, model_engines
from batchllm.connectors.jobs.openai_batch import (
    CHAT_URL,
    EMBEDDINGS_URL,
    embedding_input,
    parse_envelope,
    prompt_of,
    sampling_params,
)
from batchllm.connectors.jobs.output_directory import created_for_the_job
from batchllm.connectors.options import TRUNCATE_MODES, lora_pairs, params_dict, resolve_sampling_params
from batchllm.connectors.prompts import PromptEncoder, Rendered
from batchllm.connectors.replicas.data_parallel import check_data_parallel_size, engine_for
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.entrypoints.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams

_SCHEMA = pa.schema([("line", pa.int64()), ("custom_id", pa.string()), ("url", pa.string()), ("model", pa.string()),
                     ("request", pa.string())])


def run_jsonl_job(input: str | Path, output: str | Path, *, model: str | Path | None = None, llm: LLM | None = None,
                  engine_kwargs: Mapping[str, Any] | None = None, sampling_params: SamplingParams | None = None,
                  truncate: str | None = None, rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
                  max_in_flight: int | None = None, max_buffered_rows: int | None = None, use_tqdm: bool = True,
                  data_parallel_size: int = 1, retry_errors: bool = False,
                  max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP, flush_seconds: float = DEFAULT_FLUSH_SECONDS,
                  loras: Mapping[str, str | Path] | None = None,
                  models: Mapping[str, str | Path | LLM | None] | None = None, **sampling_fields: Any) -> JobResult:
    """Answer the OpenAI batch request file `input` into the JSONL file `output`.

    `sampling_params` / sampling keywords are the defaults for fields a request body does not set; a
    default `structured_outputs` constrains the requests without a `response_format` of their own, and is
    compiled before anything runs (GrammarError when it cannot be). The other options are those of
    `run_parquet_job`; prompts come from the requests themselves. Chat requests on a model without a chat
    template raise ValueError before any generation. `loras={name: PEFT directory}` registers adapters (the
    engine needs enable_lora=True): a request whose `model` is one of the names runs under that adapter, and its
    response names it; the base model's name (the model directory's), or no `model`, runs the base model; any
    other `model` fails its line. Without `loras`, `model` is ignored. `models={name: directory}` (instead of
    `model=`) runs each request on the model its `model` names (`jsonl_models.py`).
    """
    check_data_parallel_size(data_parallel_size, llm)
    for name in ("prompt_column", "messages_column", "prompt_template", "chat", "output_column"):
        if name in sampling_fields:
            raise ValueError(f"{name}= does not apply to an OpenAI batch file: each request carries its prompt")
    for name in ("schema_column", "parse_json"):
        if sampling_fields.get(name):
            raise ValueError(f"{name}= does not apply to an OpenAI batch file: a request's body.response_format "
                             f"carries its schema, and its answer is the JSON text")
        sampling_fields.pop(name, None)
    if "lora_column" in sampling_fields:
        raise ValueError("lora_column= does not apply to an OpenAI batch file: a request's body.model names its "
                         "adapter among loras=")
    adapter_dirs = lora_pairs(loras)
    if models is not None:
        task = llm.task if llm is not None else dict(engine_kwargs or {}).get("task", "generate")
        models = check_models(models, model=model, llm=llm, task=task, data_parallel_size=data_parallel_size,
                              loras=loras)
    defaults = resolve_sampling_params(sampling_params, sampling_fields)
    if truncate is not None and truncate not in TRUNCATE_MODES:
        raise ValueError(f"truncate must be one of {TRUNCATE_MODES}, got {truncate!r}")
    settings = JobSettings(rows_per_shard, max_in_flight, max_buffered_rows, use_tqdm, max_tokens_cap, flush_seconds,
                           retry_errors)
    source = JsonlSource(Path(input))
    output = Path(output).expanduser().resolve()
    manifest_path = output.with_name(output.name + ".manifest.jsonl")
    if output.is_dir():
        raise IsADirectoryError(f"output {output} is a directory; an OpenAI batch job writes one JSONL file")
    if output.exists() and not manifest_path.exists():
        raise FileExistsError(f"output {output} exists and has no batchllm manifest beside it; refusing to overwrite")
    # A job refused before it writes anything (say the model does not load) leaves no directory behind.
    engines = engine_for(data_parallel_size, model, llm, engine_kwargs, max_in_flight) if models is None \
        else model_engines(models, engine_kwargs)
    with created_for_the_job(output.parent), output_lock(output.with_name(output.name + ".lock"), output), \
            engines as engine:
        if models is not None:
            from batchllm.connectors.jobs.jsonl_models import run_jsonl_models

            return run_jsonl_models(source, output, manifest_path, engine, defaults, truncate, settings)
        return _run(source, output, manifest_path, engine, defaults, truncate, settings, adapter_dirs)


def _run(source: JsonlSource, output: Path, manifest_path: Path, engine: LLM | ReplicaPool, defaults: SamplingParams,
         truncate: str, settings: JobSettings, adapter_dirs: tuple[tuple[str, str], ...]) -> JobResult:
    if source.chat_requests:
        require_chat_template(engine, f"the {source.chat_requests} {CHAT_URL} requests in {source.path.name}")
    # Too long for the model: an error, but an embedding keeps its first tokens (the embeddings' documented policy).
    pooling = getattr(engine, "pooling_params", None)  # None: the engine generates
    truncate = truncate or ("error" if pooling is None else "right")
    require_compiles(engine, defaults.structured_outputs)
    fingerprint = {"job": "openai-batch", "input": source.fingerprint(), "model": model_identity(engine.model_path),
                   "tokenizer": tokenizer_identity(engine.tokenizer), "max_model_len": engine.max_model_len,
                   "defaults": params_dict(defaults), "truncate": truncate, "rows_per_shard": settings.rows_per_shard,
                   "max_tokens_cap": settings.max_tokens_cap}
    adapters = adapter_requests(adapter_dirs, engine) if adapter_dirs else {}
    if adapters:
        fingerprint["adapters"] = adapters_identity(adapter_dirs)
    numerics = quantization_identity(engine)
    if numerics is not None:
        fingerprint["quantization"] = numerics
    manifest = Manifest.open(manifest_path, fingerprint, output)
    sink = JsonlSink(output, manifest, engine.model_path.name, settings.retry_errors, frozenset(adapters))
    encoder = PromptEncoder(engine.tokenizer, engine.max_model_len, truncate, engine=engine)  # engine: images
    planner = _planner(encoder, defaults, source.duplicates, settings.max_tokens_cap,
                       _AdapterOfModel(adapters, engine.model_path.name), pooling, getattr(engine, "embedding_dim", 0))
    return run_sharded_job(source, planner, sink, engine, settings)


class JsonlSource:
    """The request lines (blank lines are not requests) with their line numbers, custom_ids and urls.

    Opening reads the file once to count the lines, hash the content and find repeated custom_ids;
    only `custom_id`s are kept, so memory does not grow with the prompts.
    """

    def __init__(self, path: Path) -> None:
        self.path = path.expanduser().resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"no OpenAI batch file at {str(path)!r}")
        digest = hashlib.sha256()
        first_line: dict[str, int] = {}
        self.duplicates: dict[int, tuple[str, int]] = {}  # line → (custom_id, the line that used it first)
        self.total_rows = 0
        self.chat_requests = 0  # valid requests to /v1/chat/completions: they need a chat template
        for number, raw in self._lines(digest):
            self.total_rows += 1
            envelope = parse_envelope(raw)
            custom_id = envelope.custom_id
            if envelope.error is None:  # only valid requests claim their custom_id
                self.chat_requests += envelope.url == CHAT_URL
                if custom_id in first_line:
                    self.duplicates[number] = (custom_id, first_line[custom_id])
                else:
                    first_line[custom_id] = number
        self._sha256 = digest.hexdigest()

    def fingerprint(self) -> dict[str, Any]:
        return {"name": self.path.name, "bytes": self.path.stat().st_size, "sha256": self._sha256}

    def batches(self, batch_size: int, skip: Callable[[int, int], bool]) -> Iterator[tuple[int, pa.RecordBatch]]:
        start, pending = 0, []
        for number, raw in self._lines():
            pending.append((number, raw))
            if len(pending) == batch_size:
                if not skip(start, start + len(pending)):
                    yield start, _batch(pending)
                start, pending = start + len(pending), []
        if pending and not skip(start, start + len(pending)):
            yield start, _batch(pending)

    def _lines(self, digest: Any = None) -> Iterator[tuple[int, str | None]]:
        """(line number, text) of the non-blank lines; the text is None for a line that is not valid UTF-8, which
        `parse_envelope` answers with an error instead of passing U+FFFD characters on to the model."""
        with open(self.path, "rb") as file:
            for number, data in enumerate(file, start=1):
                if digest is not None:
                    digest.update(data)
                if data.strip():
                    try:
                        text = data.decode("utf-8-sig" if number == 1 else "utf-8")  # a leading BOM is no JSON
                    except UnicodeDecodeError:
                        text = None
                    yield number, text


class _AdapterOfModel:
    """A request's adapter from its body's `model` (see `run_jsonl_job`)."""

    def __init__(self, adapters: dict[str, LoRARequest], base_name: str) -> None:
        self.adapters, self.base_name = adapters, base_name

    def __call__(self, body: dict[str, Any]) -> LoRARequest | None:
        model = body.get("model")
        if not self.adapters or model is None or model == self.base_name:
            return None
        if model not in self.adapters:
            raise RowError(f"model {model!r} is neither the base model ({self.base_name!r}) nor one of the "
                           f"adapters ({', '.join(self.adapters)})")
        return self.adapters[model]


def _planner(encoder: PromptEncoder, defaults: SamplingParams, duplicates: dict[int, tuple[str, int]],
             max_tokens_cap: int, adapter_of: _AdapterOfModel, pooling: PoolingParams | None = None,
             dim: int = 0) -> Callable[[pa.RecordBatch], list[RowRequest]]:
    """Each line's request; with `pooling` (the engine embeds) its lines are /v1/embeddings requests."""
    def plan(batch: pa.RecordBatch) -> list[RowRequest]:
        rendered: list[Rendered | RowError | list[int]] = []
        params: list[SamplingParams | PoolingParams] = []
        loras: list[LoRARequest | None] = []
        for line, raw in zip(batch.column("line").to_pylist(), batch.column("request").to_pylist()):
            row_params, lora = defaults, None
            try:
                envelope = parse_envelope(raw)
                if envelope.error is not None:
                    raise RowError(envelope.error)
                if line in duplicates:
                    custom_id, first = duplicates[line]
                    raise RowError(f"custom_id {custom_id!r} was already used on line {first}")
                lora = adapter_of(envelope.body)
                if (envelope.url == EMBEDDINGS_URL) != (pooling is not None):
                    needed = "embed" if envelope.url == EMBEDDINGS_URL else "generate"
                    raise RowError(f"{envelope.url} requests need an engine built with task={needed!r}; this job's "
                                   f"{'embeds' if pooling is not None else 'generates'}")
                if pooling is not None:  # text, or token ids
                    row_params, text = pooling, embedding_input(envelope.body, dim)
                    rendered.append(Rendered(text, is_chat=False) if isinstance(text, str) else text)
                else:
                    chat = envelope.url == CHAT_URL
                    row_params = _capped(sampling_params(envelope.body, defaults, chat), max_tokens_cap)
                    prompt = prompt_of(envelope.body, chat)
                    rendered.append(encoder.render_chat(prompt) if chat else Rendered(prompt, is_chat=False))
            except RowError as exc:
                rendered.append(exc)
                lora = None
            params.append(row_params)
            loras.append(lora)
        # A pooled prompt keeps no room for output tokens.
        encoded = encoder.encode(rendered, [0 if isinstance(p, PoolingParams) else p.max_tokens for p in params])
        return [RowRequest(prompt, p, lora) for prompt, p, lora in zip(encoded, params, loras)]

    return plan


def _capped(params: SamplingParams, cap: int) -> SamplingParams:
    """A request may ask for more tokens than the job's cap: it gets the cap (before its prompt is fitted)."""
    try:
        return cap_max_tokens(params, cap)
    except ValueError as exc:  # its min_tokens is above the cap
        raise RowError(f"min_tokens={params.min_tokens} is above the job's max_tokens_cap={cap}") from exc


def _batch(lines: list[tuple[int, str | None]]) -> pa.RecordBatch:
    envelopes = [parse_envelope(raw) for _, raw in lines]
    models = [e.body.get("model") if e.body is not None and isinstance(e.body.get("model"), str) else None
              for e in envelopes]
    return pa.record_batch([[number for number, _ in lines], [e.custom_id for e in envelopes],
                            [e.url for e in envelopes], models, [raw for _, raw in lines]], schema=_SCHEMA)
