"""Ray Data: `LLMPredictor`, a callable class for `Dataset.map_batches`, and `generate(ds, ...)` that wires it up.

    out = batchllm.ray.generate(ds, prompt_column="q", concurrency=4, max_tokens=256)
    out = ds.map_batches(LLMPredictor, fn_constructor_kwargs={"prompt_column": "q", "max_tokens": 256},
                         compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1, batch_size=1024,
                         batch_format="pyarrow")

Each Ray actor (a replica) builds one engine and maps every batch it gets through `batchllm.generate`, so the
rows get the same output columns and per-row errors as the map operator. Ray's concurrency is the data
parallelism; a replica with `tensor_parallel_size > 1` runs its tensor-parallel workers on its own node, on
the GPUs Ray assigned to the actor (Ray sets CUDA_VISIBLE_DEVICES), so a replica's GPUs must fit on one node.
Ray Data restarts lost actors and retries their batches; resuming a killed driver is up to the caller (the
README's "Scaling" section has a recipe).
"""

from __future__ import annotations

from typing import Any, Mapping

try:
    import ray
    import ray.data
except ImportError as error:  # `import batchllm` never gets here: only `import batchllm.ray` needs Ray
    raise ImportError("batchllm.ray needs Ray Data: pip install 'batchllm[ray]'") from error

import numpy as np
import pyarrow as pa

import batchllm
from batchllm.config import DEFAULT_MAX_NUM_SEQS
from batchllm.connectors.constraints import parsed_text
from batchllm.connectors.engine_cache import get_llm
from batchllm.connectors.options import MapOptions, resolve_options
from batchllm.connectors.results import output_schema

# resolve_options' named options; any other keyword that is not an engine option is a sampling field.
_MAP_OPTIONS = ("prompt_column", "messages_column", "prompt_template", "chat", "sampling_params",
                "output_column", "truncate", "schema_column", "parse_json", "image_column")
_ENGINE_OPTIONS = ("model", "engine_kwargs")


