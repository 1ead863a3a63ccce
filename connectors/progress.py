"""A rows progress bar that also shows output tokens/s; tqdm supplies rows/s and the ETA."""

from __future__ import annotations

import time


class RowProgress:
    """Counts finished rows (failed ones included). `done` rows are already finished at start (a resumed job):
    they show in the count, and tqdm's rate and ETA are measured from this run's start only."""

    _REFRESH_SECONDS = 0.5

    def __init__(self, total: int, enabled: bool, done: int = 0, desc: str = "generating") -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=done, desc=desc, unit="row", dynamic_ncols=True, smoothing=0.1)
        self._start = self._last_refresh = time.perf_counter()
        self.output_tokens = 0

    def update(self, rows: int, output_tokens: int = 0) -> None:
        self.output_tokens += output_tokens
        if self._bar is None:
            return
        self._bar.update(rows)
        now = time.perf_counter()
        if now - self._last_refresh >= self._REFRESH_SECONDS:
            self._last_refresh = now
            self._bar.set_postfix_str(f"{self.output_tokens / (now - self._start):.1f} tok/s", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
