"""A child process and its parent, talking through two one-way pipes: the parent's end (`spawn_child`) and the
child's (`Inbox`, `Outbox`). Used by the data-parallel replicas and by the server's engine processes.

The child reads its task pipe on a thread and writes its result pipe on another, so the parent's sends never wait
on a busy engine, the engine never waits on a busy parent, and the two can never both block writing to each other.
A child whose parent is gone (its task pipe reaches EOF, or a write fails) exits at once.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

EXIT_PARENT_GONE = 3
PARENT_CHECK_SECONDS = 1.0  # a blocking `Inbox.get` returns None this often, so the child can look at its parent
_START_LOCK = threading.Lock()  # children take their environment from os.environ, which is process-wide


def spawn_child(target: Callable[..., None], args: tuple, name: str, env: dict[str, str]
                ) -> tuple[BaseProcess, Connection, Connection]:
    """Start `target(*args, tasks, results)` in a process from the `spawn` context, with `env` in its environment
    from its first instruction (so before it can import torch). Returns (process, the task pipe's writing end, the
    result pipe's reading end)."""
    context = multiprocessing.get_context("spawn")
    task_reader, task_writer = context.Pipe(duplex=False)
    result_reader, result_writer = context.Pipe(duplex=False)
    # Not daemonic: a child may start tensor-parallel workers of its own, which daemons cannot.
    process = context.Process(target=target, args=(*args, task_reader, result_writer), name=name, daemon=False)
    with _START_LOCK, environment(env):
        process.start()
    # Only the child holds these ends now: its exit shows as EOF here, ours as EOF there.
    task_reader.close()
    result_writer.close()
    return process, task_writer, result_reader


@contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """`overrides` in os.environ while a child starts: a spawned process copies the environment at start."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Inbox:
    """Reads the task pipe on a thread until the message of type `last` (after which the parent sends nothing).
    EOF before it means the parent is gone: exit."""

    def __init__(self, tasks: Connection, last: type, name: str = "inbox") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last = last
        threading.Thread(target=self._read, args=(tasks,), name=name, daemon=True).start()

    def _read(self, tasks: Connection) -> None:
        while True:
            try:
                message = tasks.recv()
            except (EOFError, OSError):
                os._exit(EXIT_PARENT_GONE)
            self._queue.put(message)
            if isinstance(message, self._last):
                return

    def get(self, block: bool) -> Any | None:
        """The next message; None when there is none (`block`: after waiting PARENT_CHECK_SECONDS)."""
        try:
            return self._queue.get(block=block, timeout=PARENT_CHECK_SECONDS if block else None)
        except queue.Empty:
            return None


class Outbox:
    """Sends on a thread, so the engine never waits for a parent that is busy (writing a shard, tokenizing)."""

    _CLOSE = object()

    def __init__(self, results: Connection, name: str = "outbox") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, args=(results,), name=name, daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Return once everything sent so far is written."""
        self._queue.put(self._CLOSE)
        self._thread.join()

    def exit(self, status: int) -> NoReturn:
        self.close()
        sys.exit(status)

    def _write(self, results: Connection) -> None:
        while (message := self._queue.get()) is not self._CLOSE:
            try:
                results.send(message)
            except OSError:  # the parent is gone
                os._exit(EXIT_PARENT_GONE)


def picklable_error(exc: BaseException) -> BaseException | None:
    """`exc` if it survives a trip through the pipe to the parent (an exception holding a lock or a socket does
    not), else None: the parent then reports the traceback text alone."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return None
    return exc
