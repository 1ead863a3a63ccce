"""The Batch API's worker: one background thread runs the batches one at a time, through the resumable JSONL job.

A batch's job writes `batches/<id>/output.jsonl` with its manifest and lock beside it (`run_jsonl_job`): every
request line gets exactly one answer line, and running the job again resumes it, so a batch that a restart
finds unfinished simply runs its job again. The job's engine is the server's (`EngineHandle.batch_engine`), whose
rows are admitted behind live traffic. On a server of several models each line runs on the model its `body.model`
names, one job per model (`batch_groups.py`).

- validating: the input must hold at least one request, and no valid request may name the other endpoint
  (a batch has one endpoint) or a model the server does not serve; otherwise the batch fails with OpenAI's
  `errors` list. Lines the job cannot
  serve (invalid JSON, an unknown url, a refused field) are not refused here: they become error lines.
- in_progress: the job runs; `request_counts` come live from its manifest (`JobProgress`).
- finalizing: the answer lines are split into the output file (the answered ones) and the error file (the
  others), each registered only when it has lines, with ids derived from the batch, so a repeat rewrites them.
- cancel: the engine stops admitting the batch's rows and lets those out finish; the job saves them and returns,
  and the batch is finalized as `cancelled` with what was done.
- shutdown (`close`): rows out are aborted, not saved (an aborted row has no real answer), finished rows are
  saved, and the batch keeps its status: the next server resumes it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from batchllm.connectors.jobs.jsonl_batch import run_jsonl_job
from batchllm.connectors.jobs.openai_batch import parse_envelope
from batchllm.entrypoints.server.batch_groups import BatchGroup, Route, group_outputs, plan_groups
from batchllm.entrypoints.server.batches import UNFINISHED, BatchRecord, BatchStore, RequestCounts
from batchllm.entrypoints.server.errors import APIError
from batchllm.entrypoints.server.files import OUTPUT_PURPOSE, FileStore, derived_id
from batchllm.entrypoints.server.request_stream import EngineDead, ServerShuttingDown
from batchllm.entrypoints.server.served_models import ServedModels

logger = logging.getLogger(__name__)
_MAX_REPORTED_ERRORS = 10  # validation errors listed in a failed batch's `errors`


@dataclass(frozen=True, slots=True)
class BatchSettings:
    rows_per_shard: int = 1000  # for new batches: each batch keeps the value it started with (its manifest pins it)
    flush_seconds: float = 5.0  # how often unfinished shards' answers are saved: progress steps, what a kill loses
    max_in_flight: int | None = None  # a batch's rows out at once; None: the engine's max_num_seqs
    max_upload_bytes: int = 512 * 1024 * 1024


class BatchRunner:
    def __init__(self, store: BatchStore, files: FileStore, models: ServedModels, settings: BatchSettings) -> None:
        self.store, self.files, self.settings = store, files, settings
        self._models = models
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        self._current: tuple[str, threading.Event] | None = None
        self._current_engines: list[Any] = []
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="batchllm-batches", daemon=True)

    def start(self) -> None:
        """Queue the batches an earlier server left unfinished, oldest first, and start the worker."""
        for record in reversed(self.store.list()):
            if record.status in UNFINISHED:
                self.submit(record.id)
        self._thread.start()

    def submit(self, batch_id: str) -> None:
        self._queue.put(batch_id)

    def cancel(self, batch_id: str) -> None:
        """The batch was marked cancelling: stop its job if it is running (a queued one sees its status)."""
        with self._lock:
            if self._current is not None and self._current[0] == batch_id:
                self._current[1].set()

    def progress(self, record: BatchRecord) -> RequestCounts:
        """The batch's counts now: for a running batch, its job's manifest says how many rows are saved."""
        if record.status not in UNFINISHED:
            return record.request_counts
        counts = [saved_rows(output.with_name("output.jsonl.manifest.jsonl"))
                  for output in group_outputs(self.store.job_dir(record.id))]
        return RequestCounts(record.request_counts.total, sum(c[0] for c in counts), sum(c[1] for c in counts))

    def close(self, timeout: float = 60.0) -> None:
        """Stop the worker; the running batch saves its finished rows and is left for the next server."""
        with self._lock:
            self._closing = True
            if self._current is not None:
                for engine in self._current_engines:
                    engine.abort_on_stop = True  # rows out would end as "abort", no real answer
                self._current[1].set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _work(self) -> None:
        while (batch_id := self._queue.get()) is not None:
            stop = threading.Event()
            with self._lock:
                if self._closing:
                    return
                self._current = (batch_id, stop)  # before reading the status: a cancel from now on reaches `stop`
            try:
                self._process(batch_id, stop)
            except (EngineDead, ServerShuttingDown) as exc:
                logger.warning("batch %s stopped (%s); it resumes when the server restarts", batch_id, exc)
            except Exception as exc:  # a broken batch must not stop the worker
                if not self._closing:
                    logger.exception("batch %s failed", batch_id)
                    self.store.update(batch_id, status="failed", errors=_errors([_error("batch_failed", str(exc))]))
            finally:
                with self._lock:
                    self._current, self._current_engines = None, []

    def _process(self, batch_id: str, stop: threading.Event) -> None:
        record = self.store.get(batch_id)
        if record is None or record.status not in UNFINISHED:
            return
        if record.status == "validating":
            total, errors = validate_input(self.files.content_path(record.input_file_id), record.endpoint,
                                           self._route)
            if errors:
                self.store.update(batch_id, only_from=("validating",), status="failed", errors=_errors(errors),
                                  request_counts=RequestCounts(total))
                return
            record = self.store.update(batch_id, only_from=("validating",), status="in_progress",
                                       request_counts=RequestCounts(total)) or self.store.get(batch_id)
        if record.status == "cancelling":
            stop.set()  # the jobs only verify and keep what earlier runs saved
        job_dir = self.store.job_dir(batch_id)
        if record.status != "cancelling" or any(output.exists() for output in group_outputs(job_dir)):
            groups = plan_groups(self.files.content_path(record.input_file_id), job_dir, self._route,
                                 self._models.default.name, self._unknown_to_job)
            complete = _run_all([lambda group=group: self._run_group(group, record, stop) for group in groups])
            if self._closing and not complete:
                return
        self._finalize(batch_id)

    def _route(self, model: str | None) -> str | None:
        try:
            return self._models.route(model)[0].name
        except APIError:
            return None

    def _unknown_to_job(self, served_name: str, model: str) -> bool:
        """Whether a job on that model refuses a line naming `model` (it knows its directory's name and adapters)."""
        served = self._models.route(served_name)[0]
        return bool(served.adapters) and model != served.engine.llm.model_path.name and model not in served.adapters

    def _run_group(self, group: BatchGroup, record: BatchRecord, stop: threading.Event) -> bool:
        """Run (or resume) one model's job; True once every line of it is answered."""
        served = self._models.route(group.model)[0]
        with self._lock:
            engine = served.engine.batch_engine(stop_event=stop)
            engine.abort_on_stop = self._closing
            self._current_engines.append(engine)
        settings = self.settings
        max_in_flight = settings.max_in_flight or engine.max_num_seqs
        loras = {name: str(lora.lora_path) for name, lora in served.adapters.items()}
        result = run_jsonl_job(group.input, group.output, llm=engine, use_tqdm=False,
                               rows_per_shard=record.rows_per_shard, flush_seconds=settings.flush_seconds,
                               max_in_flight=max_in_flight, loras=loras or None,
                               max_tokens=None)  # as OpenAI: a request without max_tokens may use the context
        return result.complete

    def _finalize(self, batch_id: str) -> None:
        record = self.store.update(batch_id, only_from=("in_progress",), status="finalizing") \
            or self.store.get(batch_id)
        outputs = group_outputs(self.store.job_dir(batch_id))
        completed, failed, output_id, error_id = split_answers(outputs, self.files, batch_id)
        final = "cancelled" if record.status == "cancelling" else "completed"
        self.store.update(batch_id, status=final, output_file_id=output_id, error_file_id=error_id,
                          request_counts=RequestCounts(record.request_counts.total, completed, failed))

def _run_all(jobs: list[Callable[[], bool]]) -> bool:
    """Run the jobs at once (each on its own model's engine); True if every one completed. The first exception is
    raised once all have ended."""
    if len(jobs) == 1:
        return jobs[0]()
    with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="batchllm-batch") as pool:
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures)
    return all([future.result() for future in futures])


