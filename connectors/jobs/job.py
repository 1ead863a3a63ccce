"""The resumable, sharded job loop shared by the Parquet and the OpenAI-batch jobs.

Input rows stream from a `Source` in fixed shards (`shards.py`); a `Planner` turns each batch into
per-row requests or errors; requests go to the engine through `LLM.stream`, which admits new rows
before every engine step, so the engine stays full across shard (and file) boundaries. A shard is handed
to the `Sink` the moment its last row is done, and then recorded in the manifest (`manifest.py`).

Memory stays bounded whatever the input size: before reading the next batch, the loop waits (without
starving the engine) while `max_buffered_rows` input rows are held, so at most
`max_buffered_rows + batch_size` rows are ever held; `JobResult.peak_buffered_rows` reports the peak.
With data parallelism the loop feeds a `ReplicaPool` the same way; its rows out at once (queued in this
process or held by replicas) count as in flight, so the same bound holds.

SIGINT / SIGTERM: the first one stops admitting rows; rows already in the engine finish, every shard they
complete is written, and `JobInterrupted` is raised (the CLI exits with 128 + the signal number). The
handlers are restored at once, so a second signal acts as usual: SIGINT raises KeyboardInterrupt,
SIGTERM terminates. Written shards are safe either way; re-running the same job resumes.
"""

from __future__ import annotations

import hashlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from batchllm.connectors.jobs.manifest import Manifest, ShardRecord
from batchllm.connectors.jobs.shards import ShardTracker, shard_pieces
from batchllm.connectors.progress import RowProgress
from batchllm.connectors.prompts import EncodedPrompt
from batchllm.connectors.replicas.errors import ReplicaFailure, ReplicaPoolError
from batchllm.connectors.replicas.pool import ReplicaPool
from batchllm.connectors.results import RowOutcome
from batchllm.llm import LLM
from batchllm.sampling_params import SamplingParams

DEFAULT_ROWS_PER_SHARD = 5000  # a few MB of Parquet per shard for typical prompts; little work lost on a kill
MAX_BATCH_ROWS = 1024


@dataclass(slots=True)
class RowRequest:
    prompt: EncodedPrompt
    params: SamplingParams


