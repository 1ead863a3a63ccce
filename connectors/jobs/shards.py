"""Shard bookkeeping for jobs: input row `g` belongs to shard `g // rows_per_shard`, always.

Shards are fixed by the input order alone, so a resumed job cuts the same shards as the run it resumes.
The tracker holds the input rows of every open shard until the shard's last row has a result, then hands
the shard to `write` and forgets it. Shards finish, and are written, in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from batchllm.connectors.results import RowOutcome

WriteShard = Callable[[int, pa.Table, list[RowOutcome]], None]


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
    pieces: list[pa.RecordBatch] = field(default_factory=list)
    outcomes: list[RowOutcome | None] = field(default_factory=list)
    num_read: int = 0
    num_done: int = 0


class ShardTracker:
    """Invariants: `buffered_rows` is the number of input rows held (read, shard not yet written);
    `pending_rows` the number of those still waiting for a result."""

    def __init__(self, total_rows: int, rows_per_shard: int, write: WriteShard) -> None:
        self.total_rows = total_rows
        self.rows_per_shard = rows_per_shard
        self._write = write
        self._open: dict[int, _OpenShard] = {}
        self.buffered_rows = 0
        self.pending_rows = 0

    def add(self, shard: int, piece: pa.RecordBatch) -> int:
        """Hold the next rows of `shard` (they arrive in input order); returns the first one's offset in it."""
        state = self._open.get(shard)
        if state is None:
            first = shard * self.rows_per_shard
            state = self._open[shard] = _OpenShard(min(self.rows_per_shard, self.total_rows - first))
        offset = state.num_read
        state.pieces.append(piece)
        state.outcomes.extend([None] * piece.num_rows)
        state.num_read += piece.num_rows
        if state.num_read > state.num_rows:
            raise RuntimeError(f"shard {shard} got {state.num_read} rows, expected {state.num_rows}: the input "
                               f"changed while the job was reading it")
        self.buffered_rows += piece.num_rows
        self.pending_rows += piece.num_rows
        return offset

    def finish(self, shard: int, row: int, outcome: RowOutcome) -> None:
        """Record one row's result; writes the shard when it was its last."""
        state = self._open[shard]
        state.outcomes[row] = outcome
        state.num_done += 1
        self.pending_rows -= 1
        if state.num_done == state.num_rows:
            self._write(shard, pa.Table.from_batches(state.pieces), state.outcomes)
            del self._open[shard]
            self.buffered_rows -= state.num_rows
