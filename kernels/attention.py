"""Triton paged attention for a flat mixed batch: decode rows, prefill chunks and prefill on cached context.

Layouts: `query`/`out` `[num_tokens, num_heads, head_dim]` (last dim contiguous), caches
`[num_blocks, block_size, num_kv_heads, head_dim]`, and the `AttentionMetadata` of `batchllm.forward_context`.
Query token j of sequence i sits at absolute position `seq_lens[i] - query_len_i + j` and sees the keys at
positions `<=` its own; query head h reads KV head `h // (num_heads // num_kv_heads)`. Rows past
`query_start_loc[num_seqs]` (batch padding) are written as zeros, like the reference.

One program handles BLOCK_Q query tokens of one sequence for all query heads of one KV head: the group's
heads are packed into the M dimension of the tile (`BLOCK_M = BLOCK_Q * GROUP_P2`), so a decode row of a GQA
model still gives `tl.dot` 16 rows and K/V are read once per group instead of once per query head.

Program → (sequence, query block) without the host: query blocks are numbered so that sequence i's first
block is `query_start_loc[i] // BLOCK_Q + i`, which is monotone in i and leaves every sequence at least
`cdiv(query_len_i, BLOCK_Q)` numbers; a program finds its sequence by binary search over `query_start_loc`.
The grid is therefore `num_tokens // BLOCK_Q + num_seqs + 1` programs long (the `+ 1` is a pseudo-sequence
covering the padding rows), sized by host shapes only. A `(num_seqs, cdiv(max_query_len, BLOCK_Q))` grid
would launch hundreds of thousands of idle programs for a batch of one long prefill and many decode rows.
A decode-only batch (`max_query_len == 1` and as many tokens as sequences, which the host knows: a decode CUDA
graph's step, padded rows included) takes that grid instead, one program per sequence and KV head (the sequences of
a head adjacent in launch order, which measured fastest, benchmarks/README.md): the
search is a chain of dependent loads that a short-context decode program would otherwise wait on first, and a
fifth of the general grid's programs there have no query block and exit. A chunked-prefill step's leading decode
rows (`AttentionMetadata.num_decodes`, counted on the host) take that grid and the decode tile in a launch of their
own; the general grid then starts after them (`token_offset`: as many tokens as sequences).

Split-KV (flash-decoding): with NUM_SPLITS > 1 each program covers one of NUM_SPLITS equal slices of its
query block's keys and writes its unnormalised partial `(max, sum, acc)`; a second kernel merges the slices.
Slices are cut on the device from `seq_lens`, so the result does not depend on NUM_SPLITS: a CUDA graph
captured with one value stays correct for any sequence lengths. No host syncs happen anywhere here.

FP8 caches (float8_e4m3fn, per-layer scales): K/V tiles are converted in registers (exact) to float16 for
16-bit queries, one instruction per pair on Hopper where E4M3 → bfloat16 takes a detour through float32,
and the queries and probabilities with them (float32 queries stay float32); `k_scale` folds into the score
scale and `v_scale` into the output, so no per-element multiply.

Per-layer variants (`batchllm.model.attention.AttentionParams`), each a constexpr switch so that a layer without
it compiles to the plain kernel: a sliding window (a query at position p sees keys in `(p - window, p]`; the key
loop starts at the tile holding the first key the query block can see, so a decode row reads only the window's
blocks, and split-KV cuts the window, not the whole sequence), logit soft-capping (`cap * tanh(score / cap)`
on the scaled score), and sinks (a logit per query head in the softmax denominator with no value: the running
max and sum start from it, in slice 0 only when the keys are split).

Key limits (`AttentionMetadata.key_limit`, Gemma 3's bidirectional image tokens), also a constexpr switch: a row's
upper bound is its limit instead of its position, and a query block's key loop (and the split-KV arithmetic) ends
after the block's largest limit instead of its last row's position. The window still starts from the position.

Batch invariance (`invariant=True`, for `deterministic=True`): a row's result then depends only on its sequence's
K/V and its position, never on the rest of the batch. What it would otherwise depend on is fixed: one launch shape
(`invariant_tile`, the decode tile, for prefill rows too: the reductions over a key tile (`tl.sum`, `tl.dot`) follow
the tile's layout, which the rows, warps and key-tile width set) and no split-KV (the merge's order would follow the
number of slices). The key tiles are already aligned to absolute positions from 0: `[t * TILE_N, (t + 1) * TILE_N)`,
whatever is cached or chunked. The loop's ends do move with the batch (a block's last row sets the end, a block's
first row the window start, rounded down to a tile), but only over tiles where the row sees no key, and such a tile
leaves its state bit for bit as it was: its probabilities are exactly 0, so the running max stays, the rescale is
exp2(0) = 1 and the sum and accumulator add exact zeros (before the row's first visible key its state is the
initial one, which a masked tile also keeps). Key limits keep this: the loop then ends at the block's largest limit,
and the tiles past a row's own limit are again tiles where it sees no key.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels.attention_kernels import merge_splits_kernel, paged_attention_kernel
from batchllm.kernels.reference import FP8_DTYPE

# Split-KV heuristic. Below SPLIT_TARGET_PROGRAMS_PER_SM * SMs programs the GPU is not full; each slice keeps
# at least MIN_SPLIT_TOKENS keys so the partials' extra traffic stays small next to the K/V reads.
SPLIT_TARGET_PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16


@dataclass(slots=True)
class SplitKVWorkspace:
    """Scratch for the split-KV partials, allocated once (e.g. before CUDA-graph capture) and reused.

    `partial_acc [max_num_tokens, num_heads, max_splits, head_dim]`, `partial_max`/`partial_sum`
    `[max_num_tokens, num_heads, max_splits]`, all float32; maxima are in log2 units (scores times
    `scale * log2(e)`). Only the slices a launch writes are read back, so the contents never need clearing.
    """

    partial_acc: torch.Tensor
    partial_max: torch.Tensor
    partial_sum: torch.Tensor

    @classmethod
    def allocate(cls, max_num_tokens: int, num_heads: int, head_dim: int, max_splits: int = MAX_SPLITS,
                 device: torch.device | str = "cuda") -> SplitKVWorkspace:
        acc = torch.empty(max_num_tokens, num_heads, max_splits, head_dim, dtype=torch.float32, device=device)
        stats = (max_num_tokens, num_heads, max_splits)
        return cls(acc, torch.empty(stats, dtype=torch.float32, device=device),
                   torch.empty(stats, dtype=torch.float32, device=device))

    @property
    def max_num_tokens(self) -> int:
        return self.partial_acc.shape[0]

    @property
    def max_splits(self) -> int:
        return self.partial_acc.shape[2]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """How many KV slices per sequence: 1 (the single-pass kernel) unless the GPU would sit mostly idle.

    Only decode-only batches split (`max_query_len == 1`): with prefill tokens there are enough query
    blocks to fill the GPU, and the scratch would grow with the token count. A decode batch launches
    `num_seqs * num_kv_heads` working programs; below `SPLIT_TARGET_PROGRAMS_PER_SM` per SM each sequence's
    keys are cut into enough slices to get there, but never slices shorter than `MIN_SPLIT_TOKENS` keys
    (short contexts are cheap anyway) and never more than `MAX_SPLITS`.
    """
    if max_query_len > 1:
        return 1
    wanted = math.ceil(SPLIT_TARGET_PROGRAMS_PER_SM * num_sms / max(num_seqs * num_kv_heads, 1))
    return max(1, min(wanted, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: TileConfig | None = None,
    *,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Causal paged attention of `query [T, num_heads, head_dim]`; returns `out` (allocated if not given).

    `num_splits=None` picks the variant with `choose_num_splits`; 1 forces the single-pass kernel, more
    forces split-KV. Split-KV uses `workspace` if given (it caps the split count) and allocates one
    otherwise. `tile` overrides the launch shape that `tile_config` picks (benchmarks/decode_attention.py sweeps
    it); results do not depend on it. Every launch parameter comes from tensor shapes and the metadata's host
    ints, never from device values, so the call can be captured in a CUDA graph.

    `sliding_window`, `logit_soft_cap` and `sinks [num_heads]` (float32 logits) are the options of
    `reference.paged_attention`, with the same meaning, as is `metadata.key_limit` (which the kernel clamps into
    `[position, seq_len - 1]` rather than checks: a check would sync). `invariant=True` makes each row's result
    independent of the batch (see the module docstring), with key limits too: it takes `invariant_tile` and one
    pass, so `tile` and `num_splits` > 1 are refused with it.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = metadata.seq_lens.shape[0]
    if k_cache.dtype != FP8_DTYPE:
        k_scale = v_scale = 1.0  # the scales belong to FP8 caches; a model-dtype cache holds the values themselves
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if k_cache.stride() != v_cache.stride() or query.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention_triton needs unit-stride head dims and K/V caches of one layout")
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected one logit per query head ({num_heads},)")
    if invariant:
        if tile is not None or (num_splits or 1) != 1:
            raise ValueError("paged_attention_triton(invariant=True) fixes the launch shape and runs one pass: "
                             f"got tile={tile} and num_splits={num_splits}")
        num_splits = 1
    if num_splits is None:
        # A window bounds the keys any query reads, and so the work there is to split.
        keys_read = metadata.max_seq_len if sliding_window is None else min(metadata.max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, metadata.max_query_len, keys_read,
                                       _num_sms(query.device))
    if workspace is not None:
        num_splits = min(num_splits, workspace.max_splits)

    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if invariant:
        tile = invariant_tile(group_p2, head_dim, query.dtype, kv_fp8)
    constants = dict(
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(triton.next_power_of_2(head_dim), 16),
        # fp32 models get fp32 products; on the GPU the default would round operands to tf32.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
        KV_DOT_DTYPE=tl.float32 if query.dtype == torch.float32 else tl.float16,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logit_soft_cap is not None, USE_SINKS=sinks is not None,
        HAS_KEY_LIMIT=metadata.key_limit is not None,
    )
    scalars = (scale * k_scale * math.log2(math.e), v_scale, query.stride(0), query.stride(1), k_cache.stride(0),
               k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
               # Scores are kept in log2 units, so the cap is too: cap * tanh(s / cap) scales with s.
               sliding_window or 0, (logit_soft_cap or 0.0) * math.log2(math.e), sinks if sinks is not None else query,
               metadata.key_limit if metadata.key_limit is not None else metadata.seq_lens,
               out, out.stride(0), out.stride(1))

    def launch(first_seq: int, end_seq: int, decode: bool, tile: TileConfig, num_splits: int = 1,
               workspace: SplitKVWorkspace | None = None) -> None:
        """One launch over sequences `[first_seq, end_seq)`, whose query tokens start at token `first_seq` (the
        sequences before them are decode rows, one token each); the padding rows after the last sequence are the
        last launch's. Split-KV partials go to `workspace`."""
        block_q = tile.block_m // group_p2
        num_launched = end_seq - first_seq
        if decode:
            grid = (num_launched * num_kv_heads, 1, num_splits)
        else:
            grid = ((num_tokens - first_seq) // block_q + num_launched + 1, num_kv_heads, num_splits)
        if workspace is None:
            partials = (out, out, out, 0, 0, 0, 0, 0)
        else:
            acc, m, s = workspace.partial_acc, workspace.partial_max, workspace.partial_sum
            partials = (acc, m, s, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1))
        # maxnreg is a launch option, beside the constants.
        cap = {} if tile.max_registers is None else dict(maxnreg=tile.max_registers)
        paged_attention_kernel[grid](
            query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            num_launched, num_tokens, first_seq, *scalars, *partials, **constants, BLOCK_Q=block_q,
            TILE_N=tile.tile_n, NUM_SPLITS=num_splits, DECODE=decode, num_warps=tile.num_warps,
            num_stages=tile.num_stages, **cap)

    decodes = metadata.num_decodes
    split_decodes = num_splits == 1 and not invariant and 0 < decodes < num_seqs
    decode_tile = (tile or tile_config(1, group_p2, head_dim, query.dtype, kv_fp8)) if split_decodes else None
    tile = tile or tile_config(metadata.max_query_len, group_p2, head_dim, query.dtype, kv_fp8)
    if split_decodes:
        # A chunked-prefill step: its leading decode rows go apart to the decode grid and tile (in the prefill tile
        # each would fill one of the tile's rows, after a search for its sequence), the rest after them.
        launch(0, decodes, True, decode_tile)
        launch(decodes, num_seqs, False, tile)
        return out
    # A decode-only batch (one query token a sequence, no padding rows) maps programs to sequences directly.
    decode = metadata.max_query_len == 1 and num_tokens == num_seqs
    if num_splits == 1:
        launch(0, num_seqs, decode, tile)
        return out
    if workspace is None:
        workspace = SplitKVWorkspace.allocate(num_tokens, num_heads, head_dim, num_splits, query.device)
    elif workspace.max_num_tokens < num_tokens:
        raise ValueError(f"workspace holds {workspace.max_num_tokens} tokens, the batch has {num_tokens}")
    launch(0, num_seqs, decode, tile, num_splits, workspace)
    return merge_splits(out, workspace, metadata, num_splits)


