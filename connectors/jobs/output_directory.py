"""The directories a job creates for its output, removed again when the job is refused before writing anything:
a bad model path, dtype or option must not leave an empty output directory behind."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def created_for_the_job(directory: Path) -> Iterator[Path]:
    """Create `directory` and its missing parents for the block. If the block raises, the ones created here are
    removed again, deepest first, while they are empty: one holding anything (a manifest, a shard, another job's
    lock) stays, and so do the ones above it."""
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield directory
    except BaseException:
        for path in missing:
            try:
                path.rmdir()
            except OSError:  # not empty, or already gone: leave it, and its parents, alone
                break
        raise
