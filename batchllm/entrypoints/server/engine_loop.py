"""An engine in this process: a thread that owns `llm.engine` and steps it (`EngineLoop(llm)`), or the thread that
calls `run()` (`EngineLoop(llm, start=False)`). `batchllm serve` runs each engine in a process of its own instead
(`engine_process.py`); this one serves tests and programs that embed a server beside an LLM they hold.

Requests are admitted between steps as they arrive (`engine_driver.py`), so requests that come at different times
share the engine's batches (continuous batching). The loop sleeps on a condition while there is nothing to do. An
exception from the engine fails every request in flight with `EngineDead` and stops the loop (health checks then
report it); an exception while admitting one request (e.g. an adapter on an engine without LoRA) fails that
request alone.

On the CPU the thread matters: once the main thread has used torch's OpenMP pool, the same ops ran ~10x slower in a
second thread (an elementwise op: 112 vs 11 us, libgomp, 2 cores), and an engine stepping there lost most of its
speed (64 rows: 6.1-8.7 s vs 1.5 s). An engine process steps in its own main thread for that reason.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from typing import Any, Callable

from batchllm.entrypoints.server.admitted import LoopObserver
from batchllm.entrypoints.server.engine_driver import EngineDriver
from batchllm.entrypoints.server.engine_handle import EngineHandle
from batchllm.entrypoints.server.engine_protocol import BATCH, LIVE, Stop
from batchllm.entrypoints.server.request_stream import EngineDead, ServerShuttingDown
from batchllm.host_gc import objects_frozen

__all__ = ["BATCH", "LIVE", "EngineLoop"]
logger = logging.getLogger(__name__)


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.future = fn, concurrent.futures.Future()


class EngineLoop(EngineHandle):
    def __init__(self, llm: Any, *, observer: LoopObserver | None = None,
                 batch_waiting_limit: int | None = None, start: bool = True) -> None:
        """`start`: run the loop in a new thread now; False: the caller runs it (`run()`)."""
        self._driver = EngineDriver(llm, batch_waiting_limit)
        self._cond = threading.Condition()
        self._inbox: deque[Any] = deque()
        self._ended = threading.Event()  # set when run() returns; until then the loop counts as running
        super().__init__(llm, observer)
        if start:
            threading.Thread(target=self.run, name="batchllm-engine-loop", daemon=True).start()

    @property
    def batch_waiting_limit(self) -> int:
        return self._driver.batch_waiting_limit

    @property
    def healthy(self) -> bool:
        return super().healthy and not self._ended.is_set()

    def run_on_engine_thread(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps (for anything that touches the engine)."""
        call = _Call(fn)
        with self._cond:
            if self._dead is not None or self._ended.is_set():
                raise EngineDead("the engine loop is not running")
            self._inbox.append(call)
            self._cond.notify()
        return call.future

    def _num_blocks(self) -> int:
        return self.llm.engine.scheduler.kv_cache.pool.num_blocks

    def _send(self, message: Any) -> None:
        with self._cond:
            self._inbox.append(message)
            self._cond.notify()

    def stop(self) -> None:
        self._send(Stop())
        self._ended.wait(timeout=60.0)

    # -- the engine thread -------------------------------------------------------------------------------------
    def run(self) -> None:
        """The loop itself, in the calling thread, until the engine is stopped (or fails)."""
        try:
            with objects_frozen():  # the model and everything loaded stay out of the collector's scans
                self._run()
        except BaseException as exc:  # the engine's state is unknown: fail everyone rather than hang them
            logger.exception("the engine loop failed; every request in flight fails")
            self._on_death(exc)
            self._fail_calls(EngineDead(f"the engine failed: {exc!r}"))
        finally:
            self._ended.set()

    def _run(self) -> None:
        driver = self._driver
        while True:
            with self._cond:
                while not (self._inbox or driver.has_work):
                    self._cond.wait()
                messages = list(self._inbox)
                self._inbox.clear()
            for message in messages:
                if isinstance(message, Stop):
                    driver.abort_all()
                    self._on_results(driver.take_results())
                    self._on_stopped()
                    self._fail_calls(ServerShuttingDown("the engine loop stopped"))
                    return
                if isinstance(message, _Call):
                    if message.future.set_running_or_notify_cancel():
                        try:
                            message.future.set_result(message.fn())
                        except BaseException as exc:  # the caller's problem, not the loop's
                            message.future.set_exception(exc)
                else:
                    driver.take(message)
            if driver.admit():  # before the step: a long one shows in the metrics while it runs
                self._on_results(driver.take_results())
            driver.step()
            self._on_results(driver.take_results())

    def _fail_calls(self, error: BaseException) -> None:
        with self._cond:
            calls = [m for m in self._inbox if isinstance(m, _Call)]
            self._inbox.clear()
        for call in calls:
            call.future.set_exception(error)
