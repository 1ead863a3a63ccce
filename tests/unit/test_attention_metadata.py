"""The one attention metadata builder, for the runner's steps (through `InputBatch.prepare`, padded or not) and
for the drafters' passes, against slots, row starts and lengths worked out by hand."""

from __future__ import annotations

import numpy as np
import torch

from batchllm.executor.input_batch import InputBatch

BLOCK_SIZE = 4
# BlockTables rows: row 0 holds blocks 7, 2, 5 and row 1 blocks 3, 9, 0.
TABLES = np.array([[7, 2, 5], [3, 9, 0]], dtype=np.int32)


def _inputs() -> InputBatch:
    return InputBatch(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=3, block_size=BLOCK_SIZE,
                      device=torch.device("cpu"))


def _fields(metadata) -> tuple:
    return (metadata.slot_mapping.tolist(), metadata.query_start_loc.tolist(), metadata.seq_lens.tolist(),
            metadata.block_tables.tolist(), metadata.max_query_len, metadata.max_seq_len,
            metadata.query_start_loc_cpu, metadata.seq_lens_cpu)


def test_a_step_of_a_prefill_chunk_and_a_decode_row() -> None:
    inputs = _inputs()
    # Table row 1 computes positions 2..4, table row 0 its position 8.
    input_ids, positions, metadata, logits = inputs.prepare(
        [11, 12, 13, 14], np.array([3, 1]), np.array([2, 8]), TABLES, np.array([1, 0]), np.array([0, 1]))
    assert positions.tolist() == [2, 3, 4, 8]
    # Position p of a row is slot table[p // 4] * 4 + p % 4: 3*4+2, 3*4+3, 9*4+0; 5*4+0.
    assert _fields(metadata) == ([14, 15, 36, 20], [0, 3, 4], [5, 9], [[3, 9, 0], [7, 2, 5]], 3, 9,
                                 [0, 3, 4], [5, 9])
    assert (metadata.slot_mapping.dtype, metadata.query_start_loc.dtype, metadata.seq_lens.dtype,
            metadata.block_tables.dtype) == (torch.int64, torch.int32, torch.int32, torch.int32)
    assert input_ids.tolist() == [11, 12, 13, 14] and logits.tolist() == [2, 3]


def test_a_mixed_step_counts_its_leading_decode_rows() -> None:
    """`num_decodes`: the decode rows before the first longer query, which the Triton backend launches apart."""
    inputs = _inputs()
    tables = np.array([[7, 2, 5], [3, 9, 0], [1, 4, 6], [8, 10, 11]], dtype=np.int32)
    for num_scheduled, expected in (([1, 1, 3, 1], 2), ([3, 1, 1, 1], 0), ([1, 1, 1, 1], 0), ([2, 2, 2, 2], 0)):
        *_, metadata, _ = inputs.prepare(list(range(sum(num_scheduled))), np.array(num_scheduled),
                                         np.array([2, 2, 2, 2]), tables, np.arange(4), np.arange(4))
        assert metadata.num_decodes == expected, num_scheduled


def test_a_decode_step_padded_to_a_graph_size() -> None:
    inputs = _inputs()
    _, positions, metadata, _ = inputs.prepare(
        [21, 22], np.array([1, 1]), np.array([4, 0]), TABLES, np.array([1, 0]), np.array([0, 1]), pad_to=4)
    # Two padding rows of one token each: no K/V write (slot -1), one key of block 0.
    assert positions.tolist() == [4, 0, 0, 0]
    assert _fields(metadata) == ([36, 28, -1, -1], [0, 1, 2, 3, 4], [5, 1, 1, 1],
                                 [[3, 9, 0], [7, 2, 5], [0, 0, 0], [0, 0, 0]], 1, 5, [0, 1, 2, 3, 4], [5, 1, 1, 1])


def test_graph_capture_inputs_are_all_padding() -> None:
    inputs = _inputs()
    input_ids, positions, metadata = inputs.graph_inputs(batch_size=2, max_seq_len=12, query_len=2)
    assert input_ids.tolist() == [0, 0, 0, 0] and positions.tolist() == [0, 1, 0, 1]
    assert _fields(metadata)[:2] + _fields(metadata)[4:] == ([-1, -1, -1, -1], [0, 2, 4], 2, 12, [0, 2, 4], [2, 2])


