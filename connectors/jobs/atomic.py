"""Crash-safe file writes: a reader sees the old state or the new one, never a torn file."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

TMP_PREFIX = "."
TMP_MARKER = ".tmp-"


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same directory, fsync it, rename it over `path`, fsync the
    directory (so the rename itself survives a power loss). On failure the temporary file is removed if it
    can be, and the original error propagates: a second one from the cleanup (say on a read-only file
    system) would only hide it."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}{TMP_MARKER}{os.getpid()}")
    try:
        with naming_path(path), open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        with naming_path(directory):
            os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def naming_path(path: Path) -> Iterator[None]:
    """An OSError of the block that names no file (a write, flush or fsync failing: ENOSPC, EDQUOT, EIO) is given
    `path`, so that its message says where, as a failed open's does."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:  # not one of ours, whose message names the path itself
            exc.filename = str(path)
        raise


def is_temporary(path: Path) -> bool:
    return path.name.startswith(TMP_PREFIX) and TMP_MARKER in path.name


def remove_stale_temporaries(directory: Path) -> None:
    """Temporary files left by a killed writer; they are never part of the output."""
    for path in directory.glob(f"{TMP_PREFIX}*{TMP_MARKER}*"):
        path.unlink(missing_ok=True)
