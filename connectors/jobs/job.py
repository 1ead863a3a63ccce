"""The resumable, sharded job loop shared by the Parquet and the OpenAI-batch jobs.

Input rows stream from a `Source` in fixed shards (`shards.py`); a `Planner` turns each batch into
per-row requests or errors; requests go to the engine through `LLM.stream`, which admits new rows
before every engine step, so the engine stays full across shard (and file) boundaries. A shard is handed
to the `Sink` the moment its last row is done; the sink makes it durable, then records it in the
manifest (`manifest.py`).

Durability: every `flush_seconds` (default 60) a background thread also hands the sink the finished rows
of every unfinished shard, as a checkpoint, so one slow row cannot hold a shard's other results hostage
and a kill -9 loses at most the last `flush_seconds` of finished rows. A resumed job re-runs none of the
rows recorded in the manifest: the sink's `ResumeState` says which shards are done and which rows of the
others are saved. The sink verifies what earlier runs wrote (sizes and hashes), so a damaged file or
region is redone rather than trusted. `retry_errors=True` makes rows saved with an error count as not
done: they are re-run and their results replace the old ones, every row staying exactly once.

Output length: no row generates more than `max_tokens_cap` tokens (default 4096), whatever its request
asks; `max_tokens=None` (up to the model's length) means the cap when the prompt leaves more room.

Memory stays bounded whatever the input size: before reading the next batch, the loop waits (without
starving the engine) while `max_buffered_rows` input rows are held, so at most
`max_buffered_rows + batch_size` rows are ever held; `JobResult.peak_buffered_rows` reports the peak.
With data parallelism the loop feeds a `ReplicaPool` the same way; its rows out at once (queued in this
process or held by replicas) count as in flight, so the same bound holds.

SIGINT / SIGTERM (`signals.py`): the first one stops the job at the next engine step (with data-parallel
replicas, at the next report of one): no more rows are admitted, the rows in the engine are aborted (they run
again on resume), every shard completed before is written, the finished rows of the others are checkpointed,
and `JobInterrupted` is raised (the CLI exits with 128 + the signal number), unless every row was done by then.
A second signal acts as usual: SIGINT raises KeyboardInterrupt, SIGTERM terminates. What was saved is safe
either way; re-running the same job resumes.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from batchllm.connectors.jobs.model_router import ModelRouter
from batchllm.connectors.jobs.shards import ShardTracker, shard_pieces
from batchllm.connectors.jobs.signals import StopOnSignal
from batchllm.connectors.progress import RowProgress, preemption_figures
from batchllm.connectors.prompts import EncodedPrompt
from batchllm.connectors.replicas.errors import ReplicaFailure, ReplicaPoolError
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.connectors.results import RowOutcome
from batchllm.entrypoints.llm import LLM
from batchllm.entrypoints.tokenize_ahead import can_tokenize_aside, tokenized_ahead
from batchllm.lora.request import LoRARequest
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams

DEFAULT_ROWS_PER_SHARD = 5000  # a few MB of Parquet per shard for typical prompts; little work lost on a kill
DEFAULT_MAX_TOKENS_CAP = 4096  # output tokens per row: long answers fit, a runaway row stops within minutes
DEFAULT_FLUSH_SECONDS = 60.0
MAX_BATCH_ROWS = 1024


@dataclass(slots=True)
class RowRequest:
    prompt: EncodedPrompt
    params: SamplingParams | PoolingParams  # PoolingParams: a pooling task's row (an embedding)
    lora: LoRARequest | None = None  # None: the base model
    model: str | None = None  # the model the row runs on, of a job of several (`model_router.py`); None: the one


class Source(Protocol):
    total_rows: int

    def fingerprint(self) -> dict[str, Any]: ...

    def batches(self, batch_size: int, skip: Callable[[int, int], bool]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(index of the first row, batch) in input order; a row range [a, b) with skip(a, b) may be left out."""
        ...


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What earlier runs saved, as the sink verified it."""

    done_shards: frozenset[int]
    saved_rows: dict[int, frozenset[int]]  # unfinished shards: offsets whose saved result is kept, not re-run
    resumed_rows: int  # rows not to run again, in all


class Sink(Protocol):
    path: Path  # the output
    resume: ResumeState

    def write(self, shard: int, rows: pa.Table, outcomes: list[RowOutcome], offsets: list[int],
              complete: bool) -> None:
        """Make the rows at `offsets` of `shard` durable and record them in the manifest; `complete`: the shard
        is finished (its other rows were saved before)."""
        ...


Planner = Callable[[pa.RecordBatch], list[RowRequest]]
# What travels with a request through `LLM.stream`: its shard, its row in the shard and its sampling params.
RowKey = tuple[int, int, SamplingParams]


@dataclass(frozen=True, slots=True)
class JobSettings:
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    max_in_flight: int | None = None  # prompts in the engine at once; None: twice the engine's max_num_seqs
    max_buffered_rows: int | None = None  # None: max_in_flight + 2 * rows_per_shard
    use_tqdm: bool = True
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    flush_seconds: float = DEFAULT_FLUSH_SECONDS
    retry_errors: bool = False

    def __post_init__(self) -> None:
        for name in ("rows_per_shard", "max_in_flight", "max_buffered_rows", "max_tokens_cap"):
            value = getattr(self, name)
            if (value is not None or name == "max_tokens_cap") and not _is_positive_int(value):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.flush_seconds, bool) or not isinstance(self.flush_seconds, (int, float)) \
                or not 0 < self.flush_seconds < float("inf"):
            raise ValueError(f"flush_seconds must be a number > 0, got {self.flush_seconds!r}")


@dataclass(slots=True)
class JobResult:
    output: Path
    total_rows: int
    num_shards: int
    resumed_rows: int  # rows already done by earlier runs (and kept)
    written_rows: int  # rows saved by this run
    error_rows: int  # rows with an error among those saved by this run
    output_tokens: int
    seconds: float
    peak_buffered_rows: int
    # Data-parallel replicas that died during this run; their unfinished rows were re-run by the others.
    replica_failures: list[ReplicaFailure] = field(default_factory=list)
    # The engine's preemptions and the prompt tokens they made it compute again (an engine in this process only).
    preemptions: int = 0
    recomputed_tokens: int = 0

    @property
    def complete(self) -> bool:
        return self.resumed_rows + self.written_rows == self.total_rows


class JobInterrupted(RuntimeError):
    """The job stopped on SIGINT / SIGTERM after saving every finished row; run it again to resume."""

    def __init__(self, signal_number: int, result: JobResult) -> None:
        done = result.resumed_rows + result.written_rows
        super().__init__(f"interrupted by {signal.Signals(signal_number).name}: {done} of {result.total_rows} rows are "
                         f"saved in {result.output}; run the same job again to resume")
        self.signal_number = signal_number
        self.result = result


def cap_max_tokens(params: SamplingParams, cap: int, room: int | None = None) -> SamplingParams:
    """`params` generating at most `cap` tokens: a larger max_tokens comes down to the cap, and None (up to the
    model's length) becomes the cap when the prompt leaves more `room` than that (room unknown: kept)."""
    limit = params.max_tokens if params.max_tokens is not None else room
    return params if limit is None or limit <= cap else dataclasses.replace(params, max_tokens=cap)


def run_sharded_job(source: Source, planner: Planner, sink: Sink, llm: LLM | ReplicaPool | ModelRouter,
                    settings: JobSettings) -> JobResult:
    """Run the job on `llm`, on a `ReplicaPool` (then `settings.max_in_flight` already applies to each of its
    engines, and the rows out at once are the pool's default, enough to keep every replica full) or on a
    `ModelRouter` (several models: each row runs on the engine its `RowRequest.model` names)."""
    rows_per_shard = settings.rows_per_shard
    if isinstance(llm, (ReplicaPool, ModelRouter)):
        max_in_flight = llm.default_max_in_flight
    else:
        max_in_flight = settings.max_in_flight or 2 * llm.max_num_seqs
    max_buffered = settings.max_buffered_rows or max_in_flight + 2 * rows_per_shard
    batch_size = min(rows_per_shard, MAX_BATCH_ROWS)
    total, resume = source.total_rows, sink.resume
    result = JobResult(sink.path, total, -(-total // rows_per_shard), resume.resumed_rows, 0, 0, 0, 0.0, 0)

    def save(shard: int, rows: pa.Table, outcomes: list[RowOutcome], offsets: list[int], complete: bool) -> None:
        sink.write(shard, rows, outcomes, offsets, complete)
        result.written_rows += len(outcomes)
        result.error_rows += sum(o.error is not None for o in outcomes)

    tracker = ShardTracker(total, rows_per_shard, save, resume.saved_rows)
    preemptions = preemption_figures(llm)
    progress = RowProgress(total, settings.use_tqdm, done=result.resumed_rows, preemptions=preemptions)

    def finish(shard: int, row: int, outcome: RowOutcome) -> None:
        result.output_tokens += outcome.completion_tokens
        progress.update(1, outcome.completion_tokens)
        tracker.finish(shard, row, outcome)

    def skip(first: int, end: int) -> bool:
        return all(s in resume.done_shards for s in range(first // rows_per_shard, (end - 1) // rows_per_shard + 1))

    # The planner tokenizes on a worker thread while the engine detokenizes: every model's tokenizer must allow it.
    aside = all(map(can_tokenize_aside, llm.tokenizers if isinstance(llm, ModelRouter) else [llm.tokenizer]))

    def feed(stop: StopOnSignal) -> Iterator[tuple[RowKey, list[int], SamplingParams, LoRARequest | None]
                                             | tuple[RowKey, list[int], SamplingParams, LoRARequest | None, str]
                                             | None]:
        for start, batch in source.batches(batch_size, skip):
            result.peak_buffered_rows = max(result.peak_buffered_rows, tracker.buffered_rows + batch.num_rows)
            for shard, piece in shard_pieces(start, batch, rows_per_shard):
                if shard in resume.done_shards:
                    continue
                first, waiting = tracker.add(shard, piece)
                if not waiting:
                    continue
                if len(waiting) < piece.num_rows:  # plan only the rows that earlier runs did not save
                    piece = piece.take(pa.array([row - first for row in waiting], pa.int64()))
                for item in tokenized_ahead(range(piece.num_rows), functools.partial(_plan_slice, planner, piece),
                                            llm.has_unfinished, aside):
                    if stop.signal_number is not None:
                        return
                    if item is None:  # the next rows are being planned and the engine has work: step on
                        yield None
                        continue
                    row, request = waiting[item[0]], item[1]
                    prompt = request.prompt
                    if prompt.error is not None:
                        finish(shard, row, RowOutcome(None, prompt.error, prompt.num_tokens))
                    else:
                        params = request.params if isinstance(request.params, PoolingParams) else cap_max_tokens(
                            request.params, settings.max_tokens_cap, llm.max_model_len - len(prompt.token_ids))
                        item = ((shard, row, params), prompt.engine_prompt, params, request.lora)
                        yield item if request.model is None else (*item, request.model)
            # Rows wait here, not in memory: pause admission (the engine keeps stepping) while too many are held.
            # With nothing pending, the held rows are the current shard's: reading on is the only way forward.
            while tracker.buffered_rows >= max_buffered and tracker.pending_rows > 0:
                if stop.signal_number is not None:
                    return
                yield None

    start_time = time.perf_counter()
    try:
        with StopOnSignal() as stop, Checkpointer(settings.flush_seconds, tracker.checkpoint) as checkpointer:
            for (shard, row, params), output in llm.stream(feed(stop), max_in_flight=max_in_flight,
                                                           stop=stop.signalled):
                checkpointer.raise_failure()
                finish(shard, row, RowOutcome.from_output(output, params))
        checkpointer.raise_failure()
        tracker.checkpoint()  # after a signal: the finished rows of the shards left unfinished
    except ReplicaPoolError as exc:
        tracker.checkpoint()
        done = result.resumed_rows + result.written_rows
        raise ReplicaPoolError(f"{exc}\n{done} of {total} rows are saved in {result.output}; run the same job again "
                               f"to resume", exc.failures) from exc
    finally:
        progress.close()
        result.seconds = time.perf_counter() - start_time
        result.replica_failures = list(getattr(llm, "failures", []))
        if preemptions is not None:
            result.preemptions, result.recomputed_tokens = preemptions()
    if stop.signal_number is not None and not result.complete:
        raise JobInterrupted(stop.signal_number, result)
    return result


def _plan_slice(planner: Planner, piece: pa.RecordBatch, rows: range) -> list[RowRequest]:
    """The requests of a contiguous run of a piece's rows: the piece is planned in chunks, on a worker thread
    while the engine runs (`entrypoints/tokenize_ahead.py`), so a job's first step waits only for the first chunk."""
    return planner(piece.slice(rows.start, len(rows)))


class Checkpointer:
    """Calls `checkpoint` every `seconds` on a background thread while the block runs. Its first failure
    (say, a full disk) stops it and is raised in the job's thread by `raise_failure`."""

    def __init__(self, seconds: float, checkpoint: Callable[[], None]) -> None:
        self._seconds = seconds
        self._checkpoint = checkpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchllm-checkpoint", daemon=True)
        self._failure: BaseException | None = None

    def __enter__(self) -> Checkpointer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _loop(self) -> None:
        while not self._stop.wait(self._seconds):
            try:
                self._checkpoint()
            except BaseException as exc:  # handed to the job's thread, which decides
                self._failure = exc
                return


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
