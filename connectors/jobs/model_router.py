"""Several models in one job: an engine per model, and a stream that runs each row on the engine its model names.

`model_engines` builds the engines (one per distinct model directory: two names for one directory share it). On a
GPU they share the card: `gpu_memory_utilization` is divided evenly among them. The engines live in one process,
whose memory profiling counts what the engines built before it hold (`batchllm/executor/profiling.py`), so engine i
of n is given the cumulative share (i + 1) / n of the utilization: each ends up with one n-th.

`ModelRouter.stream` takes the job's requests, each naming its model, and runs one engine at a time on the rows of
its model: rows for the other models wait in a queue while that engine keeps running its own. Once the other models
have a full engine's worth waiting (`max_in_flight`), or the source has nothing more for the running engine, it
finishes its rows and the engine with the most rows waiting runs next. Each engine thus runs its rows in large
batches, and rows come back in completion order with their keys, as from `LLM.stream`.
"""

from __future__ import annotations

import gc
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchllm.config import CacheConfig
from batchllm.connectors.jobs.identity import model_identity, quantization_identity, tokenizer_identity
from batchllm.entrypoints.llm import LLM

if TYPE_CHECKING:  # job.py imports this module
    from batchllm.connectors.jobs.job import Planner, RowRequest

_END = object()


def check_models(models: Any, *, model: Any = None, llm: Any = None, task: str = "generate",
                 data_parallel_size: int = 1, loras: Any = None) -> dict[str, str | Path | LLM | None]:
    """`models={name: model directory, None (the default model) or an LLM}`, checked before any work: names are
    non-empty strings, and the options that apply to one engine only are not given with it."""
    if not isinstance(models, Mapping) or not models or not all(isinstance(name, str) and name for name in models):
        raise ValueError(f"models must map names to model directories (or LLMs), got {models!r}")
    if model is not None or llm is not None:
        raise ValueError("pass models= (several models, each row naming its own) or model= / llm=, not both")
    if task != "generate":
        raise ValueError(f"models= (several models) generates: task={task!r} is not supported with it")
    if data_parallel_size != 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} with models= (several models) is not supported: "
                         f"run one job per model, or one engine")
    if loras:
        raise ValueError("loras= applies to a job of one model; with models= every row runs on a base model")
    return dict(models)


def models_identity(engines: Mapping[str, LLM]) -> dict[str, Any]:
    """What a job of several models pins in its manifest: each name's model, tokenizer, length and numerics (as a
    job of one model pins its own), so a resume with another model under a name is refused."""
    identity = {}
    for name, engine in sorted(engines.items()):
        identity[name] = {"model": model_identity(engine.model_path), "tokenizer": tokenizer_identity(engine.tokenizer),
                          "max_model_len": engine.max_model_len}
        numerics = quantization_identity(engine)
        if numerics is not None:
            identity[name]["quantization"] = numerics
    return identity


@contextmanager
def model_engines(models: Mapping[str, str | Path | LLM | None], engine_kwargs: Mapping[str, Any] | None
                  ) -> Iterator[dict[str, LLM]]:
    """An engine per name of `models` (name → model directory, None for the default model, or an `LLM` built by the
    caller), built now with `engine_kwargs`; the engines built here are dropped on leaving the block."""
    kwargs = dict(engine_kwargs or {})
    paths = {name: None if model is None else str(Path(model).expanduser().resolve())
             for name, model in models.items() if not isinstance(model, LLM)}
    distinct = list(dict.fromkeys(paths.values()))
    built: dict[str | None, LLM] = {}
    share = kwargs.get("gpu_memory_utilization", CacheConfig().gpu_memory_utilization) / max(1, len(distinct))
    try:
        for i, path in enumerate(distinct):
            own = kwargs if len(distinct) == 1 or kwargs.get("device") == "cpu" else {
                **kwargs, "gpu_memory_utilization": share * (i + 1)}
            built[path] = LLM(path, **own)
        yield {name: model if isinstance(model, LLM) else built[paths[name]] for name, model in models.items()}
    finally:
        built.clear()
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


