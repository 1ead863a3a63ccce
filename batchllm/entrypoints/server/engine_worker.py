"""An engine process of the server: it builds one `LLM` and steps it in its main thread (on the CPU torch's OpenMP
pool is fast only there: `engine_loop.py` says why), taking the HTTP process's messages between steps
(`engine_driver.py`) and sending each step's results back. Started by `EngineProcess` from the `spawn` context.

It ignores SIGINT: Ctrl-C reaches the whole process group, and the HTTP process decides (it drains, then stops the
engine). SIGTERM keeps its default action, so `terminate()` ends a step that overruns the drain deadline. It exits
by itself when the HTTP process is gone: its task pipe reaches EOF, or its parent process id changes.
"""

from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from batchllm.connectors.replicas.channel import EXIT_PARENT_GONE, Inbox, Outbox, picklable_error
from batchllm.entrypoints.server.engine_driver import EngineDriver
from batchllm.entrypoints.server.engine_protocol import BuildFailed, Crashed, EngineInfo, Ready, Stop
from batchllm.host_gc import objects_frozen


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str  # the served model's name, for the process's name and logs
    model: str
    engine_kwargs: dict[str, Any]
    num_threads: int | None  # torch intra-op threads on a CPU shared with other engines; None: torch's default
    batch_waiting_limit: int | None
    parent_pid: int


def engine_main(spec: EngineSpec, tasks: Connection, results: Connection) -> None:
    """The engine process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = Inbox(tasks, Stop, "engine-inbox")  # from now on, a parent that dies takes this process with it
    outbox = Outbox(results, "engine-outbox")
    try:
        llm = _build(spec)
    except Exception as exc:
        outbox.send(BuildFailed(picklable_error(exc), traceback.format_exc()))
        outbox.exit(1)
    llm.engine.detokenizer.decode_finished = False  # the HTTP process decodes the final texts
    pool = llm.engine.scheduler.kv_cache.pool
    outbox.send(Ready(os.getpid(), EngineInfo(llm.model_path, llm.task, llm.max_model_len,
                                              llm.engine.scheduler.config, pool.num_blocks, llm.pooling_params,
                                              llm.embedding_dim, llm.quantization, llm.kv_cache_dtype,
                                              llm.config.allow_remote_media, llm.image_refusal)))
    try:
        with objects_frozen():  # the model and everything loaded stay out of the collector's scans
            _serve(EngineDriver(llm, spec.batch_waiting_limit), inbox, outbox, spec.parent_pid)
    except Exception:
        outbox.send(Crashed(traceback.format_exc()))
        outbox.exit(1)
    outbox.close()
    llm.shutdown()  # its tensor-parallel workers, if any
    os._exit(0)  # nothing left worth an interpreter teardown (seconds with torch loaded): stop within the deadline


def _build(spec: EngineSpec) -> Any:
    import torch

    from batchllm.entrypoints.llm import LLM

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    return LLM(spec.model, **spec.engine_kwargs)


def _serve(driver: EngineDriver, inbox: Inbox, outbox: Outbox, parent_pid: int) -> None:
    last_snapshot = None
    while True:
        idle = not driver.has_work
        message = inbox.get(block=idle)
        if message is None and idle and os.getppid() != parent_pid:
            os._exit(EXIT_PARENT_GONE)
        while message is not None:
            if isinstance(message, Stop):
                driver.abort_all()
                outbox.send(driver.take_results())
                return
            driver.take(message)
            message = inbox.get(block=False)
        if driver.admit():
            # Before the step: a long one (a big prompt chunk) shows in the metrics while it runs.
            last_snapshot = _send(outbox, driver, last_snapshot)
        driver.step()
        last_snapshot = _send(outbox, driver, last_snapshot)


def _send(outbox: Outbox, driver: EngineDriver, last_snapshot: Any) -> Any:
    results = driver.take_results()
    if results or results.snapshot != last_snapshot:
        outbox.send(results)
    return results.snapshot

