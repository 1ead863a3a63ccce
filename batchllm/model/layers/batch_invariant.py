"""Batch-invariant numerics for `deterministic=True`: a row's result does not depend on the other rows of its step.

What moves today without it (measured on the CPU, float32, MKL): a GEMM's row changes with M, the number of rows
in the call (M = 1, 2, 7 and >= 16 give three different roundings of the same row), and the reference attention's
`scaled_dot_product_attention` changes with the number of query tokens of a sequence in the step (decode rows,
short prefills). RMSNorm's, the sampler's log-softmax and the elementwise ops are row-local already (the same row
gives the same bits inside 1, 2, 7, 64 and 300 rows, under 1 and 2 OpenMP threads).

So, with the flag, the model runner calls `make_batch_invariant(model)` once after loading, and runs each step
inside `batch_invariant_mode()`:
- every linear layer's method becomes `RowChunkedLinearMethod`, and the LM head's `compute_logits` is wrapped the
  same way: they multiply `ROW_CHUNK` rows at a time (the last chunk padded with zeros), so every GEMM call has
  the same shape and MKL takes the same path; a row's result is then the same wherever it sits in the step;
- attention is `invariant_paged_attention` (`attention_backend` picks it while the mode is on): each query row is
  reduced over its keys in fixed tiles of absolute key positions, with the same call shapes whatever the step holds.
On CUDA the same hooks take the Triton kernels instead, which are batch-invariant by construction (fixed launch
shapes, see their docstrings), so no row chunks: every linear layer's method becomes `InvariantGemmLinearMethod`
(kernels/invariant_gemm.py), the LM head's GEMM is `lm_head_linear`'s invariant one while the mode is on, and the
Triton attention backend passes `invariant=True` (one tile shape, no split-KV). RMSNorm's Triton kernel is one
program per row with a launch shape set by the hidden size only, and the sampler's softmax / log-softmax and
argmax reduce each row on its own, so they are row-local there too (by reading the code; measured on the CPU only).
Without the flag nothing here runs: the default paths are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from batchllm.forward_context import AttentionMetadata
from batchllm.model.quantization.unquantized import UnquantizedLinearMethod

# Rows per GEMM call. 64 keeps a 64-row decode step at one call per layer (the same time as the plain path on
# this CPU) and a prefill's calls large; a step of fewer rows pays for 64 (a lone row's LM head ~5x).
ROW_CHUNK = 64
ATTENTION_ROW_CHUNK = 8  # query rows of one sequence per attention call: decode rows are padded to it (16: 1.2x the
# step time of 8 for 64 decode rows; 1: a prefill gathers its keys once per row)
KEY_TILE = 64  # keys per attention tile (rounded up to whole KV blocks)

_active = False


def active() -> bool:
    """Whether the current step runs batch-invariant (read by `attention_backend`)."""
    return _active


@contextmanager
def batch_invariant_mode() -> Iterator[None]:
    """Runs the enclosed steps' attention batch-invariant (the linear layers are, once `make_batch_invariant` ran),
    on one CPU thread: a data-parallel replica gets its share of the cores, and a row's bits must not depend on how
    many threads its engine has (a 2-core machine's replicas got 1 each against 2 for one engine, and differed)."""
    global _active
    previous, _active = _active, True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _active = previous
        torch.set_num_threads(threads)


def row_chunked(fn: Callable[[torch.Tensor], torch.Tensor | None], x: torch.Tensor) -> torch.Tensor | None:
    """`fn(x)` for a row-wise `fn` over `x [..., features]`, computed `ROW_CHUNK` rows at a time (zero-padded), so
    every call `fn` makes has the same shape. None where `fn` gives None (the LM head on tensor-parallel ranks
    other than 0)."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padded = max(1, -(-count // ROW_CHUNK)) * ROW_CHUNK
    if padded != count:
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
    chunks = [fn(rows[start:start + ROW_CHUNK]) for start in range(0, padded, ROW_CHUNK)]
    if chunks[0] is None:
        return None
    out = torch.cat(chunks)[:count]
    return out.view(*x.shape[:-1], out.shape[-1])


class RowChunkedLinearMethod(UnquantizedLinearMethod):
    """The unquantized method, multiplying in row chunks (`row_chunked`)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return row_chunked(lambda rows: F.linear(rows, layer.weight, bias), x)


class InvariantGemmLinearMethod(UnquantizedLinearMethod):
    """The unquantized method on CUDA, through the batch-invariant Triton GEMM."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from batchllm.kernels.invariant_gemm import invariant_linear  # imports Triton: only on CUDA

        return invariant_linear(x, layer.weight, bias)


def lm_head_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head's GEMM (`embedding.compute_logits`): the batch-invariant Triton GEMM for CUDA tensors while the
    mode is on, `F.linear` otherwise (on the CPU `make_batch_invariant` cuts the rows into chunks around it)."""
    if _active and hidden.is_cuda:
        from batchllm.kernels.invariant_gemm import invariant_linear  # imports Triton: only on CUDA

        return invariant_linear(hidden, weight)
    return F.linear(hidden, weight)


def make_batch_invariant(model: nn.Module) -> None:
    """Switches a loaded model's linear layers and LM head to batch-invariant GEMMs: row-chunked ones on the CPU,
    the Triton GEMM on CUDA. Raises ValueError for what is not batch-invariant yet: MoE experts (their GEMMs take
    each expert's tokens) and quantized linear methods."""
    on_cuda = next(model.parameters()).is_cuda
    for name, module in model.named_modules():
        if type(module).__name__ == "FusedMoE":
            raise ValueError(f"LLM argument deterministic=True: MoE models are not batch-invariant yet ({name} groups "
                             f"each expert's tokens into one GEMM, whose rounding depends on the batch)")
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if type(method) is not UnquantizedLinearMethod:
            raise ValueError(f"LLM argument deterministic=True: quantized linear layers are not batch-invariant yet "
                             f"({name} uses {type(method).__name__})")
        module.quant_method = (InvariantGemmLinearMethod if on_cuda else RowChunkedLinearMethod)(method.config)
    if not on_cuda:  # on CUDA the LM head's GEMM is `lm_head_linear`'s, whatever the rows
        compute_logits = model.compute_logits
        model.compute_logits = lambda hidden: row_chunked(compute_logits, hidden)


def invariant_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              metadata: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                              *, sliding_window: int | None = None, logit_soft_cap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.reference.paged_attention`'s result (same arguments), with each query row's reduction fixed.

    Query rows are cut into chunks of `ATTENTION_ROW_CHUNK` rows of one sequence (zero-padded), and every chunk of
    the step walks the key tiles `[t * tile, (t + 1) * tile)` of absolute positions in order, with an online softmax
    in float32. Every call has the same shapes, whatever else is in the step. A row's keys beyond its own position
    (or its sequence's end) get probability exactly 0 and leave its running max, sum and output bit for bit
    unchanged, so how many tiles its chunk walks, and which rows share the chunk, do not move it.
    """
    if metadata.query_start_loc_cpu is None or metadata.seq_lens_cpu is None:
        raise ValueError("the batch-invariant attention loops over the metadata's host copies (query_start_loc_cpu, "
                         "seq_lens_cpu)")
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    blocks_per_tile = -(-KEY_TILE // block_size)
    tile = blocks_per_tile * block_size
    chunk_seq, chunk_first_row, chunk_rows, chunk_first_pos = [], [], [], []
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        for first in range(start, end, ATTENTION_ROW_CHUNK):
            chunk_seq.append(i)
            chunk_first_row.append(first)
            chunk_rows.append(min(ATTENTION_ROW_CHUNK, end - first))
            chunk_first_pos.append(seq_len - (end - start) + first - start)
    output = torch.zeros_like(query)
    if not chunk_seq:
        return output
    device = query.device
    offsets = torch.arange(ATTENTION_ROW_CHUNK, device=device)
    first_row = torch.tensor(chunk_first_row, device=device)
    row_valid = offsets[None, :] < torch.tensor(chunk_rows, device=device)[:, None]  # [B, C]
    row_index = torch.where(row_valid, first_row[:, None] + offsets[None, :], 0)
    query_pos = torch.tensor(chunk_first_pos, device=device)[:, None] + offsets[None, :]  # [B, C]
    num_chunks = len(chunk_seq)
    # [B, C, Hkv, G, D] -> [B * Hkv, G * C, D]: each KV head's query heads and rows as one matrix.
    q = torch.where(row_valid[:, :, None, None], query[row_index].float(), 0.0)
    q = q.view(num_chunks, ATTENTION_ROW_CHUNK, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_chunks * num_kv_heads, group * ATTENTION_ROW_CHUNK, head_dim)
    seq_index = torch.tensor(chunk_seq, device=device)
    tables = metadata.block_tables[seq_index].long()
    chunk_seq_lens = torch.tensor([seq_lens[i] for i in chunk_seq], device=device)
    last_pos = max(pos + rows - 1 for pos, rows in zip(chunk_first_pos, chunk_rows))
    shape = (num_chunks * num_kv_heads, group * ATTENTION_ROW_CHUNK)
    running_max = torch.full(shape, float("-inf"), device=device)
    running_sum = torch.zeros(shape, device=device)
    if sinks is not None:  # a sink is a logit with no value: it starts every row's softmax
        running_max = sinks.float().view(1, num_kv_heads, group, 1).expand(num_chunks, -1, -1, ATTENTION_ROW_CHUNK)
        running_max = running_max.reshape(shape).clone()
        running_sum = torch.ones(shape, device=device)
    acc = torch.zeros(*shape, head_dim, device=device)
    for t in range(last_pos // tile + 1):
        block_cols = torch.arange(t * blocks_per_tile, (t + 1) * blocks_per_tile, device=device)
        in_table = block_cols < tables.shape[1]
        blocks = tables[:, block_cols.clamp(max=tables.shape[1] - 1)]  # [B, blocks_per_tile]
        key_pos = t * tile + torch.arange(tile, device=device)
        exists = (key_pos[None, :] < chunk_seq_lens[:, None]) & in_table.repeat_interleave(block_size)[None, :]
        keys = _tile_of(k_cache, blocks, k_scale, exists, num_kv_heads, head_dim).transpose(1, 2)  # [BH, D, T]
        values = _tile_of(v_cache, blocks, v_scale, exists, num_kv_heads, head_dim)  # [BH, T, D]
        scores = torch.bmm(q, keys) * scale
        if logit_soft_cap is not None:
            scores = logit_soft_cap * torch.tanh(scores / logit_soft_cap)
        visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & exists[:, None, :]  # [B, C, T]
        if sliding_window is not None:
            visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
        visible = visible[:, None, None].expand(-1, num_kv_heads, group, -1, -1).reshape(*shape, tile)
        scores = scores.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1))
        safe_max = torch.where(torch.isinf(new_max), 0.0, new_max)  # a row that has seen no key yet
        probs = torch.exp(scores - safe_max[..., None])
        rescale = torch.exp(running_max - safe_max)
        running_sum = running_sum * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + torch.bmm(probs, values)
        running_max = new_max
    out = acc / torch.where(running_sum > 0, running_sum, 1.0)[..., None]
    out = out.view(num_chunks, num_kv_heads, group, ATTENTION_ROW_CHUNK, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_chunks, ATTENTION_ROW_CHUNK, num_heads, head_dim).to(query.dtype)
    output[row_index[row_valid]] = out[row_valid]
    return output


def _tile_of(cache: torch.Tensor, blocks: torch.Tensor, scale: float, exists: torch.Tensor, num_kv_heads: int,
             head_dim: int) -> torch.Tensor:
    """One key tile of every chunk's sequence, `[B * Hkv, T, D]` float32; zeros where no key exists yet (the pool's
    other slots may hold anything, NaN included, and a zero probability times NaN would still be NaN)."""
    tokens = cache[blocks].flatten(1, 2)  # [B, T, Hkv, D]
    tokens = tokens.float() * scale if scale != 1.0 or tokens.dtype != torch.float32 else tokens
    tokens = torch.where(exists[:, :, None, None], tokens, 0.0)
    return tokens.permute(0, 2, 1, 3).reshape(-1, tokens.shape[1], head_dim)
