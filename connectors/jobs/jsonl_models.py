"""An OpenAI batch job of several models: `models={name: directory}` (`--model NAME=PATH`, repeatable), each request's
body `model` naming the one it runs on, as `batchllm serve` routes them.

A request without `model` runs on the first model (the server's default); one naming none of the job's models is
answered with an error line that lists them; the other lines are unaffected. Each request is rendered and tokenized
with its model's tokenizer and chat template, and its response names its model. The manifest pins every name's
model, tokenizer and length (`model_router.models_identity`) and the default model; everything else (output,
resuming, retries) is `jsonl_batch.py`'s.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from batchllm.connectors.constraints import require_compiles
from batchllm.connectors.jobs.identity import require_chat_template
from batchllm.connectors.jobs.job import JobResult, JobSettings, Planner, RowRequest, run_sharded_job
from batchllm.connectors.jobs.jsonl_batch import CHAT_URL, JsonlSource, _planner
from batchllm.connectors.jobs.jsonl_output import JsonlSink
from batchllm.connectors.jobs.manifest import Manifest
from batchllm.connectors.jobs.model_router import ModelRouter, models_identity, plan_by_model
from batchllm.connectors.options import params_dict
from batchllm.connectors.prompts import EncodedPrompt, PromptEncoder
from batchllm.entrypoints.llm import LLM
from batchllm.sampling_params import SamplingParams


def run_jsonl_models(source: JsonlSource, output: Path, manifest_path: Path, engines: dict[str, LLM],
                     defaults: SamplingParams, truncate: str | None, settings: JobSettings) -> JobResult:
    """`jsonl_batch._run` for several models: `engines` by name, the first the default."""
    truncate = truncate or "error"
    for engine in engines.values():
        if engine.task != "generate":
            raise ValueError(f"models= (several models) generates: the engine of {engine.model_path} has "
                             f"task={engine.task!r}")
        if source.chat_requests:
            require_chat_template(engine, f"the {source.chat_requests} {CHAT_URL} requests in {source.path.name}")
        require_compiles(engine, defaults.structured_outputs)
    default = next(iter(engines))
    fingerprint = {"job": "openai-batch", "input": source.fingerprint(), "models": models_identity(engines),
                   "default_model": default, "defaults": params_dict(defaults), "truncate": truncate,
                   "rows_per_shard": settings.rows_per_shard, "max_tokens_cap": settings.max_tokens_cap}
    manifest = Manifest.open(manifest_path, fingerprint, output)
    # A response names the model its request chose (the default's name when it chose none).
    sink = JsonlSink(output, manifest, default, settings.retry_errors, frozenset(engines))
    planners = {name: _planner(PromptEncoder(engine.tokenizer, engine.max_model_len, truncate), defaults,
                               source.duplicates, settings.max_tokens_cap, _base_model)
                for name, engine in engines.items()}
    plan = _routed_planner(planners, default, defaults)
    return run_sharded_job(source, plan, sink, ModelRouter(engines, settings.max_in_flight), settings)


def _base_model(body: dict) -> None:
    """A request's adapter: none, in a job of several models (`model` names a model, not an adapter)."""
    return None


def _routed_planner(planners: dict[str, Planner], default: str, defaults: SamplingParams) -> Planner:
    """Each model's lines planned by its own planner, in one batch per model; a line whose `model` names none of
    them gets that error."""
    names = ", ".join(planners)

    def plan(batch: pa.RecordBatch) -> list[RowRequest]:
        chosen = [default if model is None else model for model in batch.column("model").to_pylist()]
        return plan_by_model(batch, chosen, planners, lambda model: RowRequest(EncodedPrompt(
            None, f"body.model {model!r} is not one of the models of this job: {names}"), defaults))

    return plan
