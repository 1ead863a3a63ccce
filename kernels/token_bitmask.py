"""Triton grammar mask: `-inf` into the logits a structured-output row's token bitmask forbids, in place.

One program per (constrained row, block of the vocabulary): it reads the block's bitmask words once and
writes only the logits whose bit is clear, so an all-allowed block costs one read of its words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


def apply_token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """See `reference.apply_token_bitmask_`."""
    num_rows, vocab = len(rows), logits.shape[-1]
    if num_rows:
        grid = (num_rows, triton.cdiv(vocab, BLOCK))
        _token_bitmask_kernel[grid](logits, rows, bitmask, logits.stride(0), bitmask.stride(0), vocab,
                                    bitmask.shape[1] * 32, BLOCK=BLOCK)
    return logits


@triton.jit
def _token_bitmask_kernel(logits_ptr, rows_ptr, bitmask_ptr, stride_logits, stride_bitmask, vocab, bitmask_bits,
                          BLOCK: tl.constexpr):
    """Grid `(len(rows), cdiv(vocab, BLOCK))`; bitmask row i belongs to logits row `rows[i]`; tokens at or past
    `bitmask_bits` are forbidden."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_bitmask + tokens // 32, mask=tokens < bitmask_bits,
                    other=0)
    forbidden = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & forbidden)