def test_drafter_rows_get_their_own_tensors() -> None:
    inputs = _inputs()
    builder = inputs.attention
    # Table row 1 drafts at positions 6 and 7 (8 tokens of context), table row 0 at position 3.
    metadata = builder.for_rows(np.array([6, 7, 3]), np.array([2, 1]), np.array([8, 4]), TABLES[[1, 0]])
    assert _fields(metadata) == ([38, 39, 31], [0, 2, 3], [8, 4], [[3, 9, 0], [7, 2, 5]], 2, 8, [0, 2, 3], [8, 4])
    decode = builder.for_decode_rows(np.array([4, 0]), TABLES[[1, 0]])
    assert _fields(decode) == ([36, 28], [0, 1, 2], [5, 1], [[3, 9, 0], [7, 2, 5]], 1, 5, [0, 1, 2], [5, 1])
    assert not inputs.arena.holds(metadata.slot_mapping) and not inputs.arena.holds(decode.block_tables)


def test_a_padded_step_is_staged_where_its_graph_reads() -> None:
    inputs = _inputs()
    captured = inputs.graph_inputs(batch_size=4, max_seq_len=12)
    # Two decode rows whose tokens the last step sampled (rows 1 and 0 of its samples), padded to 4 rows.
    input_ids, positions, metadata, logits = inputs.prepare(
        [0, 0], np.array([1, 1]), np.array([4, 0]), TABLES, np.array([1, 0]), np.array([0, 1]), pad_to=4,
        placeholders=([0, 1], [1, 0]))
    inputs.fill_placeholders(torch.tensor([31, 32]))
    stepped = (input_ids, positions, metadata.slot_mapping, metadata.query_start_loc, metadata.seq_lens,
               metadata.block_tables)
    graph_read = captured[:2] + (captured[2].slot_mapping, captured[2].query_start_loc, captured[2].seq_lens,
                                 captured[2].block_tables)
    for step_array, graph_array in zip(stepped, graph_read, strict=True):
        assert (step_array.data_ptr(), step_array.shape) == (graph_array.data_ptr(), graph_array.shape)
    assert captured[0].tolist() == [32, 31, 0, 0] and captured[1].tolist() == [4, 0, 0, 0]
    assert captured[2].seq_lens.tolist() == [5, 1, 1, 1] and logits.tolist() == [0, 1]
    assert inputs.replay_layout(4) is inputs.replay_layout(4)  # a repeated shape reuses its views


def test_steps_staged_in_host_blocks_taking_turns_equal_one_block() -> None:
    """CUDA's arena stages steps in host blocks taking turns: each step's device arrays are the same as staged in
    one block (here on the CPU, with three blocks in front of a device block of their own)."""
    steps = [([11, 12, 13, 14], [3, 1], [2, 8]), ([21, 22], [1, 1], [5, 9]), ([31], [1], [6]),
             ([41, 42, 43], [2, 1], [0, 10]), ([51, 52], [1, 1], [7, 11])]
    one, turns = _inputs(), InputBatch(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=3,
                                       block_size=BLOCK_SIZE, device=torch.device("cpu"), host_buffers=3)
    assert turns.arena.num_buffers == 3 and one.arena.num_buffers == 1
    for token_ids, num_scheduled, num_computed in steps:
        rows = np.arange(len(num_scheduled)) % 2
        args = (token_ids, np.array(num_scheduled), np.array(num_computed), TABLES, rows,
                np.arange(len(num_scheduled)))
        (ids_a, pos_a, meta_a, logits_a), (ids_b, pos_b, meta_b, logits_b) = one.prepare(*args), turns.prepare(*args)
        assert (ids_a.tolist(), pos_a.tolist(), logits_a.tolist()) == (ids_b.tolist(), pos_b.tolist(),
                                                                      logits_b.tolist())
        assert _fields(meta_a) == _fields(meta_b)
    assert {layout.buffer for layout in turns._layouts.values()} == {0, 1, 2}
