"""A rows progress bar that also shows output tokens/s (this run's tokens over this run's time, final at
close); tqdm supplies rows/s and the ETA."""

from __future__ import annotations

import time
from typing import Any, Callable

PreemptionFigures = Callable[[], tuple[int, int]]


def preemption_figures(llm: Any) -> PreemptionFigures | None:
    """A reader of (preemptions, recomputed prompt tokens) so far in the call `llm` runs, for an engine in this
    process (an `LLM`); None for replica pools and routers, whose engines count in their own processes."""
    scheduler = getattr(getattr(llm, "engine", None), "scheduler", None)
    if scheduler is None:
        return None
    return lambda: (scheduler.stats.num_preemptions, scheduler.stats.num_recomputed_tokens)


class RowProgress:
    """Counts finished rows (failed ones included). `done` rows are already finished at start (a resumed job):
    they show in the count, and tqdm's rate and ETA are measured from this run's start only. With `preemptions`,
    the engine's preemptions and the prompt tokens they made it recompute show once there are any."""

    _REFRESH_SECONDS = 0.5

    def __init__(self, total: int, enabled: bool, done: int = 0, desc: str = "generating",
                 preemptions: PreemptionFigures | None = None) -> None:
        self._preemptions = preemptions
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
            self._show_rate(now)

    def close(self) -> None:
        if self._bar is not None:
            # Updates refresh the rate at most every _REFRESH_SECONDS, so the last one shown may be stale:
            # the bar left on screen shows the whole run's rate.
            self._show_rate(time.perf_counter())
            self._bar.close()

    def _show_rate(self, now: float) -> None:
        elapsed = now - self._start
        rate = self.output_tokens / elapsed if elapsed > 0 else 0.0
        text = f"{rate:.1f} tok/s"
        preempted, recomputed = (0, 0) if self._preemptions is None else self._preemptions()
        if preempted:
            text += f", {preempted} preempted ({recomputed} prompt tok recomputed)"
        self._bar.set_postfix_str(text, refresh=False)