def plan_by_model(batch: pa.RecordBatch, chosen: list[Any], planners: Mapping[str, Planner],
                  unplanned: Callable[[Any], RowRequest]) -> list[RowRequest]:
    """Each model's rows of `batch` (those whose `chosen` value is its name) planned by its own planner, in one
    batch per model, tagged with the model's name; every other row gets `unplanned(its chosen value)`."""
    requests: list[RowRequest | None] = [None] * batch.num_rows
    for name, planner in planners.items():
        rows = [i for i, value in enumerate(chosen) if value == name]
        if rows:
            for row, request in zip(rows, planner(batch.take(pa.array(rows, pa.int64())))):
                request.model = name
                requests[row] = request
    return [unplanned(value) if request is None else request for request, value in zip(requests, chosen)]


class ModelRouter:
    """The engines of a job's models behind `LLM.stream`'s interface: a request is `(key, prompt, params, lora,
    model name)`. `max_in_flight`: the prompts in the running engine at once (None: twice its max_num_seqs)."""

    def __init__(self, engines: Mapping[str, LLM], max_in_flight: int | None = None) -> None:
        if not engines:
            raise ValueError("a job runs at least one model")
        self.engines = dict(engines)
        self.names = list(self.engines)
        distinct = list({id(engine): engine for engine in self.engines.values()}.values())
        self.default_max_in_flight = max_in_flight or 2 * max(e.max_num_seqs for e in distinct)
        # Prompts are fitted to each model's own length; this bounds the room a row's max_tokens=None may take
        # (`job.cap_max_tokens`): if the longest model leaves no more room than the cap, none does.
        self.max_model_len = max(e.max_model_len for e in distinct)
        self.tokenizers = [e.tokenizer for e in distinct]
        self._distinct = distinct
        self._queues: dict[int, deque] = {id(engine): deque() for engine in distinct}

    def has_unfinished(self) -> bool:
        """Whether rows are waiting or running (a request source may pause admission only then)."""
        return any(self._queues.values()) or any(engine.has_unfinished() for engine in self._distinct)

    def stream(self, requests: Iterable[tuple | None], *, max_in_flight: int | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[tuple[Any, Any]]:
        """`(key, output)` for each request, in completion order (see `LLM.stream`; a `None` from `requests` pauses
        admission for a step of the running engine). `stop`: asked before every step; once True the rows in flight
        are aborted, those waiting are dropped and the stream ends."""
        source = _Source(iter(requests))
        limit = max_in_flight or self.default_max_in_flight
        try:
            while not (stop is not None and stop()):
                engine = max(self._distinct, key=lambda e: len(self._queues[id(e)]))
                if not self._queues[id(engine)]:  # nothing waits: the next request says which engine runs
                    item = source.next()
                    if item is _END:
                        return
                    if item is None:
                        raise RuntimeError("the request source paused admission with nothing in flight")
                    self._queue(item)
                    continue
                yield from engine.stream(self._rows_of(engine, source, limit), max_in_flight=limit, stop=stop)
        finally:
            for queue in self._queues.values():
                queue.clear()

    def _rows_of(self, engine: LLM, source: _Source, limit: int) -> Iterator[tuple | None]:
        """`engine`'s requests: those waiting for it, then the source's, queueing the others' until they have
        `limit` waiting; ends when the engine has nothing more to do for now (its stream then finishes its rows)."""
        own = self._queues[id(engine)]
        while True:
            if own:
                yield own.popleft()
                continue
            others = sum(len(q) for key, q in self._queues.items() if key != id(engine))
            item = None if others >= limit else source.next()
            if item is _END:
                return
            if item is None:  # a pause (or enough waiting for the others): step on while this engine has rows
                if not engine.has_unfinished():
                    return
                yield None
                continue
            self._queue(item)

    def _queue(self, item: tuple) -> None:
        key, prompt, params, lora, name = item
        engine = self.engines.get(name)
        if engine is None:
            raise ValueError(f"a request names the model {name!r}; this job's models are {', '.join(self.names)}")
        self._queues[id(engine)].append((key, prompt, params, lora))


class _Source:
    """The job's request iterator, remembered as finished once it is."""

    def __init__(self, items: Iterator[tuple | None]) -> None:
        self._items, self.exhausted = items, False

    def next(self) -> Any:
        if self.exhausted:
            return _END
        item = next(self._items, _END)
        self.exhausted = item is _END
        return item
