"""A one-writer, many-reader message queue over shared memory, for the per-step broadcast.

Every engine step, rank 0's scheduler output must reach every tensor-parallel worker, and rank 0's sampled
tokens must come back. Pickling into a pipe per reader would copy the message once per rank through the
kernel; here the writer pickles once into a shared-memory slot and each reader copies it out.

Protocol (one slot, chunked): per reader a pair of semaphores. The writer waits until every reader has
released the slot (`free`), writes a chunk with a small header, and posts `full` to every reader. A
message larger than the slot goes through in several chunks. Semaphores block in the kernel, so idle
workers do not spin (CI runs three ranks on two cores).

Waits never block forever: they wake every `poll_s` to call `check_alive`, which raises when the other
side died. The memory is a file in /dev/shm that the creator unlinks as soon as every process has mapped
it, so nothing is left behind even when a process is killed.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

_HEADER = struct.Struct("<QQ")  # total message bytes, bytes in this chunk
DEFAULT_CAPACITY = 4 << 20


@dataclass
class ShmQueueHandle:
    """What a process needs to attach to the queue; passed to spawned processes as an argument."""

    path: str
    capacity: int
    free: list[Any]  # multiprocessing semaphores, one per reader: the reader is done with the slot
    full: list[Any]  # one per reader: a chunk is waiting for it


def create_shared_file(num_bytes: int, prefix: str = "batchllm-") -> str:
    """A file of `num_bytes` in shared memory (/dev/shm where there is one) that other processes can map; its
    creator deletes it once they have."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        os.ftruncate(fd, num_bytes)
    finally:
        os.close(fd)
    return path


def create_queue(context: BaseContext, num_readers: int, capacity: int = DEFAULT_CAPACITY) -> ShmQueueHandle:
    path = create_shared_file(_HEADER.size + capacity)
    return ShmQueueHandle(path, capacity, [context.Semaphore(1) for _ in range(num_readers)],
                          [context.Semaphore(0) for _ in range(num_readers)])


def unlink_queue(handle: ShmQueueHandle) -> None:
    try:
        os.unlink(handle.path)
    except FileNotFoundError:
        pass


class _Mapped:
    def __init__(self, handle: ShmQueueHandle, check_alive: Callable[[], None], poll_s: float) -> None:
        self.handle = handle
        with open(handle.path, "r+b") as file:
            self.buffer = mmap.mmap(file.fileno(), _HEADER.size + handle.capacity)
        self.check_alive = check_alive
        self.poll_s = poll_s

    def _acquire(self, semaphore: Any) -> None:
        while not semaphore.acquire(timeout=self.poll_s):
            self.check_alive()

    def close(self) -> None:
        self.buffer.close()


class ShmWriter(_Mapped):
    def put(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        capacity, view = self.handle.capacity, memoryview(data)
        offset = 0
        while True:
            chunk = view[offset : offset + capacity]
            for free in self.handle.free:
                self._acquire(free)
            _HEADER.pack_into(self.buffer, 0, len(data), len(chunk))
            self.buffer[_HEADER.size : _HEADER.size + len(chunk)] = chunk
            for full in self.handle.full:
                full.release()
            offset += len(chunk)
            if offset >= len(data):
                return


class ShmReader(_Mapped):
    def __init__(self, handle: ShmQueueHandle, reader: int, check_alive: Callable[[], None], poll_s: float) -> None:
        super().__init__(handle, check_alive, poll_s)
        self.free, self.full = handle.free[reader], handle.full[reader]

    def get(self) -> Any:
        parts: list[bytes] = []
        received, total = 0, None
        while total is None or received < total:
            self._acquire(self.full)
            total, size = _HEADER.unpack_from(self.buffer, 0)
            parts.append(self.buffer[_HEADER.size : _HEADER.size + size])
            self.free.release()
            received += size
        return pickle.loads(b"".join(parts) if len(parts) > 1 else parts[0])