def validate_input(path: Path, endpoint: str, route: Route | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(number of request lines, the errors that fail the batch) of the input file at `path`; `route` names the
    served model of a line's `body.model` (None: not served)."""
    if not path.is_file():
        return 0, [_error("file_not_found", "the input file no longer exists")]
    total, errors = 0, []
    with open(path, "rb") as file:
        for number, data in enumerate(file, start=1):
            if not data.strip():
                continue  # blank lines are no requests, as in the job
            total += 1
            try:
                text = data.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                continue  # the job answers it with an error line
            envelope = parse_envelope(text)
            if envelope.error is not None or len(errors) >= _MAX_REPORTED_ERRORS:
                continue
            if envelope.url != endpoint:
                errors.append(_error("mismatched_endpoint", f"the request's url {envelope.url} is not the batch's "
                                     f"endpoint {endpoint}", param="url", line=number))
            model = envelope.body.get("model")
            if route is not None and isinstance(model, str) and route(model) is None:
                errors.append(_error("model_not_found", f"the model {model!r} is not served here",
                                     param="body.model", line=number))
    if total == 0:
        errors.append(_error("empty_file", "the input file holds no requests"))
    return total, errors


def split_answers(outputs: list[Path], files: FileStore, batch_id: str) -> tuple[int, int, str | None, str | None]:
    """Register the jobs' answer lines as the batch's output file (answered) and error file (failed):
    (completed, failed, output file id, error file id); a file id is None when it would have no lines."""
    counts = [0, 0]  # answered, failed

    def lines_where(answered: bool) -> Callable[[BinaryIO], None]:
        def write(target: BinaryIO) -> None:
            for output in outputs:
                if not output.exists():
                    continue
                with open(output, "rb") as source:
                    for line in source:
                        if (json.loads(line)["error"] is None) == answered:
                            target.write(line)
                            counts[not answered] += 1
        return write

    ids = []
    for answered, kind in ((True, "output"), (False, "errors")):
        file_id = derived_id(batch_id, kind)
        record = files.write(file_id, f"{batch_id}_{kind}.jsonl", OUTPUT_PURPOSE, lines_where(answered))
        if record.bytes == 0:
            files.delete(file_id)
        ids.append(file_id if record.bytes else None)
    return counts[0], counts[1], ids[0], ids[1]


def saved_rows(manifest: Path) -> tuple[int, int]:
    """(answered, failed) rows a job's manifest records as saved; (0, 0) before it exists. Cheap: one small line
    per saved region. A torn last line (a write in progress) is skipped."""
    try:
        lines = manifest.read_bytes().splitlines()[1:]
    except FileNotFoundError:
        return 0, 0
    answered = failed = 0
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        answered += record["rows"] - record["error_rows"]
        failed += record["error_rows"]
    return answered, failed


def _error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _errors(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data}
