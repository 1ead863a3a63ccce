"""SIGINT / SIGTERM during a job: the first one asks the job to stop (at the next engine step); the second acts as
usual."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class StopOnSignal:
    """Within the block, the first SIGINT / SIGTERM is recorded in `signal_number` instead of acting, and the
    previous handlers come back at once. Outside the main thread signals cannot be caught: it does nothing."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def signalled(self) -> bool:
        return self.signal_number is not None

    def _handle(self, signal_number: int, frame: object) -> None:
        self.signal_number = signal_number
        self._restore()
        print(f"\n{signal.Signals(signal_number).name}: no new rows are admitted; the rows in flight stop after this "
              f"step (they run again on resume) and every finished row is saved (signal again to stop at once)",
              file=sys.stderr, flush=True)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
