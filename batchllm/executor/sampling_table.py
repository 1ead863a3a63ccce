"""Every live request's sampling parameters in host columns, at the request's row of `BlockTables`.

Written once when a request joins the runner (or rejoins after preemption); a step gathers its sampled rows
with one `take` per column, so building its sampling tensors costs vectorized work over the batch plus Python
only for the rows that need per-row state (seeds, penalties, min_tokens, logprobs).
"""

from __future__ import annotations

import numpy as np

from batchllm.model.layers.sampling_tensors import SamplingColumns, keeps_token_history
from batchllm.sampling_params import SamplingParams


class SamplingTable:
    def __init__(self, initial_rows: int) -> None:
        self.columns = SamplingColumns.empty(initial_rows)
        self.row_state = np.zeros(initial_rows, dtype=bool)  # SamplingParams.needs_row_state
        self.history = np.zeros(initial_rows, dtype=bool)  # keeps_token_history

    def set(self, row: int, params: SamplingParams) -> None:
        if row >= len(self.row_state):
            self._grow(max(row + 1, 2 * len(self.row_state)))
        self.columns.set(row, params)
        self.row_state[row] = params.needs_row_state
        self.history[row] = keeps_token_history(params)

    def gather(self, rows: np.ndarray) -> tuple[SamplingColumns, np.ndarray, bool]:
        """The columns of `rows` (in that order), the positions among them that need per-row state, and
        whether any of them reads its token history."""
        return self.columns.take(rows), np.flatnonzero(self.row_state.take(rows)), bool(self.history.take(rows).any())

    def _grow(self, num_rows: int) -> None:
        old = len(self.row_state)
        grown = SamplingColumns.empty(num_rows)
        for name in SamplingColumns.__slots__:
            getattr(grown, name)[:old] = getattr(self.columns, name)
        self.columns = grown
        self.row_state = np.concatenate([self.row_state, np.zeros(num_rows - old, dtype=bool)])
        self.history = np.concatenate([self.history, np.zeros(num_rows - old, dtype=bool)])
