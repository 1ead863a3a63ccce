"""The server's engine loop: one background thread owns `llm.engine`; every other thread talks to it through here.

Requests are admitted between steps as they arrive, so HTTP requests that come at different times share the
engine's batches (continuous batching). Live requests (priority `LIVE`) are admitted at once; batch requests
(`BATCH`: the Batch API's rows) only while the scheduler's waiting queue is shorter than `batch_waiting_limit`,
so a big batch never queues ahead of live traffic by more than that. After each step every admitted request's
consumer gets the tokens (and logprobs, and text when streaming) it produced (`request_stream.py`). On an LLM
built with a pooling task (`task="embed"`) submissions carry its `pooling_params` instead: each is one request
whose stream gets one final event, a `PoolingRequestOutput` (`admitted.py`).

The loop runs in a thread of its own (`EngineLoop(llm)`), or in the thread that calls `run()`
(`EngineLoop(llm, start=False)`): `batchllm serve` runs it in the main thread, the one that built the LLM, and
serves HTTP from another. On the CPU that matters: once the main thread has used torch's OpenMP pool, the same
ops ran ~10x slower in a second thread (an elementwise op: 112 vs 11 us, libgomp, 2 cores), and an engine
stepping there lost most of its speed (64 rows: 6.1-8.7 s vs 1.5 s). The host-side tensor ops of a CUDA step
are exposed to it too.

The loop sleeps on a condition while there is nothing to do. An exception from the engine fails every request
in flight with `EngineDead` and stops the loop (health checks then report it); an exception while admitting one
request (e.g. an adapter on an engine without LoRA) fails that request alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from batchllm.host_gc import objects_frozen
from batchllm.llm import LLM
from batchllm.lora.request import LoRARequest
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams
from batchllm.server.admitted import AdmittedRequests, LoopObserver, Submission, aborted_output
from batchllm.server.request_stream import EngineDead, RequestStream, ServerShuttingDown, StreamEvent

logger = logging.getLogger(__name__)
LIVE, BATCH = 0, 1


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's load after the latest step, readable from any thread."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue, or submitted and not yet admitted
    num_used_blocks: int = 0
    num_blocks: int = 1

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


class EngineLoop:
    def __init__(self, llm: LLM, *, observer: LoopObserver | None = None,
                 batch_waiting_limit: int | None = None, start: bool = True) -> None:
        """`start`: run the loop in a new thread now; False: the caller runs it (`run()`)."""
        self.llm = llm
        self._engine = llm.engine
        self._book = AdmittedRequests(llm)  # engine thread only
        self.observer = observer
        max_num_seqs = self._engine.scheduler.config.max_num_seqs
        self.batch_waiting_limit = batch_waiting_limit or max(1, max_num_seqs // 4)
        self._cond = threading.Condition()
        self._live: deque[Submission] = deque()
        self._batch: deque[Submission] = deque()
        self._aborts: list[RequestStream] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._accepting = True
        self._stopping = False
        self._dead: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self.snapshot = EngineSnapshot(num_blocks=self._engine.scheduler.kv_cache.pool.num_blocks)
        self._ended = threading.Event()  # set when run() returns; until then the loop counts as running
        if start:
            threading.Thread(target=self.run, name="batchllm-engine-loop", daemon=True).start()

    # -- any thread ------------------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._accepting and self._dead is None and not self._ended.is_set()

    @property
    def observer(self) -> LoopObserver | None:
        """Per-request measurements; may be set after the loop started (build_app does)."""
        return self._book.observer

    @observer.setter
    def observer(self, observer: LoopObserver | None) -> None:
        self._book.observer = observer

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
               lora_request: LoRARequest | None = None, priority: int = LIVE, *, incremental: bool = True,
               prompt_text: str | None = None, sink: Any = None) -> RequestStream:
        """Queue one prompt (its `params.n` samples) and return its stream. `incremental=False`: only the final
        event (no per-step updates, no streamed text). `PoolingParams` (the LLM's `pooling_params`; ValueError on
        an LLM that generates, as SamplingParams on one that pools): one pooling request, one final event.
        Raises ServerShuttingDown / EngineDead when the loop no longer admits requests."""
        pooling = isinstance(params, PoolingParams)
        if pooling == (self.llm.task == "generate"):
            raise ValueError(f"this engine's task is {self.llm.task!r}: it takes "
                             f"{'SamplingParams' if self.llm.task == 'generate' else 'its PoolingParams'}, "
                             f"not {type(params).__name__}")
        stream = RequestStream(1 if pooling else params.n, len(prompt_token_ids), sink)
        submission = Submission(stream, list(prompt_token_ids), prompt_text, params, lora_request,
                                incremental and not pooling, time.perf_counter())
        with self._cond:
            self._check_admitting()
            (self._live if priority == LIVE else self._batch).append(submission)
            self._idle.clear()
            self._cond.notify()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Cancel a stream's request; its last event (finish_reason "abort") still comes. A no-op once finished."""
        with self._cond:
            if stream.cancelled:
                return
            stream.cancelled = True
            for queue in (self._live, self._batch):
                for submission in queue:
                    if submission.stream is stream:  # never admitted: nothing in the engine to release
                        queue.remove(submission)
                        stream.deliver(StreamEvent(output=aborted_output(submission)))
                        return
            self._aborts.append(stream)
            self._cond.notify()

    def run_on_engine_thread(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps (for anything that touches the engine)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._dead is not None or self._stopping:
                raise EngineDead("the engine loop is not running")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is queued or in the engine; False after `timeout` seconds."""
        return self._idle.wait(timeout)

    def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stop admitting (submits raise ServerShuttingDown), let the requests in flight finish for up to
        `grace_seconds`, abort the rest (their streams end with finish_reason "abort") and stop the thread."""
        with self._cond:
            self._accepting = False
        self._idle.wait(grace_seconds)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._ended.wait(timeout=max(60.0, grace_seconds))

    def batch_engine(self, stop_event: threading.Event | None = None, abort_on_stop: bool = False):
        """An `llm=` for `run_jsonl_job` whose requests run here at BATCH priority (see `batch_engine.py`)."""
        from batchllm.server.batch_engine import BatchEngine

        return BatchEngine(self, stop_event, abort_on_stop)

    def _check_admitting(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"the engine failed: {self._dead!r}")
        if not self._accepting:
            raise ServerShuttingDown("the server is shutting down")

    # -- the engine thread -----------------------------------------------------------------------------------
    def run(self) -> None:
        """The loop itself, in the calling thread, until `shutdown` (or the engine fails)."""
        try:
            self._run()
        finally:
            self._ended.set()

    def _run(self) -> None:
        try:
            with objects_frozen():  # the model and everything loaded stay out of the collector's scans
                while (work := self._next_work()) is not None:
                    calls, aborts, admitted = work
                    for fn, future in calls:
                        if future.set_running_or_notify_cancel():
                            try:
                                future.set_result(fn())
                            except BaseException as exc:  # the caller's problem, not the loop's
                                future.set_exception(exc)
                    for stream in aborts:
                        self._book.abort(stream)
                    for submission in admitted:
                        self._book.admit(submission)
                    if self._engine.has_unfinished():
                        self._book.publish(self._engine.step())
                    self._take_snapshot()
                self._stop()
        except BaseException as exc:  # the engine's state is unknown: fail everyone rather than hang them
            logger.exception("the engine loop failed; every request in flight fails")
            self._die(exc)

    def _next_work(self) -> tuple[list, list[RequestStream], list[Submission]] | None:
        with self._cond:
            while not (self._stopping or self._live or self._batch or self._aborts or self._calls
                       or self._engine.has_unfinished()):
                if not self._book:
                    self._idle.set()
                self._cond.wait()
            if self._stopping:
                return None
            calls, self._calls = self._calls, []
            aborts, self._aborts = self._aborts, []
            admitted = list(self._live)
            self._live.clear()
            live_requests = sum(s.num_requests for s in admitted)
            room = self.batch_waiting_limit - len(self._engine.scheduler.waiting) - live_requests
            while self._batch and room > 0:
                submission = self._batch.popleft()
                admitted.append(submission)
                room -= submission.num_requests
            return calls, aborts, admitted

    def _take_snapshot(self) -> None:
        scheduler = self._engine.scheduler
        pool = scheduler.kv_cache.pool
        self.snapshot = EngineSnapshot(len(scheduler.running), len(scheduler.waiting) + len(self._live)
                                       + len(self._batch), pool.num_used_blocks, pool.num_blocks)

    def _stop(self) -> None:
        """After the grace period: abort what is left, let a step still in flight land, and end."""
        with self._cond:
            queued, calls = [*self._live, *self._batch], self._calls
            self._live.clear()
            self._batch.clear()
            self._calls = []
        for submission in queued:
            submission.stream.deliver(StreamEvent(output=aborted_output(submission)))
        self._book.abort_all()
        for _, future in calls:
            future.set_exception(ServerShuttingDown("the engine loop stopped"))
        while self._engine.has_unfinished():
            self._engine.step()
        self._take_snapshot()
        self._idle.set()

    def _die(self, exc: BaseException) -> None:
        with self._cond:
            self._dead = exc
            queued, calls = [*self._live, *self._batch], self._calls
            self._live.clear()
            self._batch.clear()
            self._calls = []
        error = EngineDead(f"the engine failed: {exc!r}")
        for submission in queued:
            submission.stream.deliver(StreamEvent(error=error))
        self._book.fail_all(error)
        for _, future in calls:
            future.set_exception(error)
        self._idle.set()
