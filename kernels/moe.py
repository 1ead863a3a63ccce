"""Triton fused mixture-of-experts MLP: `moe_reference.fused_moe` as two grouped GEMMs over expert-sorted rows.

A row is one (token, slot) pair, `pair = token * k + slot`. `align_pairs_by_expert` sorts the pairs by expert
on the device and pads each expert's segment to a multiple of BLOCK_M, so that every row block belongs to a
single expert; padding entries hold the sentinel `T * k` and are masked. Experts no token chose get no block,
so their weights are never read. Then:

1. gate/up: `x[token] @ w13[e]^T` for the gate's and up's BLOCK_N columns at once (two accumulators), bias and
   the gated activation in the epilogue, stored in x's dtype as `intermediate [T * k, I]` (row = pair);
2. down: `intermediate[pair] @ w2[e]^T`, bias, times the pair's routing weight, stored in float32 as
   `weighted [T * k, H]`; the k slots of a token are then summed with torch (`view(T, k, H).sum(1)`).

Storing the k weighted rows and summing after, rather than float32 atomic adds into `[T, H]`: the sum is
deterministic (one order per shape, so a CUDA-graph step padded to its captured size equals the eager step),
and no zero-filled buffer is needed. The price is `k * H * 4` bytes written and read back per token, small
next to the expert weights at decode and a few percent of the GEMMs' time at prefill.

Quantized experts are dequantized in registers, tile by tile, and multiplied on the 16-bit tensor cores
(weight-only quantization: at decode the time is the weights' bytes, which is what quantization cuts):
`W_FORMAT` FP8 (E4M3 codes are exact in bf16; the row's float32 scale multiplies the accumulator once, after
the K loop) or MXFP4 (E2M1 values times their block's power of two, exact in bf16: `tl.dot_scaled` for 16-bit
activations, a hand decoding for float32; see moe_mxfp4.py) or 4- / 8-bit integers (GPTQ, AWQ: `(code - zero)
* scale` per group, rounded to the dot's dtype, which is also what expanding them gives; moe_int.py). Where
decoding in registers does not pay, the experts are expanded for the dense kernel first (`expands_experts`). See
`moe_reference.dequantize_expert` for the formats.

Both grids are `(max_blocks * n_tiles,)` with `max_blocks` an upper bound fixed by T, k, E and BLOCK_M: the host
never reads the number of padded rows (no sync, CUDA-graph safe); programs past it return at once. Block sizes
follow from the shapes by fixed rules (no autotuning, as for the other kernels; `choose_tiles` says which were
timed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchllm.kernels.moe_int import dequantize_int_triton, int_groups, int_weight_tile
from batchllm.kernels.moe_mxfp4 import dequantize_mxfp4_triton, mx_tile_dot, mx_tile_scaled_dot
from batchllm.kernels.moe_reference import MOE_ACTIVATIONS, MXFP4_BLOCK, SWIGLUOAI_ALPHA

_ALPHA = tl.constexpr(SWIGLUOAI_ALPHA)  # jit code reads only constexpr globals
DENSE, FP8, MXFP4, INT = 0, 1, 2, 3  # W_FORMAT

_FP8, _MXFP4, _INT = tl.constexpr(FP8), tl.constexpr(MXFP4), tl.constexpr(INT)


def weight_format(w13: torch.Tensor, w13_scale: torch.Tensor | None) -> int:
    """The experts' storage, from their dtype: MXFP4 (uint8 packed), integers (int32 packed), FP8 (E4M3) or dense
    (the model's dtype)."""
    if w13.dtype == torch.uint8:
        return MXFP4
    if w13.dtype == torch.int32:
        return INT
    return FP8 if w13_scale is not None else DENSE


def expands_experts(w_format: int, num_pairs: int, num_experts: int, dtype: torch.dtype) -> bool:
    """Whether quantized experts are expanded to `dtype` for the dense kernel rather than decoded in registers.

    Float32 activations decode MXFP4 by hand, slower than expanding once any expert has more than one row (an H100,
    gpt-oss-20b experts: T = 1 0.35 ms against ~0.65 ms expanded; T = 256 3.3 ms against ~1.2 ms); integer experts
    follow that rule, untimed. 16-bit activations take MXFP4 through `tl.dot_scaled` up to
    `MXFP4_EXPAND_ABOVE_PAIRS` token-expert pairs and expand past it: `benchmarks/fused_moe.py`, one H100, gpt-oss-20b
    experts, µs per layer in a CUDA graph, `tl.dot_scaled` / expanded: T = 1 246 / 836, 64 789 / 1,342, 256 1,253 /
    1,377, 1,024 2,369 / 1,566, 8,192 11,105 / 4,073 (Triton 3.6 emulates the bf16 x e2m1 product on Hopper; its
    cost grows with T, the expansion's does not)."""
    if w_format == MXFP4 and dtype in (torch.bfloat16, torch.float16):
        return num_pairs > MXFP4_EXPAND_ABOVE_PAIRS
    return w_format in (MXFP4, INT) and num_pairs > num_experts


# Token-expert pairs: 256 tokens at gpt-oss's top-4, the largest measured batch where `tl.dot_scaled` won (the two
# lines cross near 360 tokens by interpolation).
MXFP4_EXPAND_ABOVE_PAIRS = 1024


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int  # rows (pairs) per block, all of one expert
    block_n: int  # output columns per program (twice this for gate/up: the gate's and up's tiles)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(num_tokens: int, top_k: int, num_experts: int) -> Tiles:
    """Tiles by the mean rows an expert gets: small row blocks at decode (fewer padding rows, each a wasted
    multiply of the expert's weight tile), larger ones at prefill (fewer re-reads of the weights)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return Tiles(16, 64, 64)
    if rows_per_expert <= 64:
        return Tiles(32, 64, 64)
    # benchmarks/fused_moe.py --sweep, Qwen3-30B-A3B experts at 8,192 tokens on an H100: 1.31x the 64-row tiles.
    return Tiles(128, 128, 64, num_warps=8)


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the `T * k` pairs by expert (stably: by pair within an expert) and pad each expert's segment to a
    multiple of `block_m`, on the device and without a host sync.

    Returns `sorted_pairs [max_rows]` int32 (pair ids; `T * k` in padding and past the end), `block_experts
    [max_rows // block_m]` int32 (the expert of each block; `num_experts` past the end) and `num_rows [1]` int32
    (the padded row count), where `max_rows` bounds the padded count from T, k and E alone. Ids must be in
    `[0, num_experts)`: checking would read them on the host.
    """
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    sorted_experts, order = torch.sort(flat, stable=True)
    # starts[e]: the first sorted position of expert e (searchsorted, not bincount: bincount syncs on CUDA).
    starts = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=device, dtype=flat.dtype))
    counts = starts[1:] - starts[:-1]
    padded_ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    max_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    positions = torch.arange(num_pairs, device=device)
    dest = padded_starts[sorted_experts] + positions - starts[sorted_experts]
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device, dtype=padded_ends.dtype)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts, padded_ends[-1:].to(torch.int32)


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, swiglu_limit: float | None = None,
                     w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     w13_zero: torch.Tensor | None = None, w2_zero: torch.Tensor | None = None) -> torch.Tensor:
    """See `moe_reference.fused_moe`. hidden's rows may be strided; every last dimension must be dense."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    w_format = weight_format(w13, w13_scale)
    if expands_experts(w_format, num_tokens * top_k, num_experts, hidden.dtype):
        if w_format == MXFP4:
            w13, w2 = (dequantize_mxfp4_triton(w, s, hidden.dtype) for w, s in ((w13, w13_scale), (w2, w2_scale)))
        else:
            w13 = dequantize_int_triton(w13, w13_scale, w13_zero, hidden_size, hidden.dtype)
            w2 = dequantize_int_triton(w2, w2_scale, w2_zero, intermediate_size, hidden.dtype)
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit)
    per_word = {MXFP4: 2, INT: hidden_size // w13.shape[2]}.get(w_format, 1)  # weights per stored element
    assert w13.shape == (num_experts, 2 * intermediate_size, hidden_size // per_word), (w13.shape, w2.shape)
    assert w2.shape == (num_experts, hidden_size, intermediate_size // per_word), (w13.shape, w2.shape)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    if w_format == MXFP4:
        assert hidden_size % MXFP4_BLOCK == 0 and intermediate_size % MXFP4_BLOCK == 0, (hidden_size, w2.shape)
        assert w13_scale.shape == (*w13.shape[:2], hidden_size // MXFP4_BLOCK), w13_scale.shape
        assert w2_scale.shape == (*w2.shape[:2], intermediate_size // MXFP4_BLOCK), w2_scale.shape
    elif w_format == FP8:
        assert w13_scale.shape == w13.shape[:2] and w2_scale.shape == w2.shape[:2], (w13_scale.shape, w2_scale.shape)
    elif w_format == INT:
        w13_group = int_groups(w13, w13_scale, w13_zero, hidden_size)
        w2_group = int_groups(w2, w2_scale, w2_zero, intermediate_size)
    if w_format != DENSE:
        assert w13_scale.stride(-1) == 1 and w2_scale.stride(-1) == 1, (w13_scale.stride(), w2_scale.stride())
    assert w13_bias is None or w13_bias.shape == (num_experts, 2 * intermediate_size), w13_bias.shape
    assert w2_bias is None or w2_bias.shape == (num_experts, hidden_size), w2_bias.shape
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, (hidden.stride(), w13.stride())
    if num_tokens == 0:
        return hidden.new_empty(num_tokens, hidden_size)
    tiles = choose_tiles(num_tokens, top_k, num_experts)
    sorted_pairs, block_experts, num_rows = align_pairs_by_expert(topk_ids, num_experts, tiles.block_m)
    num_pairs, max_blocks = num_tokens * top_k, block_experts.numel()
    # fp32 models get fp32 products; on the GPU the default would round operands to tf32.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=precision,
                  W_FORMAT=w_format, BITS=32 // per_word if w_format == INT else 4, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages)
    w13_scale, w2_scale = (w13, w2) if w_format == DENSE else (w13_scale, w2_scale)  # placeholders when unread
    if w_format != INT:  # placeholders, unread
        w13_zero, w2_zero, w13_group, w2_group = w13_scale, w2_scale, 1, 1

    intermediate = torch.empty(num_pairs, intermediate_size, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(max_blocks * triton.cdiv(intermediate_size, tiles.block_n),)](
        hidden, w13, w13_scale, w13_zero, w13 if w13_bias is None else w13_bias, intermediate, sorted_pairs,
        block_experts, num_rows, num_pairs, top_k, hidden_size, intermediate_size, hidden.stride(0), w13.stride(0),
        w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), 0 if w13_bias is None else w13_bias.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit),
        HAS_BIAS=w13_bias is not None, ACTIVATION=activation, CLAMP=swiglu_limit is not None, GROUP=w13_group,
        **common,
    )
    weighted = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _down_kernel[(max_blocks * triton.cdiv(hidden_size, tiles.block_n),)](
        intermediate, w2, w2_scale, w2_zero, w2 if w2_bias is None else w2_bias, topk_weights.reshape(-1).float(),
        weighted, sorted_pairs, block_experts, num_rows, num_pairs, intermediate_size, hidden_size, w2.stride(0),
        w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), 0 if w2_bias is None else w2_bias.stride(0),
        HAS_BIAS=w2_bias is not None, GROUP=w2_group, **common,
    )
    return weighted.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)


@triton.jit
def _block_rows(sorted_pairs_ptr, block_experts_ptr, num_rows_ptr, num_pairs, n_tiles, BLOCK_M: tl.constexpr):
    """Program `program_id(0)`'s row block, expert, column tile and pairs (int64; whether each is real, not
    padding), and whether the block lies past the padded rows (the program then has nothing to do)."""
    pid = tl.program_id(0)
    block, tile = pid // n_tiles, pid % n_tiles
    past_end = block * BLOCK_M >= tl.load(num_rows_ptr)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, tile, pairs, pairs < num_pairs, past_end


@triton.jit
def _weight_tile(rows_ptr, scale_rows, zero_rows, k, mask, DTYPE: tl.constexpr, W_FORMAT: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr):
    """The `[BLOCK_K, BLOCK_N]` tile `w^T` (K index `k`, one column per weight row) of a dense, FP8 or integer
    weight in the dot's dtype, given pointers to the tile's weight rows `[1, N]` (and, for integers, to their
    scale and zero point rows)."""
    if W_FORMAT == _INT:
        tile = int_weight_tile(rows_ptr, scale_rows, zero_rows, k, mask, DTYPE, BITS, GROUP)
    else:
        tile = tl.load(rows_ptr + k[:, None], mask=mask, other=0.0).to(DTYPE)
    return tile


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr,
                    num_rows_ptr, num_pairs, top_k, hidden_size, inter_size, stride_x, stride_w_expert, stride_w_row,
                    stride_s_expert, stride_s_row, stride_bias_expert, swiglu_limit, HAS_BIAS: tl.constexpr,
                    ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, W_FORMAT: tl.constexpr,
                    BITS: tl.constexpr, GROUP: tl.constexpr):
    """`out[pair, n] = act(x[token] . w[e, n] + b[e, n], x[token] . w[e, I + n] + b[e, I + n])` for the block's
    pairs and the tile's intermediate columns n, `token = pair // top_k`."""
    n_tiles = tl.cdiv(inter_size, BLOCK_N)
    expert, tile, pairs, real, past_end = _block_rows(sorted_pairs_ptr, block_experts_ptr, num_rows_ptr, num_pairs,
                                                      n_tiles, BLOCK_M)
    if past_end:
        return
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < inter_size
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (pairs // top_k)[:, None] * stride_x
    gate_cols = w_ptr + expert * stride_w_expert + cols[None, :].to(tl.int64) * stride_w_row
    up_cols = gate_cols + inter_size * stride_w_row
    gate_scales = scale_ptr + expert * stride_s_expert + cols[None, :].to(tl.int64) * stride_s_row
    up_scales = gate_scales + inter_size * stride_s_row
    gate_zeros = zero_ptr + expert * stride_s_expert + cols[None, :].to(tl.int64) * stride_s_row
    up_zeros = gate_zeros + inter_size * stride_s_row
    dtype = x_ptr.dtype.element_ty
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_FORMAT == _MXFP4 and dtype != tl.float32:
        gate_scale_cols = scale_ptr + expert * stride_s_expert + cols[:, None].to(tl.int64) * stride_s_row
        for k0 in range(0, hidden_size, BLOCK_K):
            gate += mx_tile_scaled_dot(x_rows, real[:, None], gate_cols, gate_scale_cols, in_cols, k0, hidden_size,
                                       BLOCK_K, dtype)
            up += mx_tile_scaled_dot(x_rows, real[:, None], up_cols, gate_scale_cols + inter_size * stride_s_row,
                                     in_cols, k0, hidden_size, BLOCK_K, dtype)
    elif W_FORMAT == _MXFP4:
        for k0 in range(0, hidden_size, BLOCK_K):
            gate += mx_tile_dot(x_rows, real[:, None], gate_cols, gate_scales, in_cols[None, :], k0, hidden_size,
                                BLOCK_K, dtype, DOT_PRECISION)
            up += mx_tile_dot(x_rows, real[:, None], up_cols, up_scales, in_cols[None, :], k0, hidden_size,
                              BLOCK_K, dtype, DOT_PRECISION)
    else:
        for k0 in range(0, hidden_size, BLOCK_K):
            k = k0 + ks
            in_k = k < hidden_size
            x_tile = tl.load(x_rows + k[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
            w_mask = in_k[:, None] & in_cols[None, :]
            gate_tile = _weight_tile(gate_cols, gate_scales, gate_zeros, k, w_mask, dtype, W_FORMAT, BITS, GROUP)
            gate += tl.dot(x_tile, gate_tile, input_precision=DOT_PRECISION)  # [K, N] tiles: w^T
            up_tile = _weight_tile(up_cols, up_scales, up_zeros, k, w_mask, dtype, W_FORMAT, BITS, GROUP)
            up += tl.dot(x_tile, up_tile, input_precision=DOT_PRECISION)
    if W_FORMAT == _FP8:  # FP8: one scale per weight row, i.e. per output column here
        gate *= tl.load(scale_ptr + expert * stride_s_expert + cols, mask=in_cols, other=0.0)[None, :]
        up *= tl.load(scale_ptr + expert * stride_s_expert + inter_size + cols, mask=in_cols, other=0.0)[None, :]
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_bias_expert + cols
        gate += tl.load(bias, mask=in_cols, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + inter_size, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == "gelu_tanh":
        # tanh(z) = 2 sigmoid(2z) - 1; z = sqrt(2 / pi) (g + 0.044715 g^3), as torch's approximate="tanh".
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * z) * up
    else:  # "swigluoai": gpt-oss's clamped SwiGLU
        if CLAMP:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        act = gate * tl.sigmoid(gate * _ALPHA) * (up + 1.0)
    out_ptrs = out_ptr + pairs[:, None] * inter_size + cols[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=real[:, None] & in_cols[None, :])


@triton.jit
def _down_kernel(y_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr,
                 num_rows_ptr, num_pairs, inter_size, hidden_size, stride_w_expert, stride_w_row, stride_s_expert,
                 stride_s_row, stride_bias_expert, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, W_FORMAT: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr):
    """`out[pair, n] = weights[pair] * (y[pair] . w[e, n] + b[e, n])` in float32, for the block's pairs and the
    tile's hidden columns n."""
    n_tiles = tl.cdiv(hidden_size, BLOCK_N)
    expert, tile, pairs, real, past_end = _block_rows(sorted_pairs_ptr, block_experts_ptr, num_rows_ptr, num_pairs,
                                                      n_tiles, BLOCK_M)
    if past_end:
        return
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    y_rows = y_ptr + pairs[:, None] * inter_size
    w_cols = w_ptr + expert * stride_w_expert + cols[None, :].to(tl.int64) * stride_w_row
    w_scales = scale_ptr + expert * stride_s_expert + cols[None, :].to(tl.int64) * stride_s_row
    w_zeros = zero_ptr + expert * stride_s_expert + cols[None, :].to(tl.int64) * stride_s_row
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_FORMAT == _MXFP4 and dtype != tl.float32:
        scale_cols = scale_ptr + expert * stride_s_expert + cols[:, None].to(tl.int64) * stride_s_row
        for k0 in range(0, inter_size, BLOCK_K):
            acc += mx_tile_scaled_dot(y_rows, real[:, None], w_cols, scale_cols, in_cols, k0, inter_size, BLOCK_K,
                                      dtype)
    elif W_FORMAT == _MXFP4:
        for k0 in range(0, inter_size, BLOCK_K):
            acc += mx_tile_dot(y_rows, real[:, None], w_cols, w_scales, in_cols[None, :], k0, inter_size, BLOCK_K,
                               dtype, DOT_PRECISION)
    else:
        for k0 in range(0, inter_size, BLOCK_K):
            k = k0 + ks
            in_k = k < inter_size
            y_tile = tl.load(y_rows + k[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
            w_tile = _weight_tile(w_cols, w_scales, w_zeros, k, in_k[:, None] & in_cols[None, :], dtype, W_FORMAT, BITS,
                                  GROUP)  # w^T
            acc += tl.dot(y_tile, w_tile, input_precision=DOT_PRECISION)
    if W_FORMAT == _FP8:  # FP8: one scale per weight row
        acc *= tl.load(scale_ptr + expert * stride_s_expert + cols, mask=in_cols, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_expert + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs, mask=real, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * hidden_size + cols[None, :], acc, mask=real[:, None] & in_cols[None, :])
