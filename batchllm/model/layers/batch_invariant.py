"""Batch-invariant numerics for `deterministic=True` on the CPU: a row's result does not depend on the other rows
of its step.

What moves today without it (measured on the CPU, float32, MKL): a GEMM's row changes with M, the number of rows
in the call (M = 1, 2, 7 and >= 16 give three different roundings of the same row), and the reference attention's
`scaled_dot_product_attention` changes with the number of query tokens of a sequence in the step (chunked prefill,
a cached prefix, decode). RMSNorm's, the sampler's log-softmax and the elementwise ops are row-local already (the
same row gives the same bits inside 1, 2, 7, 64 and 300 rows, 1 and 2 OpenMP threads).

So, while `batch_invariant_mode()` is entered (the model runner enters it around each step when the engine was
built with `deterministic=True`):
- every `mm` / `addmm` on the CPU runs in calls of exactly `ROW_CHUNK` rows (the last padded with zeros), so MKL
  takes the same path for every call; a row's result is then the same wherever it sits in the step (checked
  empirically, tests/unit/test_batch_invariant.py, also under 1 and 2 threads);
- attention is `invariant_paged_attention`: each query row is reduced over its keys in fixed tiles of absolute key
  positions, with the same call shapes whatever the step holds.
Outside the mode nothing here runs: the default paths are untouched.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchllm.forward_context import AttentionMetadata

ROW_CHUNK = 16  # rows per GEMM call: MKL rounds M >= 16 alike, so decode rows are padded the least
KEY_TILE = 64  # keys per attention tile (rounded up to whole KV blocks)

_aten = torch.ops.aten
_active = False


def active() -> bool:
    """Whether the current step runs batch-invariant (read by `attention_backend`)."""
    return _active


class _RowChunkedMatmul(TorchDispatchMode):
    """Routes the CPU's matmuls against a 2-D weight (`F.linear`, which inference mode does not decompose, and the
    `mm` / `addmm` / `matmul` of other code: the linear layers, the LM head, MoE experts, LoRA) through
    `row_chunked_mm`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.linear.default and args[0].device.type == "cpu":
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = row_chunked_mm(x.reshape(-1, x.shape[-1]), weight.t())
            out = out if bias is None else out + bias
            return out.view(*x.shape[:-1], weight.shape[0])
        if func in (_aten.mm.default, _aten.matmul.default) and args[0].device.type == "cpu" and args[1].dim() == 2:
            x = args[0]
            return row_chunked_mm(x.reshape(-1, x.shape[-1]), args[1]).view(*x.shape[:-1], args[1].shape[1])
        if func is _aten.addmm.default and args[1].device.type == "cpu":
            bias, a, b = args
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            product = row_chunked_mm(a, b)
            if alpha != 1:
                product = product * alpha
            return product + (bias if beta == 1 else bias * beta)
        return func(*args, **kwargs)


def row_chunked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` computed `ROW_CHUNK` rows at a time (zero-padded), so every GEMM call has the same shape."""
    rows = a.shape[0]
    padded = -(-rows // ROW_CHUNK) * ROW_CHUNK
    if padded != rows:
        a = torch.cat([a, a.new_zeros(padded - rows, a.shape[1])])
    out = a.new_empty(padded, b.shape[1])
    for start in range(0, padded, ROW_CHUNK):
        torch.mm(a[start:start + ROW_CHUNK], b, out=out[start:start + ROW_CHUNK])
    return out[:rows]


@contextmanager
def batch_invariant_mode() -> Iterator[None]:
    """Runs the enclosed steps batch-invariant (see the module docstring)."""
    global _active
    previous, _active = _active, True
    try:
        with _RowChunkedMatmul():
            yield
    finally:
        _active = previous


def invariant_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              metadata: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                              *, sliding_window: int | None = None, logit_soft_cap: float | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.reference.paged_attention`'s result (same arguments), with each query row's reduction fixed.

    Query rows are cut into chunks of `ROW_CHUNK` rows of one sequence (zero-padded), and every chunk of the step
    walks the key tiles `[t * tile, (t + 1) * tile)` of absolute positions in order, with an online softmax in
    float32. Every call has the same shapes, whatever else is in the step. A row's keys beyond its own position
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
        for first in range(start, end, ROW_CHUNK):
            chunk_seq.append(i)
            chunk_first_row.append(first)
            chunk_rows.append(min(ROW_CHUNK, end - first))
            chunk_first_pos.append(seq_len - (end - start) + first - start)
    output = torch.zeros_like(query)
    if not chunk_seq:
        return output
    device = query.device
    offsets = torch.arange(ROW_CHUNK, device=device)
    first_row = torch.tensor(chunk_first_row, device=device)
    row_valid = offsets[None, :] < torch.tensor(chunk_rows, device=device)[:, None]  # [B, C]
    row_index = torch.where(row_valid, first_row[:, None] + offsets[None, :], 0)
    query_pos = torch.tensor(chunk_first_pos, device=device)[:, None] + offsets[None, :]  # [B, C]
    num_chunks = len(chunk_seq)
    # [B, C, Hkv, G, D] -> [B * Hkv, G * C, D]: each KV head's query heads and rows as one matrix.
    q = torch.where(row_valid[:, :, None, None], query[row_index].float(), 0.0)
    q = q.view(num_chunks, ROW_CHUNK, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_chunks * num_kv_heads, group * ROW_CHUNK, head_dim)
    seq_index = torch.tensor(chunk_seq, device=device)
    tables = metadata.block_tables[seq_index].long()
    chunk_seq_lens = torch.tensor([seq_lens[i] for i in chunk_seq], device=device)
    last_pos = max(pos + rows - 1 for pos, rows in zip(chunk_first_pos, chunk_rows))
    shape = (num_chunks * num_kv_heads, group * ROW_CHUNK)
    running_max = torch.full(shape, float("-inf"), device=device)
    running_sum = torch.zeros(shape, device=device)
    if sinks is not None:  # a sink is a logit with no value: it starts every row's softmax
        running_max = sinks.float().view(1, num_kv_heads, group, 1).expand(num_chunks, -1, -1, ROW_CHUNK)
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
    out = out.view(num_chunks, num_kv_heads, group, ROW_CHUNK, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_chunks, ROW_CHUNK, num_heads, head_dim).to(query.dtype)
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
