"""A step's flat batch, staged on the host and uploaded to the device in one copy.

A step fills its arrays on the host with vectorized numpy, laid out back to back in one pinned arena at the
step's own sizes, then issues one asynchronous copy of them all (staging_arena.py). Nothing is allocated on
the hot path, and a step of a captured shape finds its device arrays where the CUDA graph reads them. With
asynchronous scheduling the next step is prepared while this one may still be queued: on CUDA the arena's
HOST_BUFFERS host blocks take turns, and an event after each step's copy guards its block against being refilled
before the copy has read it.
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.staging_arena import ArraySpec, StagedLayout, StagingArena, arena_bytes
from batchllm.forward_context import AttentionMetadata

# Layouts kept for reuse; past this many all are dropped.
MAX_CACHED_LAYOUTS = 512
# Host blocks of the arena on CUDA: the steps (or a burst's passes) the host may stage ahead of the device's queue.
HOST_BUFFERS = 3


class InputBatch:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, num_kv_groups: int = 1, host_buffers: int | None = None) -> None:
        """`host_buffers`: the arena's host blocks (None: HOST_BUFFERS on CUDA, one on the CPU)."""
        self.max_num_tokens = max_num_tokens
        self.attention = AttentionMetadataBuilder(block_size, max_blocks_per_seq, device, num_kv_groups)
        # Speculative decoding verifies every draft: up to one logits row per token.
        largest = self._specs(max_num_seqs, max_num_tokens, max_num_seqs, max(max_num_seqs, max_num_tokens))
        cuda = device.type == "cuda"
        self.arena = StagingArena(arena_bytes(list(largest)), device,
                                  host_buffers or (HOST_BUFFERS if cuda else 1))
        self.step: StagedLayout | None = None  # the arrays of the step last prepared
        # Layouts by (rows, tokens, placeholders, samples, host block): a decode step's sizes repeat, a mixed step's
        # rarely.
        self._layouts: dict[tuple[int, int, int, int, int], StagedLayout] = {}
        self._arange = np.arange(max_num_tokens, dtype=np.int64)
        # Per host block, an event after its last copy; the block the next step is staged in.
        self._copied = [torch.cuda.Event() for _ in range(self.arena.num_buffers)] if cuda else []
        self._next_buffer = 0

    def _layout(self, num_seqs: int, num_tokens: int, num_placeholders: int, num_samples: int,
                buffer: int = 0) -> StagedLayout:
        """The arena's views for a step of these sizes in host block `buffer`, made once per sizes (past
        MAX_CACHED_LAYOUTS all are dropped)."""
        key = (num_seqs, num_tokens, num_placeholders, num_samples, buffer)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_CACHED_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = self.arena.layout(self._specs(num_seqs, num_tokens, num_placeholders,
                                                                        num_samples), buffer)
        return layout

    def _take_buffer(self) -> int:
        """The host block to stage the next step in, once its last copy has read it."""
        buffer = self._next_buffer
        self._next_buffer = (buffer + 1) % self.arena.num_buffers
        if self._copied:
            self._copied[buffer].synchronize()
        return buffer

    def _specs(self, num_seqs: int, num_tokens: int, num_placeholders: int, num_samples: int
               ) -> tuple[ArraySpec, ...]:
        """A step's arrays, those a CUDA graph reads first: their places depend on the rows and tokens alone."""
        return (ArraySpec("input_ids", torch.int64, (num_tokens,)), ArraySpec("positions", torch.int64, (num_tokens,)),
                *self.attention.specs(num_seqs, num_tokens),
                ArraySpec("placeholder_slots", torch.int64, (num_placeholders,)),
                ArraySpec("placeholder_rows", torch.int64, (num_placeholders,)),
                ArraySpec("logits_indices", torch.int64, (num_samples,)))

    def prepare(self, token_ids: list[int], num_scheduled: np.ndarray, num_computed: np.ndarray,
                block_tables: np.ndarray, block_rows: np.ndarray, sample_rows: np.ndarray, pad_to: int | None = None,
                sample_counts: np.ndarray | None = None, query_stride: int | None = None,
                position_shifts: list[tuple[int, int, int]] | None = None,
                placeholders: tuple[list[int], list[int]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Stage and upload one step.

        `num_scheduled[i]` new tokens of sequence i start at position `num_computed[i]`; `token_ids` is their
        concatenation; `block_tables[block_rows[i]]` its block table (entries past its blocks are never read);
        `sample_rows` the sequences whose last scheduled token yields logits (`sample_counts[i]`: the last that
        many, speculative decoding's verification rows). `query_stride` (a verification step replayed from a CUDA
        graph) lays every sequence out as that many query tokens, its own first and inert ones after them.
        `pad_to` (steps replayed from a CUDA graph) appends padding rows up to that many sequences of one token
        (`query_stride` tokens). `position_shifts`: `(first flat token, tokens, delta)` whose RoPE positions are
        their index + delta (multimodal RoPE past a prompt's images; their K/V slots stay by index).
        `placeholders`: (flat token indices, rows of the last step's samples) for `fill_placeholders`. Returns
        (input_ids, positions, attention metadata, logits indices) on device.
        """
        buffer = self._take_buffer()
        num_seqs = len(num_scheduled)
        num_tokens = len(token_ids)
        num_samples = len(sample_rows) if sample_counts is None else int(sample_counts.sum())
        query_len = query_stride or 1
        final_seqs = max(num_seqs, pad_to or 0)
        final_tokens = num_tokens if pad_to is None and query_stride is None else final_seqs * query_len
        slots, rows = placeholders or ((), ())
        step = self.step = self._layout(final_seqs, final_tokens, len(slots), num_samples, buffer)
        host = step.host
        positions = host["positions"]
        seq_of_token = self.attention.stage(step, num_scheduled, num_computed, block_tables, block_rows,
                                            positions[:num_tokens])
        if position_shifts:  # one vectorised add: a row per running request with images, every step
            firsts, counts, deltas = np.array(position_shifts, dtype=np.int64).T
            starts = np.repeat(firsts - (np.cumsum(counts) - counts), counts)
            positions[starts + self._arange[:len(starts)]] += np.repeat(deltas, counts)
        cu = host["query_start_loc"]
        host["input_ids"][:num_tokens] = token_ids
        host["placeholder_slots"][:] = slots
        host["placeholder_rows"][:] = rows
        if sample_counts is None:
            np.subtract(cu[1:][sample_rows], 1, out=host["logits_indices"])
        else:
            first = np.repeat(cu[1:][sample_rows] - sample_counts, sample_counts)
            starts = np.repeat(np.cumsum(sample_counts) - sample_counts, sample_counts)
            np.add(first, self._arange[:num_samples] - starts, out=host["logits_indices"])
        if query_stride is not None:
            self._spread(num_computed, seq_of_token, num_tokens, query_stride)
        if final_seqs > num_seqs:
            self.fill_padding(num_seqs, final_seqs, query_len)
        max_query_len = query_stride or (int(num_scheduled.max()) if pad_to is None else 1)
        metadata = self.attention.metadata(step, max_query_len)
        self.arena.upload(step)
        self._record_copy()
        return step.device["input_ids"], step.device["positions"], metadata, step.device["logits_indices"]

    def fill_placeholders(self, sampled: torch.Tensor) -> None:
        """Write `sampled[rows[i]]` (the last step's samples, on the device) as input token `slots[i]`, the
        placeholders the step was prepared with: the tokens that the engine schedules before it knows them."""
        device = self.step.device
        device["input_ids"].index_copy_(0, device["placeholder_slots"],
                                        sampled.index_select(0, device["placeholder_rows"]))

    def _record_copy(self) -> None:
        if self._copied:
            self._copied[self.step.buffer].record()

    def _spread(self, num_computed: np.ndarray, seq_of_token: np.ndarray, num_tokens: int, stride: int) -> None:
        """Move the packed tokens of the prepared step to `stride` query tokens per sequence: sequence i's tokens
        at `i * stride` on, then inert ones (no K/V write, input 0) at the positions after them. A query sees only
        the keys at or before its own position, so the inert tokens change no real token's output; their keys
        past the sequence's blocks are read through stale (valid) block-table entries, for their own rows only.
        The caller guarantees each sequence's `num_computed + stride` fits its block table."""
        num_seqs = len(num_computed)
        host = self.step.host
        cu = host["query_start_loc"]
        dest = seq_of_token * stride + self._arange[:num_tokens] - cu[seq_of_token]
        total = num_seqs * stride
        input_ids = host["input_ids"]
        packed = input_ids[:num_tokens].copy()
        input_ids[:total] = 0
        input_ids[dest] = packed
        offsets = self._arange[:total] % stride
        np.add(np.repeat(num_computed, stride), offsets, out=host["positions"][:total])
        logits = host["logits_indices"]
        logits[:] = dest[logits]
        self.attention.spread(self.step, num_computed, dest, num_tokens, stride)

    def fill_padding(self, start: int, end: int, query_len: int = 1) -> None:
        """Make sequences `start..end` of `query_len` tokens inert padding: their K/V write is skipped (slot -1) and
        they attend to arbitrary keys of block 0, so their (discarded) outputs stay finite-or-garbage in their own
        rows only. Used for CUDA-graph batch padding and capture. Assumes rows before `start` are `query_len`-token
        sequences too (a decode-only step, or a verification step laid out with that stride)."""
        first, last = self.attention.pad(self.step, start, end, query_len)
        self.step.host["positions"][first:last] = self._arange[: last - first] % query_len
        self.step.host["input_ids"][first:last] = 0

    def graph_inputs(self, batch_size: int, max_seq_len: int, query_len: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The device arrays a step of `batch_size` sequences of `query_len` tokens reads, for capturing it.

        Replays read whatever `prepare(..., pad_to=batch_size[, query_stride=query_len])` last uploaded there.
        """
        step = self.step = self._layout(batch_size, batch_size * query_len, 0, 0, self._take_buffer())
        step.host["query_start_loc"][0] = 0
        self.fill_padding(0, batch_size, query_len)
        metadata = self.attention.metadata(step, query_len, max_seq_len)
        self.arena.upload(step)
        self._record_copy()
        return step.device["input_ids"], step.device["positions"], metadata

    def replay_layout(self, batch_size: int, query_len: int = 1) -> StagedLayout:
        """The arrays of a step of `batch_size` rows of `query_len` tokens each: where its CUDA graph reads them
        (a step's placeholders and logits indices, staged after them, are not read there)."""
        return self._layout(batch_size, batch_size * query_len, 0, 0)