def merge_splits(out: torch.Tensor, workspace: SplitKVWorkspace, metadata: AttentionMetadata,
                 num_splits: int) -> torch.Tensor:
    """Merge the `num_splits` partials a split-KV launch wrote into `workspace` into `out [T, num_heads, head_dim]`
    (padding rows past the last sequence's tokens become zeros)."""
    num_tokens, num_heads, head_dim = out.shape
    acc, m, s = workspace.partial_acc, workspace.partial_max, workspace.partial_sum
    merge_splits_kernel[(num_tokens, num_heads)](
        out, acc, m, s, metadata.query_start_loc, metadata.seq_lens.shape[0], out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        NUM_SPLITS=num_splits, NUM_SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), num_warps=4,
    )
    return out


@dataclass(frozen=True, slots=True)
class TileConfig:
    """A launch shape of `paged_attention_kernel`: `block_m` tile rows (query tokens x group heads), `tile_n` keys
    per K/V tile, warps, software-pipelining stages of the key loop, and a register cap."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int = 3  # Triton's default on NVIDIA GPUs
    # A cap on registers a thread (the compiler spills past it): None lets it take up to 255, which on sm_90 holds the
    # FP8 decode tile to two programs an SM (benchmarks/kernel_resources.py).
    max_registers: int | None = None


def tile_config(max_query_len: int, group_p2: int, head_dim: int, query_dtype: torch.dtype = torch.bfloat16,
                kv_fp8: bool = False) -> TileConfig:
    """The launch shape for a batch. Correctness does not depend on the choice.

    Batches with prefill tokens take 64 rows, so each K/V tile loaded serves four times more queries; 32-key
    tiles with 8 warps compile for sm_90 without register spills at head_dim 128. Decode-only batches take the
    smallest `tl.dot` tile, 16 rows, and the key tile that moved the most bytes per second in
    `benchmarks/decode_attention.py`'s sweep on an H100: with 16-bit queries, 64 keys and 2 warps at head_dim 64,
    32 keys and 2 warps at 128 (2026-12-06); for FP8 caches 64 keys, 4 warps, 2 stages and at most 128 registers a
    thread, the best launch summed over W7's 512 rows x 192 keys and 256 x 1,500 on llama3-8b's shape (2026-12-07:
    121 and 391 us against 145 and 407 for the uncapped 128-key, 3-stage tile before it, which took 200 registers
    and so held two programs an SM). Float32 queries and head_dim 256 keep 32 keys and 4 warps, which fit the
    registers and shared memory those wider tiles would exceed.
    """
    if max_query_len * group_p2 > 16:
        return TileConfig(max(64, group_p2), 32, 8)
    rows = max(16, group_p2)
    if query_dtype == torch.float32 or head_dim > 128:
        return TileConfig(rows, 32, 4)
    if kv_fp8:
        return TileConfig(rows, 64, 4, num_stages=2, max_registers=128)
    return TileConfig(rows, 64, 2) if head_dim <= 64 else TileConfig(rows, 32, 2)


def invariant_tile(group_p2: int, head_dim: int, query_dtype: torch.dtype, kv_fp8: bool = False) -> TileConfig:
    """The one launch shape of `invariant=True`, for every batch: `tile_config`'s decode tile (16 rows, or the group),
    for prefill rows too. Decode steps, where a deterministic run spends its attention time, then run as fast as
    the default's single pass; a prefill block covers 16 / group query tokens, so each K/V tile serves fewer of them
    than the 64-row prefill tile would (mostly from L2: one sequence's keys per head are a few hundred KB), a cost
    that grows with the prompt's length squared but stays small beside the prompt's GEMMs at a few thousand tokens.
    A prefill block and a decode row of the same tile compile to the same kernel (the constants are the tile's)."""
    return tile_config(1, group_p2, head_dim, query_dtype, kv_fp8)


@functools.cache
def _num_sms(device: torch.device) -> int:
    # Off the GPU (the Triton interpreter) the value only feeds the heuristic: assume an H200.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
