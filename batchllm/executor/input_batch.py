"""Persistent input buffers for the flat batch, filled from a SchedulerOutput each step.

Every buffer is allocated once at its maximum size: host staging arrays (numpy views of pinned memory on
CUDA) and device tensors of the same shape. A step fills a prefix of each on the host with vectorized
numpy, then issues one asynchronous copy per buffer. Nothing is allocated on the hot path, which is what
CUDA graphs (fixed addresses) need. With asynchronous scheduling the next step is prepared while this one
may still be queued: an event after each step's copies guards the host buffers against being refilled
before the copies have read them.
"""

from __future__ import annotations

import numpy as np
import torch

from batchllm.executor.attention_metadata import AttentionMetadataBuilder
from batchllm.executor.staged_buffer import StagedBuffer
from batchllm.forward_context import AttentionMetadata


class InputBatch:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, num_kv_groups: int = 1) -> None:
        self.max_num_tokens = max_num_tokens
        self.input_ids = StagedBuffer.create((max_num_tokens,), torch.int64, device)
        self.positions = StagedBuffer.create((max_num_tokens,), torch.int64, device)
        self.attention = AttentionMetadataBuilder(block_size, max_num_tokens, max_num_seqs, max_blocks_per_seq, device,
                                                  num_kv_groups)
        # The metadata's staged buffers are the batch's too: a replayed CUDA graph reads them where they are.
        self.slot_mapping, self.query_start_loc = self.attention.slot_mapping, self.attention.query_start_loc
        self.seq_lens, self.block_tables = self.attention.seq_lens, self.attention.block_tables
        # Speculative decoding verifies every draft: up to one logits row per token.
        self.logits_indices = StagedBuffer.create((max(max_num_seqs, max_num_tokens),), torch.int64, device)
        self.placeholder_slots = StagedBuffer.create((max_num_seqs,), torch.int64, device)
        self.placeholder_rows = StagedBuffer.create((max_num_seqs,), torch.int64, device)
        self._arange = np.arange(max_num_tokens, dtype=np.int64)
        self._copied = None if device.type == "cpu" else torch.cuda.Event()

    def prepare(self, token_ids: list[int], num_scheduled: np.ndarray, num_computed: np.ndarray,
                block_tables: np.ndarray, block_rows: np.ndarray, sample_rows: np.ndarray, pad_to: int | None = None,
                sample_counts: np.ndarray | None = None, query_stride: int | None = None,
                position_shifts: list[tuple[int, int, int]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Fill the buffers for one step.

        `num_scheduled[i]` new tokens of sequence i start at position `num_computed[i]`; `token_ids` is their
        concatenation; `block_tables[block_rows[i]]` its block table (entries past its blocks are never read);
        `sample_rows` the sequences whose last scheduled token yields logits (`sample_counts[i]`: the last that
        many, speculative decoding's verification rows). `query_stride` (a verification step replayed from a CUDA
        graph) lays every sequence out as that many query tokens, its own first and inert ones after them.
        `pad_to` (steps replayed from a CUDA graph) appends padding rows up to that many sequences of one token
        (`query_stride` tokens). `position_shifts`: `(first flat token, tokens, delta)` whose RoPE positions are
        their index + delta (multimodal RoPE past a prompt's images; their K/V slots stay by index). Returns
        (input_ids, positions, attention metadata, logits indices) on device.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        num_seqs = len(num_scheduled)
        num_tokens = len(token_ids)
        seq_of_token = self.attention.stage(num_scheduled, num_computed, block_tables, block_rows,
                                            self.positions.np[:num_tokens])
        if position_shifts:  # one vectorised add: a row per running request with images, every step
            firsts, counts, deltas = np.array(position_shifts, dtype=np.int64).T
            starts = np.repeat(firsts - (np.cumsum(counts) - counts), counts)
            self.positions.np[starts + self._arange[:len(starts)]] += np.repeat(deltas, counts)
        cu = self.query_start_loc.np
        self.input_ids.np[:num_tokens] = token_ids
        num_samples = len(sample_rows)
        if sample_counts is None:
            np.subtract(cu[1:][sample_rows], 1, out=self.logits_indices.np[:num_samples])
        else:
            first = np.repeat(cu[1:][sample_rows] - sample_counts, sample_counts)
            num_samples = len(first)
            starts = np.repeat(np.cumsum(sample_counts) - sample_counts, sample_counts)
            np.add(first, self._arange[:num_samples] - starts, out=self.logits_indices.np[:num_samples])
        query_len = 1
        if query_stride is not None:
            self._spread(num_computed, seq_of_token, num_tokens, num_samples, query_stride)
            query_len, num_tokens = query_stride, num_seqs * query_stride
        if pad_to is not None and pad_to > num_seqs:
            self.fill_padding(num_seqs, pad_to, query_len)
            num_seqs, num_tokens = pad_to, pad_to * query_len

        metadata = self.attention.upload(num_seqs, num_tokens,
                                         query_stride or (int(num_scheduled.max()) if pad_to is None else 1))
        uploaded = (self.input_ids.upload(num_tokens), self.positions.upload(num_tokens), metadata,
                    self.logits_indices.upload(num_samples))
        self._record_copies()
        return uploaded

    def fill_placeholders(self, slots: list[int], rows: list[int], sampled: torch.Tensor) -> None:
        """Write `sampled[rows[i]]` (the last step's samples, on the device) as input token `slots[i]`: the
        placeholder tokens that the engine schedules before it knows them."""
        n = len(slots)
        self.placeholder_slots.np[:n] = slots
        self.placeholder_rows.np[:n] = rows
        index = self.placeholder_slots.upload(n)
        self.input_ids.device.index_copy_(0, index, sampled.index_select(0, self.placeholder_rows.upload(n)))
        self._record_copies()

    def _record_copies(self) -> None:
        if self._copied is not None:
            self._copied.record()

    def _spread(self, num_computed: np.ndarray, seq_of_token: np.ndarray, num_tokens: int, num_samples: int,
                stride: int) -> None:
        """Move the packed tokens of the prepared step to `stride` query tokens per sequence: sequence i's tokens
        at `i * stride` on, then inert ones (no K/V write, input 0) at the positions after them. A query sees only
        the keys at or before its own position, so the inert tokens change no real token's output; their keys
        past the sequence's blocks are read through stale (valid) block-table entries, for their own rows only.
        The caller guarantees each sequence's `num_computed + stride` fits its block table."""
        num_seqs = len(num_computed)
        cu = self.query_start_loc.np
        dest = seq_of_token * stride + self._arange[:num_tokens] - cu[seq_of_token]
        total = num_seqs * stride
        packed = self.input_ids.np[:num_tokens].copy()
        self.input_ids.np[:total] = 0
        self.input_ids.np[dest] = packed
        offsets = self._arange[:total] % stride
        np.add(np.repeat(num_computed, stride), offsets, out=self.positions.np[:total])
        logits = self.logits_indices.np[:num_samples]
        logits[:] = dest[logits]
        self.attention.spread(num_computed, dest, num_tokens, stride)

    def fill_padding(self, start: int, end: int, query_len: int = 1) -> None:
        """Make sequences `start..end` of `query_len` tokens inert padding: their K/V write is skipped (slot -1) and
        they attend to arbitrary keys of block 0, so their (discarded) outputs stay finite-or-garbage in their own
        rows only. Used for CUDA-graph batch padding and capture. Assumes rows before `start` are `query_len`-token
        sequences too (a decode-only step, or a verification step laid out with that stride)."""
        first, last = self.attention.pad(start, end, query_len)
        self.positions.np[first:last] = self._arange[: last - first] % query_len
        self.input_ids.np[first:last] = 0

    def graph_inputs(self, batch_size: int, max_seq_len: int, query_len: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Fixed-address device views for capturing a step of `batch_size` sequences of `query_len` tokens.

        Replays read whatever `prepare(..., pad_to=batch_size[, query_stride=query_len])` last uploaded into the
        same storage.
        """
        self.fill_padding(0, batch_size, query_len)
        num_tokens = batch_size * query_len
        metadata = self.attention.upload(batch_size, num_tokens, query_len, max_seq_len)
        return self.input_ids.upload(num_tokens), self.positions.upload(num_tokens), metadata
