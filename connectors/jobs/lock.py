"""One job per output at a time: an exclusive `flock` on a lock file beside the manifest.

Two jobs writing one output would do the work twice, write every JSONL answer twice and delete each
other's temporary files. The lock is taken before the output is touched at all (stale temporaries,
manifest) and held until the job ends. It is non-blocking: a second job fails at once with
`OutputInUse`, naming the output and the pid that holds it. The kernel drops a `flock` when its holder
dies, so a lock left by a crash (even `kill -9`) is never stale: the file may remain, unlocked.

On release the file is removed while still locked. A job that opened the file just before (and so locks
a removed file) notices that the path now names another file, or none, and tries again: two holders at
once are impossible.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


class OutputInUse(BlockingIOError):
    """Another job (a live process) is writing this output."""


@contextlib.contextmanager
def output_lock(lock_path: Path, output: Path) -> Iterator[None]:
    """Hold the lock of `output` (the file `lock_path`) for the block; `OutputInUse` if another job holds it."""
    fd = _acquire(lock_path, output)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):  # already gone or unwritable: the lock is released all the same
            lock_path.unlink()
        os.close(fd)  # releases the lock


def _acquire(lock_path: Path, output: Path) -> int:
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputInUse(f"output {output} is in use by another batchllm job (pid {holder}, lock file "
                              f"{lock_path}); wait for it to end, or stop it, before running this one") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same_file = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            return fd
        os.close(fd)  # the holder removed the file between our open and our lock: lock the current one


def _holder(fd: int) -> str:
    """The holder's pid as it wrote it; "unknown" in the moment between its lock and its write."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"
