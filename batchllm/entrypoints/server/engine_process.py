"""`EngineProcess`: the server's client of an engine in a process of its own (vLLM's layout). The HTTP process
tokenizes, routes, detokenizes and streams; the engine process (`engine_worker.py`) only steps, so neither waits on
the other's interpreter. Messages (`engine_protocol.py`) cross two pipes (`connectors/replicas/channel.py`, as for
the data-parallel replicas): submissions and aborts one way, token ids, logprobs and pooled vectors the other, read
here by a thread of their own.

Stopping (`shutdown`, after the drain): `Stop`, which the engine takes at its next step boundary (it aborts what is
left, reports it and exits); a step that runs past `STOP_SECONDS` is ended with SIGTERM, then SIGKILL. An engine
process that exits unasked fails its requests in flight with `EngineDead` (HTTP 5xx), and `healthy` turns False.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from batchllm.connectors.replicas.channel import spawn_child
from batchllm.entrypoints.server.admitted import LoopObserver
from batchllm.entrypoints.server.engine_handle import EngineHandle
from batchllm.entrypoints.server.engine_protocol import BuildFailed, Crashed, Ready, StepResults, Stop
from batchllm.entrypoints.server.engine_worker import EngineSpec, engine_main
from batchllm.entrypoints.server.remote_llm import RemoteLLM

logger = logging.getLogger(__name__)
STOP_SECONDS = 2.0  # after `Stop`: how long a step may take to end before the process is terminated
TERMINATE_SECONDS = 5.0  # after SIGTERM, before SIGKILL


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """One engine process to start: the served model's name, its checkpoint, its LLM arguments, and where it runs
    (`env`: CUDA_VISIBLE_DEVICES for its own GPUs; `num_threads`: its share of the CPU)."""

    name: str
    model: str | Path | None
    engine_kwargs: Mapping[str, Any]
    env: Mapping[str, str] | None = None
    num_threads: int | None = None
    batch_waiting_limit: int | None = None


class EngineProcess(EngineHandle):
    def __init__(self, name: str, process: BaseProcess, tasks: Connection, results: Connection, ready: Ready,
                 llm: RemoteLLM, observer: LoopObserver | None = None) -> None:
        """Made by `launch_engines`."""
        self.name = name
        self.pid = ready.pid
        self._process, self._tasks, self._results = process, tasks, results
        self._stopping = False
        self._crash: str | None = None
        super().__init__(llm, observer)
        self._reader = threading.Thread(target=self._read, name=f"batchllm-engine-{name}", daemon=True)
        self._reader.start()

    def _num_blocks(self) -> int:
        return self.llm.num_blocks

    def _send(self, message: Any) -> None:
        try:
            self._tasks.send(message)
        except OSError:  # the process is gone: the reader reports it
            pass

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._send(Stop())
        self._process.join(STOP_SECONDS)
        if self._process.is_alive():
            logger.warning("engine %s did not stop within %g s (a step ran past the drain deadline); terminating "
                           "its process", self.name, STOP_SECONDS)
            self.kill(gently=True)
        self._reader.join(TERMINATE_SECONDS)
        self._on_stopped()
        self._tasks.close()

    def kill(self, gently: bool = False) -> None:
        """End the process now (SIGKILL; `gently`: SIGTERM first, SIGKILL if it is still there after a while)."""
        self._stopping = True
        if gently:
            self._process.terminate()
            self._process.join(TERMINATE_SECONDS)
        if self._process.is_alive():
            self._process.kill()
        self._process.join(TERMINATE_SECONDS)

    # -- the reader thread -------------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                wait([self._results, self._process.sentinel])
                while self._results.poll():
                    self._take(self._results.recv())
                if not self._process.is_alive():
                    break
        except (EOFError, OSError):
            pass  # the process has exited (every message it sent was read)
        self._process.join(TERMINATE_SECONDS)
        if self._stopping:
            return
        detail = f"\n{self._crash}" if self._crash else ""
        error = RuntimeError(f"the engine process of {self.name} (pid {self.pid}) exited with status "
                             f"{self._process.exitcode}{detail}")
        logger.error("%s; its requests in flight fail", error)
        self._on_death(error)

    def _take(self, message: Any) -> None:
        if isinstance(message, StepResults):
            self._on_results(message)
        elif isinstance(message, Crashed):
            self._crash = message.traceback


def launch_engines(launches: list[EngineLaunch], observer: LoopObserver | None = None) -> list[EngineProcess]:
    """Start one engine process per launch (they build in parallel) and return their clients once all are ready.
    An engine that fails to build raises its own exception here (its traceback attached as a note), after every
    process started is stopped."""
    from batchllm.model.loader import resolve_model_path

    started: list[tuple[EngineLaunch, Path, BaseProcess, Connection, Connection]] = []
    engines: list[EngineProcess] = []
    try:
        for launch in launches:
            path = resolve_model_path(launch.model)  # converts the default model once, here
            spec = EngineSpec(launch.name, str(path), dict(launch.engine_kwargs), launch.num_threads,
                              launch.batch_waiting_limit, os.getpid())
            process, tasks, results = spawn_child(engine_main, (spec,), f"batchllm-engine-{launch.name}",
                                                  dict(launch.env or {}))
            started.append((launch, path, process, tasks, results))
        for launch, path, process, tasks, results in started:
            tokenizer, adapters = _http_side_of(path, launch.engine_kwargs)
            ready = _wait_ready(launch.name, process, results)
            engines.append(EngineProcess(launch.name, process, tasks, results, ready,
                                         RemoteLLM(ready.info, tokenizer, adapters,
                                                   launch.engine_kwargs.get("reasoning_parser")), observer))
    except BaseException:
        for _, _, process, _, _ in started:
            if process.is_alive():
                process.kill()
            process.join(TERMINATE_SECONDS)
        raise
    return engines


def _http_side_of(model_path: Path, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    """The tokenizer and adapter registry the HTTP process keeps for a model, built as `LLM` builds its own."""
    from batchllm.engine_config import DEFAULTS
    from batchllm.lora.registry import AdapterRegistry
    from batchllm.model.config import ModelConfig, read_hf_config
    from batchllm.tokenizer import load_tokenizer

    tokenizer = None
    if not kwargs.get("skip_tokenizer_init", False):
        tokenizer = load_tokenizer(kwargs.get("tokenizer") or model_path,
                                   trust_remote_code=kwargs.get("trust_remote_code", False))
    adapters = AdapterRegistry(ModelConfig.from_hf_dict(read_hf_config(model_path)),
                               kwargs.get("max_lora_rank", DEFAULTS["max_lora_rank"]),
                               kwargs.get("enable_lora", DEFAULTS["enable_lora"]))
    return tokenizer, adapters


def _wait_ready(name: str, process: BaseProcess, results: Connection) -> Ready:
    while True:
        wait([results, process.sentinel])
        if results.poll():
            try:
                message = results.recv()
            except (EOFError, OSError):
                message = None
            if isinstance(message, Ready):
                return message
            if isinstance(message, BuildFailed):
                process.join(TERMINATE_SECONDS)
                if message.error is not None:
                    message.error.add_note(f"(in the engine process of {name}) {message.traceback}")
                    raise message.error
                raise RuntimeError(f"the engine of {name} failed to build:\n{message.traceback}")
            if message is not None:
                continue
        process.join(TERMINATE_SECONDS)
        raise RuntimeError(f"the engine process of {name} (pid {process.pid}) exited with status "
                           f"{process.exitcode} while building its engine")
