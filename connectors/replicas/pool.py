"""`ReplicaPool`: N engine processes on one machine, fed from one work queue, results back by the caller's key.

The pool quacks like the parts of `LLM` the connectors use (`tokenizer`, `max_model_len`, `model_path`,
`admission_order`, `stream`, `check_structured_outputs`), so the map operator and the jobs run on it
unchanged: prompts are encoded, and bad rows answered, in this (the parent) process; only good rows travel,
as token ids.

Work queue: the parent holds the rows it has pulled from the caller's source in one queue and hands a
chunk to a replica whenever that replica asks for more (it asks while its engine is still busy, so it
never drains). A chunk is `chunk_rows` rows, or an equal share of what is queued when less is left, so
every replica gets work on a small input and the last chunks are small: a slow replica holds little
that the others could have done. Replicas are handed work by the parent rather than pulling from a shared
`multiprocessing.Queue` so the parent always knows which rows each replica holds, and because a process
killed while reading a shared queue can leave its lock held and stall every other reader.

Death: when a replica exits unasked (crash, OOM kill, `kill -9`), the rows it held and had not returned go
back to the front of the queue for the others, a `RuntimeWarning` names the replica and its exit status,
and a `ReplicaFailure` is appended to `failures`. Each row's result is yielded exactly once. With every
replica dead, `ReplicaPoolError` is raised. An engine that fails to build raises its own exception in the
parent (with the replica's traceback attached as a note on Python >= 3.11).

Shutdown: `close()` (or leaving the `with` block) sends `Stop`, joins, then terminates and kills what
is left. A pool that is never closed is shut down when it is garbage-collected or at interpreter exit.
Replicas ignore SIGINT and leave when the parent process is gone.

Scripts that create a pool must guard their entry point with `if __name__ == "__main__":`, as for any
`spawn` start method: each replica imports the main module.
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any, Generic, TypeVar

from batchllm.connectors.replicas.devices import Placement, plan_placements
from batchllm.connectors.replicas.errors import ReplicaFailure, ReplicaPoolError, build_error
from batchllm.connectors.replicas.messages import (
    BuildFailed,
    CheckConstraint,
    Chunk,
    ConstraintChecked,
    Crashed,
    Ready,
    Results,
    WantWork,
    WorkItem,
)
from batchllm.connectors.replicas.process import (
    ABORT_SECONDS,
    ReplicaProcess,
    replica_events,
    shutdown_replicas,
    start_replica,
)
from batchllm.connectors.replicas.replica import ReplicaSpec, default_chunk_rows, default_in_flight
from batchllm.engine_config import EngineConfig
from batchllm.entrypoints.admission_order import admission_order
from batchllm.lora.registry import AdapterRegistry
from batchllm.lora.request import LoRARequest
from batchllm.multimodal.engine_limits import image_refusal
from batchllm.outputs import RequestOutput
from batchllm.reasoning import reasoning_parser
from batchllm.request_source import RequestSource
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams

K = TypeVar("K")
_STOP_SECONDS = 30.0  # a replica told to stop with nothing in flight exits within a second or two


@dataclass(slots=True)
class _Row(Generic[K]):
    key: K
    text: str | None
    token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None
    mm: Any = None  # a prepared row's images (and the error they gave), carried to the replica
    error: str | None = None


class ReplicaPool:
    """`size` replica processes, each with its own `LLM(model, **engine_kwargs)`, built in parallel.

    `max_in_flight_per_replica`: prompts each engine admits at once (default: its max_num_seqs plus one
    chunk, so a chunk waits while a batch runs). `chunk_rows`: rows handed out at a time (default: a
    quarter of max_num_seqs, 8 to 256). A GPU engine chooses its own max_num_seqs when the options leave it unset
    (executor/calibration.py): the defaults follow the smallest replica's once all are built.
    """

    def __init__(self, size: int, model: str | Path | None = None, engine_kwargs: Mapping[str, Any] | None = None,
                 *, max_in_flight_per_replica: int | None = None, chunk_rows: int | None = None) -> None:
        from batchllm.model.config import ModelConfig, read_hf_config
        from batchllm.model.loader import resolve_model_path
        from batchllm.model.pooling_config import pooled_dim, resolve_pooling
        from batchllm.model.quantization import pinned_quantization, resolve_kv_cache_dtype

        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"data_parallel_size must be an int >= 1, got {size!r}")
        kwargs = dict(engine_kwargs or {})
        config = EngineConfig.from_kwargs(model=model, **kwargs)  # every replica's checks, made once, here
        self._given_sizes = (max_in_flight_per_replica, chunk_rows)
        self._size_by(config.scheduler.max_num_seqs)
        self.reorder_by_prefix = config.reorder_by_prefix and config.cache.enable_prefix_caching
        self.model_path = resolve_model_path(model)  # converts the default model once, here, not in every replica
        # As an LLM reports them (job manifests pin them); the replicas check them against the checkpoint.
        self.quantization = pinned_quantization(read_hf_config(self.model_path), config.quantization.quantization)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.quantization.kv_cache_dtype)
        self.deterministic = config.deterministic
        # A pooling task's, as an LLM reports them (the map operator and the jobs ask).
        self.task = config.pooling.task
        model_config = ModelConfig.from_hf_dict(read_hf_config(self.model_path))
        self.pooling_params = resolve_pooling(self.model_path, model_config, self.task, config.pooling.pooling,
                                              config.pooling.normalize)
        self.embedding_dim = pooled_dim(model_config, self.pooling_params)
        self._model_config, self._allow_remote_media = model_config, config.allow_remote_media
        self.image_refusal = None if model_config.vision is None else image_refusal(config, model_config)
        self._image_prompts: Any = None
        self.reasoning_parser = reasoning_parser(config.reasoning_parser)  # the replicas split; the doors add a column
        self.failures: list[ReplicaFailure] = []
        self.tokenizer: Any = None
        self.max_model_len = 0
        self._rows: dict[int, _Row] = {}  # seq → row, for every row pulled and not yet yielded
        self._queue: deque[int] = deque()  # seqs waiting for a replica
        self._next_seq = 0
        self._next_check = 0  # CheckConstraint tokens
        self._replicas: list[ReplicaProcess] = []
        self._finalizer = Finalize(self, shutdown_replicas, args=(self._replicas, ABORT_SECONDS), exitpriority=10)
        try:
            placements = plan_placements(size, kwargs)
            if any(p.env for p in placements):
                from batchllm.connectors.engine_cache import clear_engine_cache

                clear_engine_cache()  # a cached engine in this process would hold replica 0's GPU memory
            for index, placement in enumerate(placements):
                self._replicas.append(self._start(index, placement, kwargs))
            if not kwargs.get("skip_tokenizer_init", False):
                from batchllm.tokenizer import load_tokenizer

                self.tokenizer = load_tokenizer(kwargs.get("tokenizer") or self.model_path,
                                                trust_remote_code=kwargs.get("trust_remote_code", False))
            self._adapters = AdapterRegistry(model_config, config.lora.max_lora_rank, config.lora.enable_lora)
            self._wait_until_ready()
        except BaseException:
            self.close(ABORT_SECONDS)
            raise

    def _size_by(self, max_num_seqs: int) -> None:
        in_flight, chunk_rows = self._given_sizes
        self.max_num_seqs = max_num_seqs
        self.max_in_flight_per_replica = in_flight or default_in_flight(max_num_seqs)
        self.chunk_rows = min(chunk_rows or default_chunk_rows(max_num_seqs), self.max_in_flight_per_replica)

    @property
    def size(self) -> int:
        return len(self._replicas)

    @property
    def replica_pids(self) -> list[int | None]:
        return [r.process.pid for r in self._replicas]

    @property
    def default_max_in_flight(self) -> int:
        """Rows out at once that keep every engine full with a chunk in reserve."""
        return self.size * (self.max_in_flight_per_replica + self.chunk_rows)

    def admission_order(self, token_lists: list[Any],
                        loras: list[LoRARequest | None] | None = None) -> list[int]:
        """The order `LLM.admission_order` would use: rows sharing a prefix (or an adapter) go out together."""
        return admission_order(token_lists, loras, self.reorder_by_prefix)

    def has_unfinished(self) -> bool:
        """Whether rows of a stream are out (queued here or held by replicas): a source may pause only then."""
        return bool(self._rows)

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """`LLM.check_structured_outputs` on a replica's engine: compile a call-wide constraint before any row goes
        out, and raise the engine's GrammarError (a ValueError) if it cannot be compiled. The parent has no
        grammar engine of its own; every replica's is built alike, so one answer holds for all (the others compile
        it with their first row that uses it). A replica that dies meanwhile is handled as in `stream`, and the
        next one asked."""
        if self._rows:
            raise RuntimeError("check_structured_outputs is for before a stream, not while rows are out")
        if not self._finalizer.still_active():
            raise RuntimeError("the replica pool is closed")
        self._next_check += 1
        token = self._next_check
        while True:
            replica = next((r for r in self._replicas if r.alive), None)
            if replica is None:
                raise ReplicaPoolError(f"all {self.size} data-parallel replicas died", self.failures)
            try:
                replica.tasks.send(CheckConstraint(token, params))
            except OSError:  # it died: its sentinel reports that below
                pass
            while replica.alive:
                for source, message in replica_events(self._replicas):
                    if isinstance(message, ConstraintChecked) and message.token == token:
                        if message.message is None:
                            return
                        if message.error is not None:
                            raise message.error
                        raise ValueError(message.message)
                    if isinstance(message, WantWork):
                        source.hungry = True
                    elif isinstance(message, Crashed):
                        source.error = message.traceback
                    elif message is None:
                        self._lost(source)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """`LLM.check_lora`, here in the parent: reading and checking an adapter needs the model's config only, and
        every replica's engine is built alike."""
        self._adapters.check_call(lora_request, 1)

    def generate(self, prompts: list[list[int]] | list[str],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Outputs for `prompts` (token-id lists or text) in input order, like `LLM.generate`."""
        sampling_params = sampling_params or SamplingParams()
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        token_lists = [p if isinstance(p, list) else self._tokenize(p, i) for i, p in enumerate(prompts)]
        order = self.admission_order(token_lists)
        requests = ((i, prompts[i], sampling_params) for i in order)
        for index, output in self.stream(requests):
            outputs[index] = output
        return outputs  # type: ignore[return-value]  (every slot is filled once the stream ends)

    def stream(self, requests: Iterable[tuple[K, str | list[int], SamplingParams]
                                        | tuple[K, str | list[int], SamplingParams, LoRARequest | None] | None], *,
               max_in_flight: int | None = None, stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[K, RequestOutput]]:
        """`LLM.stream` across the replicas: `(key, output)` as rows finish, in completion order.

        An item may name its adapter as a fourth element, as for `LLM.stream`. `max_in_flight` bounds the rows
        out at once (queued here or held by replicas); None: no bound. The source may yield None to pause
        admission, never while nothing is in flight. Rows still out when the caller stops early are dropped;
        their late results are ignored. `stop` is asked whenever a replica reports (rows done, a request for work):
        once it returns True the stream ends, dropping the rows out; closing the pool then stops the replicas
        at their next step.
        """
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be an int >= 1 or None, got {max_in_flight!r}")
        if not self._finalizer.still_active():
            raise RuntimeError("the replica pool is closed")
        return self._stream(iter(requests), max_in_flight, stop)

    def close(self, timeout: float = _STOP_SECONDS) -> None:
        """Stop every replica: `Stop`, then terminate and kill what has not exited within `timeout` seconds."""
        if self._finalizer.still_active():
            self._finalizer.cancel()
            shutdown_replicas(self._replicas, timeout)

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(_STOP_SECONDS if exc_type is None else ABORT_SECONDS)

    # -- the parent's side of the work queue ------------------------------------------------------------

    def _stream(self, requests: Iterator, max_in_flight: int | None,
                stop: Callable[[], bool] | None = None) -> Iterator[tuple[Any, RequestOutput]]:
        source = RequestSource(requests)
        try:
            while True:
                if stop is not None and stop():
                    return
                for item in source.take(None if max_in_flight is None else max_in_flight - len(self._rows)):
                    self._add(*item)
                self._dispatch()
                if source.finished(len(self._rows)):
                    return
                yield from self._handle_events()
        finally:
            self._rows.clear()
            self._queue.clear()

    def image_prompts(self) -> Any:
        """`LLM.image_prompts`: rows with images are prepared here (by the doors' worker) and their images travel to
        the replica with the row."""
        if self._image_prompts is None:
            from batchllm.entrypoints.multimodal_prompts import MultiModalPrompts  # Pillow, only for images

            self._image_prompts = MultiModalPrompts(self.model_path, self._model_config, self.tokenizer,
                                                    self._allow_remote_media, self.image_refusal)
        return self._image_prompts

    def _add(self, key: Any, prompt: Any, params: SamplingParams, lora: LoRARequest | None = None) -> None:
        index = self._next_seq
        self._next_seq += 1
        if lora is not None:
            self.check_lora(lora)
        if hasattr(prompt, "mm"):  # a PreparedRow (multimodal_prompts.py): a door prepared its images
            self._rows[index] = _Row(key, prompt.text, prompt.token_ids, params, lora, prompt.mm, prompt.error)
            self._queue.append(index)
            return
        text, token_ids = (prompt, self._tokenize(prompt, index)) if isinstance(prompt, str) else (None, prompt)
        self._rows[index] = _Row(key, text, token_ids, params, lora)
        self._queue.append(index)

    def _tokenize(self, prompt: str, index: int) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt {index} is text, but the engines were built with skip_tokenizer_init=True")
        return self.tokenizer(prompt)["input_ids"]

    def _dispatch(self) -> None:
        live = [r for r in self._replicas if r.alive]
        for replica in live:
            if not self._queue:
                return
            if not replica.hungry:
                continue
            count = min(self.chunk_rows, -(-len(self._queue) // len(live)))
            seqs = [self._queue.popleft() for _ in range(count)]
            rows = [self._rows[s] for s in seqs]
            try:
                replica.tasks.send(Chunk([WorkItem(s, r.token_ids, r.params, r.lora, r.mm, r.error)
                                          for s, r in zip(seqs, rows)]))
            except OSError:  # it died: its sentinel reports that, and these rows go to the others
                self._queue.extendleft(reversed(seqs))
                replica.hungry = False
                continue
            replica.assigned.update(seqs)
            replica.hungry = False

    def _handle_events(self) -> Iterator[tuple[Any, RequestOutput]]:
        for replica, message in replica_events(self._replicas):
            if isinstance(message, Results):
                for seq, output in message.rows:
                    replica.assigned.discard(seq)
                    row = self._rows.pop(seq, None)
                    if row is not None:  # None: a row the caller gave up (an earlier stream ended early)
                        output.prompt, output.prompt_token_ids = row.text, row.token_ids
                        yield row.key, output
            elif isinstance(message, WantWork):
                replica.hungry = True
            elif isinstance(message, Crashed):
                replica.error = message.traceback
            elif message is None:
                self._lost(replica)

    def _lost(self, replica: ReplicaProcess) -> None:
        """A replica exited without being asked to: its unfinished rows go first in line for the others."""
        replica.alive = False
        replica.process.join(ABORT_SECONDS)  # its sentinel fires as it exits, a moment before its status is known
        lost = sorted(s for s in replica.assigned if s in self._rows)
        replica.assigned.clear()
        self._queue.extendleft(reversed(lost))
        failure = ReplicaFailure(replica.index, replica.pid, replica.process.exitcode, len(lost), replica.error)
        self.failures.append(failure)
        warnings.warn(failure.describe(), RuntimeWarning, stacklevel=2)
        if not any(r.alive for r in self._replicas):
            raise ReplicaPoolError(f"all {self.size} data-parallel replicas died; {len(self._rows)} rows are "
                                   f"unfinished:\n" + "\n".join(f.describe() for f in self.failures), self.failures)

    # -- processes -----------------------------------------------------------------------------------------

    def _start(self, index: int, placement: Placement, engine_kwargs: dict[str, Any]) -> ReplicaProcess:
        spec = ReplicaSpec(index, str(self.model_path), engine_kwargs, placement.num_threads,
                           self._given_sizes[0], os.getpid())
        return start_replica(spec, placement)

    def _wait_until_ready(self) -> None:
        lengths, batches = [], []
        while not all(r.ready for r in self._replicas):
            for replica, message in replica_events(self._replicas):
                if isinstance(message, Ready):
                    replica.ready = True
                    lengths.append(message.max_model_len)
                    batches.append(message.max_num_seqs)
                elif isinstance(message, BuildFailed):
                    raise build_error(message)
                elif isinstance(message, WantWork):
                    replica.hungry = True
                elif message is None and not replica.ready:
                    replica.process.join(ABORT_SECONDS)
                    raise ReplicaPoolError(f"data-parallel replica {replica.index} (pid {replica.pid}) exited with "
                                           f"status {replica.process.exitcode} while building its engine", [])
                elif message is None:
                    self._lost(replica)
        self.max_model_len = min(lengths)  # prompts are fitted in the parent: they must fit every replica
        self._size_by(min(batches))