class Source(Protocol):
    total_rows: int

    def fingerprint(self) -> dict[str, Any]: ...

    def batches(self, batch_size: int, skip: Callable[[int, int], bool]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(index of the first row, batch) in input order; a row range [a, b) with skip(a, b) may be left out."""
        ...


class Sink(Protocol):
    def write(self, shard: int, rows: pa.Table, outcomes: list[RowOutcome]) -> ShardRecord: ...


Planner = Callable[[pa.RecordBatch], list[RowRequest]]
# What travels with a request through `LLM.stream`: its shard, its row in the shard and its sampling params.
RowKey = tuple[int, int, SamplingParams]


@dataclass(frozen=True, slots=True)
class JobSettings:
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    max_in_flight: int | None = None  # prompts in the engine at once; None: twice the engine's max_num_seqs
    max_buffered_rows: int | None = None  # None: max_in_flight + 2 * rows_per_shard
    use_tqdm: bool = True

    def __post_init__(self) -> None:
        for name in ("rows_per_shard", "max_in_flight", "max_buffered_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(slots=True)
class JobResult:
    output: Path
    total_rows: int
    num_shards: int
    resumed_rows: int  # rows already done by earlier runs
    written_rows: int  # rows written by this run
    error_rows: int  # rows with an error among those written by this run
    output_tokens: int
    seconds: float
    peak_buffered_rows: int
    # Data-parallel replicas that died during this run; their unfinished rows were re-run by the others.
    replica_failures: list[ReplicaFailure] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.resumed_rows + self.written_rows == self.total_rows


class JobInterrupted(RuntimeError):
    """The job stopped on SIGINT / SIGTERM after flushing every completed shard; run it again to resume."""

    def __init__(self, signal_number: int, result: JobResult) -> None:
        done = result.resumed_rows + result.written_rows
        super().__init__(f"interrupted by {signal.Signals(signal_number).name}: {done} of {result.total_rows} rows are "
                         f"saved in {result.output}; run the same job again to resume")
        self.signal_number = signal_number
        self.result = result


def run_sharded_job(source: Source, planner: Planner, sink: Sink, manifest: Manifest, llm: LLM | ReplicaPool,
                    settings: JobSettings, output: Path) -> JobResult:
    """Run the job on `llm`, or on a `ReplicaPool`: then `settings.max_in_flight` already applies to each of its
    engines, and the rows out at once are the pool's default, enough to keep every replica full."""
    rows_per_shard = settings.rows_per_shard
    if isinstance(llm, ReplicaPool):
        max_in_flight = llm.default_max_in_flight
    else:
        max_in_flight = settings.max_in_flight or 2 * llm.engine.scheduler.config.max_num_seqs
    max_buffered = settings.max_buffered_rows or max_in_flight + 2 * rows_per_shard
    batch_size = min(rows_per_shard, MAX_BATCH_ROWS)
    total = source.total_rows
    done_shards = set(manifest.shards)
    result = JobResult(output, total, -(-total // rows_per_shard), sum(r.rows for r in manifest.shards.values()),
                       0, 0, 0, 0.0, 0)

    def write(shard: int, rows: pa.Table, outcomes: list[RowOutcome]) -> None:
        record = sink.write(shard, rows, outcomes)
        manifest.record(record)
        result.written_rows += record.rows
        result.error_rows += record.error_rows

    tracker = ShardTracker(total, rows_per_shard, write)
    progress = RowProgress(total, settings.use_tqdm, done=result.resumed_rows)

    def finish(shard: int, row: int, outcome: RowOutcome) -> None:
        result.output_tokens += outcome.completion_tokens
        progress.update(1, outcome.completion_tokens)
        tracker.finish(shard, row, outcome)

    def skip(first: int, end: int) -> bool:
        return all(s in done_shards for s in range(first // rows_per_shard, (end - 1) // rows_per_shard + 1))

    def feed(stop: StopOnSignal) -> Iterator[tuple[RowKey, list[int], SamplingParams] | None]:
        for start, batch in source.batches(batch_size, skip):
            result.peak_buffered_rows = max(result.peak_buffered_rows, tracker.buffered_rows + batch.num_rows)
            for shard, piece in shard_pieces(start, batch, rows_per_shard):
                if shard in done_shards:
                    continue
                offset = tracker.add(shard, piece)
                for row, request in enumerate(planner(piece), start=offset):
                    if stop.signal_number is not None:
                        return
                    if request.prompt.error is not None:
                        finish(shard, row, RowOutcome(None, request.prompt.error, request.prompt.num_tokens))
                    else:
                        yield (shard, row, request.params), request.prompt.token_ids, request.params
            # Rows wait here, not in memory: pause admission (the engine keeps stepping) while too many are held.
            # With nothing pending, the held rows are the current shard's: reading on is the only way forward.
            while tracker.buffered_rows >= max_buffered and tracker.pending_rows > 0:
                if stop.signal_number is not None:
                    return
                yield None

    start_time = time.perf_counter()
    try:
        with StopOnSignal() as stop:
            for (shard, row, params), output in llm.stream(feed(stop), max_in_flight=max_in_flight):
                finish(shard, row, RowOutcome.from_output(output, params))
    except ReplicaPoolError as exc:
        done = result.resumed_rows + result.written_rows
        raise ReplicaPoolError(f"{exc}\n{done} of {total} rows are saved in {result.output}; run the same job again "
                               f"to resume", exc.failures) from exc
    finally:
        progress.close()
        result.seconds = time.perf_counter() - start_time
        result.replica_failures = list(getattr(llm, "failures", []))
    if stop.signal_number is not None:
        raise JobInterrupted(stop.signal_number, result)
    return result


class StopOnSignal:
    """Within the block, the first SIGINT / SIGTERM is recorded in `signal_number` instead of acting, and the
    previous handlers come back at once. Outside the main thread signals cannot be caught: it does nothing."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _handle(self, signal_number: int, frame: object) -> None:
        self.signal_number = signal_number
        self._restore()
        print(f"\n{signal.Signals(signal_number).name}: no new rows are admitted; finishing the rows in flight and "
              f"saving completed shards (signal again to stop at once)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def model_identity(model_path: Path) -> dict[str, Any]:
    """Identifies a model by content, not location: a moved model directory still resumes its jobs."""
    config = model_path / "config.json"
    return {"name": model_path.name,
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
            "weights_bytes": sum(f.stat().st_size for f in model_path.glob("*.safetensors"))}
