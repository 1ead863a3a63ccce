"""Every live request's block table in one host array, a row per request.

A step's block tables are then one vectorized gather of its requests' rows (`np.take`), instead of a Python
loop copying each request's table; only the blocks a step appends are written, where they change. Rows are
reused as requests come and go; the array doubles when more requests are live than it has rows.

With a hybrid KV cache (engine/kv_groups.py) a row holds each group's table in turn (`[G, max_blocks_per_seq]`),
and the engine sends a request's block ids interleaved: logical block j of group g at entry `j * G + g`.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, initial_rows: int, num_groups: int = 1) -> None:
        self.num_groups, self.max_blocks_per_seq = num_groups, max_blocks_per_seq
        self.table = np.zeros((initial_rows, num_groups * max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self._free = list(range(initial_rows - 1, -1, -1))

    def add(self) -> int:
        """A row for a new request (its table empty)."""
        if not self._free:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.num_blocks[row] = 0
        return row

    def remove(self, row: int) -> None:
        self._free.append(row)

    def extend(self, row: int, block_ids: list[int], reset: bool) -> None:
        """Append `block_ids` to the row's table (`reset`: they are its whole table)."""
        start = 0 if reset else int(self.num_blocks[row])
        if self.num_groups == 1:
            end = start + len(block_ids)
            self.table[row, start:end] = block_ids
        else:
            end = start + len(block_ids) // self.num_groups
            groups = self.table[row].reshape(self.num_groups, self.max_blocks_per_seq)
            groups[:, start:end] = np.asarray(block_ids, dtype=np.int32).reshape(-1, self.num_groups).T
        self.num_blocks[row] = end
