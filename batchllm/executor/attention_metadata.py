"""The attention metadata of every forward pass the executor runs, made in one place.

Three kinds of pass need it: the runner's steps, CUDA-graph capture, and the drafters' own passes (a draft
model's or EAGLE head's). All are rows of query tokens that end each row's context: row i's `query_lens[i]`
tokens sit at positions `seq_lens[i] - query_lens[i]` .. `seq_lens[i] - 1` and write their K/V into their
row's block-table slots there (see `AttentionMetadata`). The runner's steps and graph capture stage theirs in
the input batch's arena (staging_arena.py): a CUDA graph reads them where every step of its shape finds them again,
and their one upload from pinned memory queues behind the device's work. A drafter's passes get fresh tensors
each: several are queued per step, and the staged host arrays may not be refilled until the step's copy has read
them.

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

from batchllm.executor.staging_arena import ArraySpec, StagedLayout
from batchllm.forward_context import AttentionMetadata
from batchllm.model.attention import attention_backend


class AttentionMetadataBuilder:
    def __init__(self, block_size: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.device = device
        self.num_groups, self.max_blocks_per_seq = num_groups, max_blocks_per_seq
        self.host_copies = attention_backend(device).needs_host_metadata

    # The runner's steps and graph capture: the staged arrays --------------------------------------------------
    def specs(self, num_seqs: int, num_tokens: int) -> tuple[ArraySpec, ...]:
        """The staged arrays of a step of `num_seqs` rows and `num_tokens` tokens. One group's slot mapping is
        [T]; G groups' [G, T], a row per group."""
        slots = (num_tokens,) if self.num_groups == 1 else (self.num_groups, num_tokens)
        return (ArraySpec("slot_mapping", torch.int64, slots),
                ArraySpec("query_start_loc", torch.int32, (num_seqs + 1,)),
                ArraySpec("seq_lens", torch.int32, (num_seqs,)),
                ArraySpec("block_tables", torch.int32, (num_seqs, self.num_groups * self.max_blocks_per_seq)))

    def stage(self, step: StagedLayout, num_scheduled: np.ndarray, num_computed: np.ndarray,
              block_tables: np.ndarray, block_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Stage rows of `num_scheduled` new tokens after `num_computed` computed ones, row i's block table being
        `block_tables[block_rows[i]]`; writes each token's position into `positions` and returns each token's
        row."""
        num_seqs, num_tokens = len(num_scheduled), len(positions)
        cu = step.host["query_start_loc"]
        cu[0] = 0  # the arena's bytes there may be another step's array
        np.cumsum(num_scheduled, out=cu[1 : num_seqs + 1])
        np.add(num_computed, num_scheduled, out=step.host["seq_lens"][:num_seqs])
        seq_of_token = np.repeat(np.arange(num_seqs), num_scheduled)
        np.subtract(np.arange(num_tokens), cu[:num_seqs][seq_of_token], out=positions)
        positions += num_computed[seq_of_token]
        tables = step.host["block_tables"]
        np.take(block_tables, block_rows, axis=0, out=tables[:num_seqs])
        slots = step.host["slot_mapping"]
        if self.num_groups == 1:
            _slots(tables, seq_of_token, positions, self.block_size, out=slots[:num_tokens])
        else:
            by_group = self._group_tables(tables)
            for group in range(self.num_groups):
                _slots(by_group[:, group], seq_of_token, positions, self.block_size, out=slots[group, :num_tokens])
        return seq_of_token

    def _group_tables(self, tables: np.ndarray) -> np.ndarray:
        return tables.reshape(len(tables), self.num_groups, self.max_blocks_per_seq)

    def spread(self, step: StagedLayout, num_computed: np.ndarray, dest: np.ndarray, num_tokens: int,
               stride: int) -> None:
        """Re-lay the staged step as `stride` query tokens per row (see `InputBatch.prepare(query_stride=...)`):
        packed token t moves to `dest[t]`, and the inert tokens after each row's own skip their K/V write."""
        num_seqs = len(num_computed)
        slots = step.host["slot_mapping"]
        packed = slots[..., :num_tokens].copy()
        slots[..., : num_seqs * stride] = -1
        slots[..., dest] = packed
        step.host["query_start_loc"][: num_seqs + 1] = np.arange(num_seqs + 1) * stride
        np.add(num_computed, stride, out=step.host["seq_lens"][:num_seqs])

    def pad(self, step: StagedLayout, start: int, end: int, query_len: int) -> tuple[int, int]:
        """Make rows `start..end` padding of `query_len` tokens each: no K/V write (slot -1), and keys read from
        block 0 only. Returns the padding's flat token range. Rows before `start` must be `query_len` tokens
        each too (a decode-only step, or a verification step laid out at that stride)."""
        cu = step.host["query_start_loc"]
        cu[start + 1 : end + 1] = cu[start] + query_len * np.arange(1, end - start + 1)
        first, last = int(cu[start]), int(cu[end])
        step.host["seq_lens"][start:end] = query_len
        self._group_tables(step.host["block_tables"])[start:end, :, : -(-query_len // self.block_size)] = 0
        step.host["slot_mapping"][..., first:last] = -1
        return first, last

    def metadata(self, step: StagedLayout, max_query_len: int, max_seq_len: int | None = None) -> AttentionMetadata:
        """The step's metadata, read from its device arrays (uploaded by the caller). `max_seq_len` defaults to
        the staged rows' longest; graph capture passes the longest it will replay."""
        cu, seq_lens = step.host["query_start_loc"], step.host["seq_lens"]
        device = step.device
        metadata = AttentionMetadata(
            slot_mapping=device["slot_mapping"],
            query_start_loc=device["query_start_loc"],
            seq_lens=device["seq_lens"],
            block_tables=device["block_tables"],
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()) if max_seq_len is None else max_seq_len,
            query_start_loc_cpu=cu.tolist() if self.host_copies else None,
            seq_lens_cpu=seq_lens.tolist() if self.host_copies else None,
            num_decodes=_leading_decodes(cu) if max_query_len > 1 else 0,
        )
        if self.num_groups > 1:
            num_seqs = len(seq_lens)
            tables = metadata.block_tables.view(num_seqs, self.num_groups, self.max_blocks_per_seq)
            metadata.groups = [dataclasses.replace(metadata, slot_mapping=metadata.slot_mapping[group],
                                                   block_tables=tables[:, group])
                               for group in range(self.num_groups)]
        return metadata

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


def _leading_decodes(query_start_loc: np.ndarray) -> int:
    """How many sequences from the first have one query token each."""
    longer = np.flatnonzero(np.diff(query_start_loc) != 1)
    return int(longer[0]) if len(longer) else len(query_start_loc) - 1
