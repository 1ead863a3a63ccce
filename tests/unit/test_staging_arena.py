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


def test_host_blocks_take_turns_in_front_of_one_device_block() -> None:
    """With several host blocks (CUDA's arena; on the CPU only when asked for), each layout fills its own block, the
    device views are the same whatever the block, and an upload copies the layout's block alone."""
    specs = (ArraySpec("ids", torch.int64, (4,)),)
    arena = StagingArena(arena_bytes(list(specs)), torch.device("cpu"), num_buffers=2)
    first, second = arena.layout(specs, 0), arena.layout(specs, 1)
    assert first.device["ids"].data_ptr() == second.device["ids"].data_ptr()
    assert not any(arena.holds(torch.from_numpy(layout.host["ids"])) for layout in (first, second))
    first.host["ids"][:] = [1, 2, 3, 4]
    second.host["ids"][:] = [5, 6, 7, 8]
    assert first.device["ids"].tolist() == [0, 0, 0, 0]  # nothing reaches the device before an upload
    arena.upload(second)
    assert first.device["ids"].tolist() == [5, 6, 7, 8] and first.host["ids"].tolist() == [1, 2, 3, 4]
    arena.upload(first)
    assert second.device["ids"].tolist() == [1, 2, 3, 4]
