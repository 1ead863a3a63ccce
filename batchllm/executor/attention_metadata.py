"""The attention metadata of every forward pass the executor runs, made in one place.

Three kinds of pass need it: the runner's steps, CUDA-graph capture, and the drafters' own passes (a draft
model's or EAGLE head's). All are rows of query tokens that end each row's context: row i's `query_lens[i]`
tokens sit at positions `seq_lens[i] - query_lens[i]` .. `seq_lens[i] - 1` and write their K/V into their
row's block-table slots there (see `AttentionMetadata`). The runner's steps and graph capture go through
persistent staged buffers: a CUDA graph reads them at fixed addresses, and their uploads from pinned memory
queue behind the device's work. A drafter's passes get fresh tensors each: several are queued per step, and
the staged host buffers may not be refilled until the step's copies have read them.

The attention backend of the device declares whether it reads host copies of the row boundaries; only
then are they made.

With a hybrid KV cache of G groups (engine/kv_groups.py) a row's staged block table is its G tables in turn and
the slot mapping has a row per group; `AttentionMetadata.groups` gives each group's view. So do the drafters'
passes: their layers read the proposer's own group (`KVGroupLayout.drafter_group`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from batchllm.executor.staged_buffer import StagedBuffer
from batchllm.forward_context import AttentionMetadata
from batchllm.model.attention import attention_backend


class AttentionMetadataBuilder:
    def __init__(self, block_size: int, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.device = device
        self.num_groups, self.max_blocks_per_seq = num_groups, max_blocks_per_seq
        self.host_copies = attention_backend(device).needs_host_metadata
        # One group: [T]; G groups: [G, T], each row a group's slots.
        slots_shape = (max_num_tokens,) if num_groups == 1 else (num_groups, max_num_tokens)
        self.slot_mapping = StagedBuffer.create(slots_shape, torch.int64, device)
        # Entry 0 is 0 from allocation on: nothing writes another value there.
        self.query_start_loc = StagedBuffer.create((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer.create((max_num_seqs,), torch.int32, device)
        self.block_tables = StagedBuffer.create((max_num_seqs, num_groups * max_blocks_per_seq), torch.int32, device)
        self._arange = np.arange(max(max_num_tokens, max_num_seqs + 1), dtype=np.int64)

    # The runner's steps and graph capture: the staged buffers ------------------------------------------------
    def stage(self, num_scheduled: np.ndarray, num_computed: np.ndarray, block_tables: np.ndarray,
              block_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Stage rows of `num_scheduled` new tokens after `num_computed` computed ones, row i's block table being
        `block_tables[block_rows[i]]`; writes each token's position into `positions` and returns each token's
        row."""
        num_seqs, num_tokens = len(num_scheduled), len(positions)
        cu = self.query_start_loc.np
        np.cumsum(num_scheduled, out=cu[1 : num_seqs + 1])
        np.add(num_computed, num_scheduled, out=self.seq_lens.np[:num_seqs])
        seq_of_token = np.repeat(np.arange(num_seqs), num_scheduled)
        np.subtract(self._arange[:num_tokens], cu[:num_seqs][seq_of_token], out=positions)
        positions += num_computed[seq_of_token]
        tables = self.block_tables.np
        np.take(block_tables, block_rows, axis=0, out=tables[:num_seqs])
        if self.num_groups == 1:
            _slots(tables, seq_of_token, positions, self.block_size, out=self.slot_mapping.np[:num_tokens])
        else:
            by_group = self._group_tables(tables)
            for group in range(self.num_groups):
                _slots(by_group[:, group], seq_of_token, positions, self.block_size,
                       out=self.slot_mapping.np[group, :num_tokens])
        return seq_of_token

    def _group_tables(self, tables: np.ndarray) -> np.ndarray:
        return tables.reshape(len(tables), self.num_groups, self.max_blocks_per_seq)

    def spread(self, num_computed: np.ndarray, dest: np.ndarray, num_tokens: int, stride: int) -> None:
        """Re-lay the staged step as `stride` query tokens per row (see `InputBatch.prepare(query_stride=...)`):
        packed token t moves to `dest[t]`, and the inert tokens after each row's own skip their K/V write."""
        num_seqs = len(num_computed)
        slots = self.slot_mapping.np
        packed = slots[..., :num_tokens].copy()
        slots[..., : num_seqs * stride] = -1
        slots[..., dest] = packed
        self.query_start_loc.np[: num_seqs + 1] = self._arange[: num_seqs + 1] * stride
        np.add(num_computed, stride, out=self.seq_lens.np[:num_seqs])

    def pad(self, start: int, end: int, query_len: int) -> tuple[int, int]:
        """Make rows `start..end` padding of `query_len` tokens each: no K/V write (slot -1), and keys read from
        block 0 only. Returns the padding's flat token range. Rows before `start` must be `query_len` tokens
        each too (a decode-only step, or a verification step laid out at that stride)."""
        cu = self.query_start_loc.np
        cu[start + 1 : end + 1] = cu[start] + query_len * np.arange(1, end - start + 1)
        first, last = int(cu[start]), int(cu[end])
        self.seq_lens.np[start:end] = query_len
        self._group_tables(self.block_tables.np)[start:end, :, : -(-query_len // self.block_size)] = 0
        self.slot_mapping.np[..., first:last] = -1
        return first, last

    def upload(self, num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int | None = None
               ) -> AttentionMetadata:
        """The staged metadata of `num_seqs` rows and `num_tokens` tokens, uploaded (asynchronously on CUDA).
        `max_seq_len` defaults to the staged rows' longest; graph capture passes the longest it will replay."""
        cu, seq_lens = self.query_start_loc.np[: num_seqs + 1], self.seq_lens.np[:num_seqs]
        metadata = AttentionMetadata(
            slot_mapping=self._upload_slots(num_tokens),
            query_start_loc=self.query_start_loc.upload(num_seqs + 1),
            seq_lens=self.seq_lens.upload(num_seqs),
            block_tables=self.block_tables.upload(num_seqs),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()) if max_seq_len is None else max_seq_len,
            query_start_loc_cpu=cu.tolist() if self.host_copies else None,
            seq_lens_cpu=seq_lens.tolist() if self.host_copies else None,
        )
        if self.num_groups > 1:
            tables = metadata.block_tables.view(num_seqs, self.num_groups, self.max_blocks_per_seq)
            metadata.groups = [dataclasses.replace(metadata, slot_mapping=metadata.slot_mapping[group],
                                                   block_tables=tables[:, group])
                               for group in range(self.num_groups)]
        return metadata

    def _upload_slots(self, num_tokens: int) -> torch.Tensor:
        staged = self.slot_mapping
        if self.num_groups == 1:
            return staged.upload(num_tokens)
        if staged.device is not staged.host:
            staged.device[:, :num_tokens].copy_(staged.host[:, :num_tokens], non_blocking=True)
        return staged.device[:, :num_tokens]

    # The drafters' passes: fresh tensors ------------------------------------------------------------------
    def for_rows(self, positions: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray
             ) -> AttentionMetadata:
        """Rows of `query_lens` query tokens at the flat `positions`, row i's last at `seq_lens[i] - 1`, its block
        table `tables[i]` (a hybrid KV cache's: its groups' tables in turn); every token's K/V is written into its
        row's slot at its position."""
        owner = np.repeat(np.arange(len(query_lens)), query_lens)
        grouped = self._group_tables(tables)
        slots = np.stack([_slots(grouped[:, group], owner, positions, self.block_size)
                          for group in range(self.num_groups)])
        query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        seq_lens = seq_lens.astype(np.int32)

        def upload(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

        metadata = AttentionMetadata(upload(slots[0] if self.num_groups == 1 else slots), upload(query_start),
                                     upload(seq_lens), upload(tables.astype(np.int32)), int(query_lens.max()),
                                     int(seq_lens.max()), query_start.tolist() if self.host_copies else None,
                                     seq_lens.tolist() if self.host_copies else None)
        if self.num_groups > 1:
            views = metadata.block_tables.view(len(tables), self.num_groups, self.max_blocks_per_seq)
            metadata.groups = [dataclasses.replace(metadata, slot_mapping=metadata.slot_mapping[group],
                                                   block_tables=views[:, group]) for group in range(self.num_groups)]
        return metadata

    def for_decode_rows(self, positions: np.ndarray, tables: np.ndarray) -> AttentionMetadata:
        """One query token per row at `positions`, K/V written into the row's own slot there."""
        n = len(positions)
        return self.for_rows(positions, np.ones(n, dtype=np.int64), positions + 1, tables)


def _slots(tables: np.ndarray, owner: np.ndarray, positions: np.ndarray, block_size: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """Each token's flat cache slot: the block its row's table holds at its position, and the offset in it."""
    blocks = tables[owner, positions // block_size].astype(np.int64)
    return np.add(blocks * block_size, positions % block_size, out=out)
