"""The staging arena: a step's arrays back to back at aligned offsets, its layout a function of their sizes."""

from __future__ import annotations

import pytest
import torch

from batchllm.executor.staging_arena import ALIGNMENT, ArraySpec, StagingArena, arena_bytes


def test_arrays_sit_back_to_back_on_aligned_offsets() -> None:
    specs = (ArraySpec("ids", torch.int64, (3,)), ArraySpec("tables", torch.int32, (2, 5)),
             ArraySpec("lens", torch.int32, (2,)))
    arena = StagingArena(arena_bytes(list(specs)), torch.device("cpu"))
    layout = arena.layout(specs)
    base = arena.device.data_ptr()
    # 24 bytes of ids, then 40 of tables, each array from the next boundary on.
    assert [layout.device[name].data_ptr() - base for name in ("ids", "tables", "lens")] == [0, ALIGNMENT,
                                                                                           2 * ALIGNMENT]
    assert layout.nbytes == 3 * ALIGNMENT
    layout.host["tables"][1] = range(5)
    assert layout.device["tables"].tolist() == [[0] * 5, [0, 1, 2, 3, 4]]
    assert layout.device["tables"].dtype == torch.int32 and arena.holds(layout.device["lens"])
    assert arena.layout(specs).device["tables"].data_ptr() == layout.device["tables"].data_ptr()  # sizes decide


def test_a_step_larger_than_the_arena_is_refused() -> None:
    arena = StagingArena(ALIGNMENT, torch.device("cpu"))
    with pytest.raises(ValueError, match="arena holds 256"):
        arena.layout((ArraySpec("ids", torch.int64, (33,)),))