class LLMPredictor:
    """`ds.map_batches(LLMPredictor, fn_constructor_kwargs=options, ...)`: one engine per actor.

    `options` are `batchllm.generate`'s keywords (prompt_column / messages_column / prompt_template, chat,
    model, engine_kwargs, sampling_params or sampling fields, output_column, truncate, use_tqdm), validated
    here so a mistake fails the actor's construction instead of every batch. Batches may be pyarrow Tables,
    pandas DataFrames or dicts of numpy arrays; the same type comes back with the output columns added.
    """

    def __init__(self, **options: Any) -> None:
        self.map_options = check_options(options)
        self._generate_options = {key: value for key, value in options.items()
                                  if key not in _ENGINE_OPTIONS and key != "data_parallel_size"}
        self._generate_options.setdefault("use_tqdm", False)  # a bar per batch would flood the actor's log
        self.llm = get_llm(options.get("model"), None, options.get("engine_kwargs"))
        self.map_options = self.map_options.with_engine(self.llm)  # the engine's columns too (reasoning)

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self._map_numpy(batch)
        return batchllm.generate(batch, llm=self.llm, **self._generate_options)

    def _map_numpy(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Ray's "numpy" format: through row dicts, which take any Python value (Arrow would refuse a column
        that mixes strings with numbers), and back to typed arrays; the input arrays come back untouched."""
        names = list(batch)
        rows = [dict(zip(names, values)) for values in zip(*(np.asarray(batch[name]).tolist() for name in names))]
        out = batchllm.generate(rows, llm=self.llm, **self._generate_options)
        schema = output_schema(self.map_options)
        if self.map_options.parse_json:  # row dicts hold parsed objects; the column is their canonical JSON text
            parsed = self.map_options.names.parsed
            out = [{**row, parsed: parsed_text(row[parsed])} for row in out]
        table = pa.Table.from_pylist([{name: row[name] for name in schema.names} for row in out], schema=schema)
        # to_numpy follows Ray's own conversions, e.g. a nullable int column becomes floats with NaN.
        return {**batch, **{name: table.column(name).to_numpy(zero_copy_only=False) for name in schema.names}}


def generate(ds: ray.data.Dataset, *, concurrency: int = 1, batch_size: int | None = None,
             num_gpus_per_replica: float | None = None, **options: Any) -> ray.data.Dataset:
    """`batchllm.generate` over a Ray Dataset: returns a lazy Dataset with the output columns added.

    `options` are `batchllm.generate`'s keywords (except `llm=`: every replica builds its own engine from
    `model=` / `engine_kwargs=`). `concurrency` replicas each hold one engine; each gets
    `num_gpus_per_replica` GPUs (default: `engine_kwargs["tensor_parallel_size"]` times
    `engine_kwargs["pipeline_parallel_size"]`, each 1 when absent, when the cluster has GPUs, else none).
    `batch_size` rows go to a replica at a time (default: 4 × max_num_seqs, 4 × 256 where the engine chooses its own).
    """
    check_options(options)
    _check_count("concurrency", concurrency)
    engine_kwargs = dict(options.get("engine_kwargs") or {})
    batch_size = default_batch_size(engine_kwargs) if batch_size is None else _check_count("batch_size", batch_size)
    return ds.map_batches(LLMPredictor, fn_constructor_kwargs=options,
                          compute=ray.data.ActorPoolStrategy(size=concurrency),
                          num_gpus=gpus_per_replica(num_gpus_per_replica, engine_kwargs),
                          batch_size=batch_size, batch_format="pyarrow")


def check_options(options: Mapping[str, Any]) -> MapOptions:
    """Validate `batchllm.generate` options for use on Ray; raises on what the map operator would refuse."""
    if "llm" in options:
        raise ValueError("batchllm.ray builds one engine per Ray actor from model= and engine_kwargs=; an LLM "
                         "object (llm=) cannot be shared with the actors")
    for source in (options, options.get("engine_kwargs") or {}):
        if source.get("data_parallel_size", 1) not in (None, 1):
            raise ValueError(f"data_parallel_size={source['data_parallel_size']} does not apply on Ray: each "
                             f"replica is one engine, so ask for concurrency=N replicas instead")
    named = {key: options[key] for key in _MAP_OPTIONS if key in options}
    sampling = {key: value for key, value in options.items()
                if key not in _MAP_OPTIONS + _ENGINE_OPTIONS + ("use_tqdm", "data_parallel_size")}
    return resolve_options(**named, sampling_fields=sampling)


def default_batch_size(engine_kwargs: Mapping[str, Any]) -> int:
    # A replica finishes a batch before it starts the next, so the engine drains at the end of every batch:
    # its last rows run with fewer and fewer sequences in flight. Several times the engine's concurrency
    # keeps that tail a small share of the time, while a lost actor still repeats only one modest batch.
    return 4 * int(engine_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)


def gpus_per_replica(requested: float | None, engine_kwargs: Mapping[str, Any]) -> float:
    """GPUs Ray reserves for each actor: all of one replica's ranks (tensor-parallel times pipeline stages), on one
    node."""
    tensor_parallel = _check_count("tensor_parallel_size", engine_kwargs.get("tensor_parallel_size", 1))
    stages = _check_count("pipeline_parallel_size", engine_kwargs.get("pipeline_parallel_size", 1))
    needed = tensor_parallel * stages * (2 if engine_kwargs.get("disaggregated") else 1)
    if requested is None:
        return needed if _cluster_gpus() > 0 else 0
    if isinstance(requested, bool) or not isinstance(requested, (int, float)) or requested < 0:
        raise ValueError(f"num_gpus_per_replica must be a number >= 0, got {requested!r}")
    if 0 < requested < needed:
        sizes = f"tensor_parallel_size={tensor_parallel}"
        sizes += f" x pipeline_parallel_size={stages}" if stages > 1 else ""
        raise ValueError(f"{sizes} needs {needed} GPUs per replica, got num_gpus_per_replica={requested}")
    return requested


def _cluster_gpus() -> float:
    if not ray.is_initialized():
        ray.init()  # what Ray Data would do on first execution; needed here to see the cluster's GPUs
    return ray.cluster_resources().get("GPU", 0)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value

