"""The runner's shared block-table array: rows are reused, grow past the initial size and keep their contents."""

from __future__ import annotations

import numpy as np

from batchllm.executor.block_table import BlockTables


def test_rows_grow_reset_and_are_reused():
    tables = BlockTables(max_blocks_per_seq=4, initial_rows=2)
    a, b = tables.add(), tables.add()
    tables.extend(a, [7, 8], reset=True)
    tables.extend(b, [1], reset=True)
    c = tables.add()  # past the initial two rows: the array doubles, contents kept
    tables.extend(c, [5, 6, 9], reset=True)
    tables.extend(a, [3], reset=False)
    assert len({a, b, c}) == 3 and len(tables.table) == 4
    gathered = np.take(tables.table, [c, a, b], axis=0)
    assert gathered[0, :3].tolist() == [5, 6, 9]
    assert gathered[1, :3].tolist() == [7, 8, 3]
    assert gathered[2, :1].tolist() == [1]
    tables.extend(a, [2], reset=True)  # a full table again (preemption, copy-on-write)
    assert tables.table[a, :1].tolist() == [2] and tables.num_blocks[a] == 1
    tables.remove(b)
    assert tables.add() == b and tables.num_blocks[b] == 0


def test_grouped_rows_take_interleaved_ids_per_group():
    # Two KV groups (a hybrid KV cache): ids arrive interleaved, block j of group g at j * 2 + g.
    tables = BlockTables(max_blocks_per_seq=3, initial_rows=1, num_groups=2)
    row = tables.add()
    tables.extend(row, [10, 20, 11, 21], reset=True)
    tables.extend(row, [12, 22], reset=False)
    assert tables.table[row].reshape(2, 3).tolist() == [[10, 11, 12], [20, 21, 22]]
    assert tables.num_blocks[row] == 3
