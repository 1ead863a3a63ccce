"""Shard bookkeeping for jobs: input row `g` belongs to shard `g // rows_per_shard`, always.

Shards are fixed by the input order alone, so a resumed job cuts the same shards as the run it resumes.
The tracker holds the input rows of every open shard until each row has a result, then hands the shard's
unsaved results to `save` (complete=True) and forgets it. Shards finish, and are saved, in any order.
In between, `checkpoint()` hands over the finished rows of every open shard (complete=False), so a shard
with one slow row does not hold the others' results in memory only.

Rows that an earlier run saved (`saved`: offsets within a shard) are held like the others, for the sink
to merge, but never wait for a result: `add` leaves them out of the rows it returns to run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from batchllm.connectors.results import RowOutcome

# (shard, the rows' input, their outcomes, their offsets in the shard ascending, whether the shard is complete)
SaveRows = Callable[[int, pa.Table, list[RowOutcome], list[int], bool], None]


def shard_pieces(start: int, batch: pa.RecordBatch, rows_per_shard: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Cut a batch whose first row is input row `start` at shard boundaries: (shard index, slice)."""
    offset = 0
    while offset < batch.num_rows:
        row = start + offset
        shard = row // rows_per_shard
        length = min(batch.num_rows - offset, (shard + 1) * rows_per_shard - row)
        yield shard, batch.slice(offset, length)
        offset += length


@dataclass(slots=True)
class _OpenShard:
    num_rows: int  # rows the shard has in the input
    saved: frozenset[int]  # offsets saved by earlier runs
    pieces: list[pa.RecordBatch] = field(default_factory=list)
    outcomes: list[RowOutcome | None] = field(default_factory=list)  # set while a row is finished, unsaved
    unsaved: list[int] = field(default_factory=list)  # offsets of the finished rows not yet saved
    num_read: int = 0
    num_waiting: int = 0  # rows read and still waiting for a result


class ShardTracker:
    """Invariants: `buffered_rows` is the number of input rows held (read, shard not yet complete);
    `pending_rows` the number of those waiting for a result (neither finished nor saved by an earlier run).
    A held row is waiting, finished (outcome held until saved) or saved; a shard is complete, saved and
    forgotten as soon as all its rows are read and none waits.

    Thread-safe: `checkpoint()` may run on another thread while the job loop adds and finishes rows; `save`
    is called under the tracker's lock, so saves of one job never overlap.
    """

    def __init__(self, total_rows: int, rows_per_shard: int, save: SaveRows,
                 saved: Mapping[int, frozenset[int]] | None = None) -> None:
        self.total_rows = total_rows
        self.rows_per_shard = rows_per_shard
        self._save = save
        self._saved = saved or {}
        self._open: dict[int, _OpenShard] = {}
        self._lock = threading.RLock()
        self.buffered_rows = 0
        self.pending_rows = 0

    def add(self, shard: int, piece: pa.RecordBatch) -> tuple[int, list[int]]:
        """Hold the next rows of `shard` (they arrive in input order). Returns the first one's offset in the
        shard and the offsets of those to run (the others were saved by an earlier run)."""
        with self._lock:
            state = self._open.get(shard)
            if state is None:
                first = shard * self.rows_per_shard
                state = self._open[shard] = _OpenShard(min(self.rows_per_shard, self.total_rows - first),
                                                       self._saved.get(shard, frozenset()))
            offset = state.num_read
            waiting = [row for row in range(offset, offset + piece.num_rows) if row not in state.saved]
            state.pieces.append(piece)
            state.outcomes.extend([None] * piece.num_rows)
            state.num_read += piece.num_rows
            if state.num_read > state.num_rows:
                raise RuntimeError(f"shard {shard} got {state.num_read} rows, expected {state.num_rows}: the input "
                                   f"changed while the job was reading it")
            state.num_waiting += len(waiting)
            self.buffered_rows += piece.num_rows
            self.pending_rows += len(waiting)
            self._complete_if_done(shard, state)  # the last rows may all have been saved already
            return offset, waiting

    def finish(self, shard: int, row: int, outcome: RowOutcome) -> None:
        """Record one row's result; saves the shard when it was the last one waiting."""
        with self._lock:
            state = self._open[shard]
            state.outcomes[row] = outcome
            state.unsaved.append(row)
            state.num_waiting -= 1
            self.pending_rows -= 1
            self._complete_if_done(shard, state)

    def checkpoint(self) -> None:
        """Save the finished, unsaved rows of every open shard (complete=False) and drop their outcomes."""
        with self._lock:
            for shard, state in self._open.items():
                if state.unsaved:
                    self._save_unsaved(shard, state, complete=False)

    def _complete_if_done(self, shard: int, state: _OpenShard) -> None:
        if state.num_read == state.num_rows and state.num_waiting == 0:
            self._save_unsaved(shard, state, complete=True)
            del self._open[shard]
            self.buffered_rows -= state.num_rows

    def _save_unsaved(self, shard: int, state: _OpenShard, complete: bool) -> None:
        offsets = sorted(state.unsaved)
        rows = pa.Table.from_batches(state.pieces)
        if len(offsets) < state.num_rows:
            rows = rows.take(pa.array(offsets, pa.int64()))
        self._save(shard, rows, [state.outcomes[row] for row in offsets], offsets, complete)
        for row in offsets:
            state.outcomes[row] = None
        state.unsaved = []
