"""Persistent input buffers for the flat batch, filled from a SchedulerOutput each step.

Every buffer is allocated once at its maximum size: host staging arrays (numpy views of pinned memory on
CUDA) and device tensors of the same shape. A step fills a prefix of each on the host with vectorized
numpy, then issues one asynchronous copy per buffer. Nothing is allocated on the hot path, which is what
CUDA graphs (fixed addresses) need. With asynchronous scheduling the next step is prepared while this one
may still be queued: an event after each step's copies guards the host buffers against being refilled
before the copies have read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchllm.forward_context import AttentionMetadata


@dataclass(slots=True)
class StagedBuffer:
    """A host staging array (pinned memory on CUDA, with a numpy view) and its device twin of the same shape."""

    host: torch.Tensor
    device: torch.Tensor
    np: np.ndarray

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> StagedBuffer:
        pin = device.type == "cuda"
        host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        dev = host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
        return cls(host, dev, host.numpy())

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n rows host → device (asynchronous on CUDA) and return the device view."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class InputBatch:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.input_ids = StagedBuffer.create((max_num_tokens,), torch.int64, device)
        self.positions = StagedBuffer.create((max_num_tokens,), torch.int64, device)
        self.slot_mapping = StagedBuffer.create((max_num_tokens,), torch.int64, device)
        self.query_start_loc = StagedBuffer.create((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer.create((max_num_seqs,), torch.int32, device)
        self.block_tables = StagedBuffer.create((max_num_seqs, max_blocks_per_seq), torch.int32, device)
        # Speculative decoding verifies every draft: up to one logits row per token.
        self.logits_indices = StagedBuffer.create((max(max_num_seqs, max_num_tokens),), torch.int64, device)
        self.placeholder_slots = StagedBuffer.create((max_num_seqs,), torch.int64, device)
        self.placeholder_rows = StagedBuffer.create((max_num_seqs,), torch.int64, device)
        self._arange = np.arange(max_num_tokens, dtype=np.int64)
        self._copied = None if device.type == "cpu" else torch.cuda.Event()

    def prepare(self, token_ids: list[int], num_scheduled: np.ndarray, num_computed: np.ndarray,
                block_tables: np.ndarray, block_rows: np.ndarray, sample_rows: np.ndarray, pad_to: int | None = None,
                sample_counts: np.ndarray | None = None, query_stride: int | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Fill the buffers for one step.

        `num_scheduled[i]` new tokens of sequence i start at position `num_computed[i]`; `token_ids` is their
        concatenation; `block_tables[block_rows[i]]` its block table (entries past its blocks are never read);
        `sample_rows` the sequences whose last scheduled token yields logits (`sample_counts[i]`: the last that
        many, speculative decoding's verification rows). `query_stride` (a verification step replayed from a CUDA
        graph) lays every sequence out as that many query tokens, its own first and inert ones after them.
        `pad_to` (steps replayed from a CUDA graph) appends padding rows up to that many sequences of one token
        (`query_stride` tokens). Returns (input_ids, positions, attention metadata, logits indices) on device.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        num_seqs = len(num_scheduled)
        num_tokens = len(token_ids)
        cu = self.query_start_loc.np
        cu[0] = 0
        np.cumsum(num_scheduled, out=cu[1 : num_seqs + 1])
        seq_lens = self.seq_lens.np[:num_seqs]
        np.add(num_computed, num_scheduled, out=seq_lens)

        # Positions: each token's offset inside its sequence's chunk, plus the sequence's computed length.
        seq_of_token = np.repeat(np.arange(num_seqs), num_scheduled)
        positions = self.positions.np[:num_tokens]
        np.subtract(self._arange[:num_tokens], cu[:num_seqs][seq_of_token], out=positions)
        positions += num_computed[seq_of_token]

        tables = self.block_tables.np
        np.take(block_tables, block_rows, axis=0, out=tables[:num_seqs])
        block_of_token = tables[seq_of_token, positions // self.block_size]
        np.add(block_of_token * self.block_size, positions % self.block_size, out=self.slot_mapping.np[:num_tokens])
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
            seq_lens = self.seq_lens.np[:num_seqs]

        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc=self.query_start_loc.upload(num_seqs + 1),
            seq_lens=self.seq_lens.upload(num_seqs),
            block_tables=self.block_tables.upload(num_seqs),
            max_query_len=query_stride or (int(num_scheduled.max()) if pad_to is None else 1),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu[: num_seqs + 1].tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
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
        for buffer, fill in ((self.input_ids, 0), (self.slot_mapping, -1)):
            packed = buffer.np[:num_tokens].copy()
            buffer.np[:total] = fill
            buffer.np[dest] = packed
        offsets = self._arange[:total] % stride
        np.add(np.repeat(num_computed, stride), offsets, out=self.positions.np[:total])
        logits = self.logits_indices.np[:num_samples]
        logits[:] = dest[logits]
        cu[: num_seqs + 1] = self._arange[: num_seqs + 1] * stride
        np.add(num_computed, stride, out=self.seq_lens.np[:num_seqs])

    def fill_padding(self, start: int, end: int, query_len: int = 1) -> None:
        """Make sequences `start..end` of `query_len` tokens inert padding: their K/V write is skipped (slot -1) and
        they attend to arbitrary keys of block 0, so their (discarded) outputs stay finite-or-garbage in their own
        rows only. Used for CUDA-graph batch padding and capture. Assumes rows before `start` are `query_len`-token
        sequences too (a decode-only step, or a verification step laid out with that stride)."""
        cu = self.query_start_loc.np
        cu[start + 1 : end + 1] = cu[start] + query_len * np.arange(1, end - start + 1)
        first, last = int(cu[start]), int(cu[end])
        self.seq_lens.np[start:end] = query_len
        self.block_tables.np[start:end, : -(-query_len // self.block_size)] = 0
        self.positions.np[first:last] = self._arange[: last - first] % query_len
        self.input_ids.np[first:last] = 0
        self.slot_mapping.np[first:last] = -1

    def graph_inputs(self, batch_size: int, max_seq_len: int, query_len: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Fixed-address device views for capturing a step of `batch_size` sequences of `query_len` tokens.

        Replays read whatever `prepare(..., pad_to=batch_size[, query_stride=query_len])` last uploaded into the
        same storage.
        """
        self.query_start_loc.np[0] = 0
        self.fill_padding(0, batch_size, query_len)
        num_tokens = batch_size * query_len
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc=self.query_start_loc.upload(batch_size + 1),
            seq_lens=self.seq_lens.upload(batch_size),
            block_tables=self.block_tables.upload(batch_size),
            max_query_len=query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=self.query_start_loc.np[: batch_size + 1].tolist(),
            seq_lens_cpu=[query_len] * batch_size,
        )
        return self.input_ids.upload(num_tokens), self.positions.upload(num_tokens), metadata
