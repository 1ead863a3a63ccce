"""Triton W4A16 / W8A16 GEMM: `x [M, K] @ w`, `w` a K-packed 4- or 8-bit integer weight (`reference.int_matmul`).

`qweight [K * bits // 32, N]` int32 holds `pack = 32 // bits` codes per word, row k of the codes in bits
`bits * (k % pack)` of word row `k // pack`; `w[k, n] = (code - zeros[g, n]) * scales[g, n]` with g the group of
row k (`k // group_size`, or `g_idx[k]` for act-order checkpoints). Three paths, chosen by M (`choose_path`):

- decode (M <= SPLIT_K_MAX_M): one row block of BLOCK_M = 16 or 32 rows, so every weight tile is read and
  dequantized exactly once; K is split over a grid dimension (N alone gives too few programs to fill the GPU),
  each split writing a float32 partial plane that a second kernel sums in a fixed order and casts. Planes rather
  than atomics: the sum is deterministic, and no zero-fill and no cast kernel are needed.
- medium M: the same kernel with larger row blocks (the weight is re-read once per row block).
- prefill (M >= DEQUANT_MIN_M): the GEMM is compute-bound, so the weight is dequantized into a scratch `[K, N]`
  tensor of x's dtype and multiplied by cuBLAS; the dequantization is a few percent of the matmul there.

Both GEMM paths dequantize a [BLOCK_K, BLOCK_N] weight tile in registers: one load of its BLOCK_K / pack word
rows, broadcast over the pack lanes ([rows, pack, BLOCK_N]: each thread unpacks its own words, no shuffles) and
reshaped to [BLOCK_K, BLOCK_N]. The tile is rounded to x's dtype and `tl.dot`-ed with x's tile, accumulating in
float32. Configurations follow from the shapes by fixed rules (no autotuning: CUDA graphs, reproducible CI, one
summation order per shape); the constants below come from `benchmarks/int_gemm.py --sweep` on an H200 (Triton
3.6, benchmarks/results/2026-12-02-int-gemm-h200.json). There the GEMM reads at most about 0.9 TB/s of packed
weight, far from HBM's bandwidth: it is bound by the dequantizing instructions (about nine per weight element
in the compiled loop) and their latency, so it is not yet faster than bf16 cuBLAS at decode sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SPLIT_K_MAX_M = 32  # up to this many rows: the split-K decode configuration ...
DEQUANT_MIN_M = 192  # ... and from this many: dequantize, then cuBLAS (it won at 256 rows, the GEMM at 64)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per path; BLOCK_M 32 for decode batches past 16 rows.
SPLIT_K_BLOCKS = (16, 64, 64, 4, 3)
TILED_BLOCKS = (64, 64, 64, 4, 3)
# K splits: one per SPLIT_K_ROWS rows of K (16 BLOCK_K tiles per program was best or within 5% at every N timed),
# more if the grid would have fewer than MIN_PROGRAMS programs (an H200 has 132 SMs), at most MAX_SPLIT_K (8 and
# 16 were alike at K = 14336), and at most PARTIAL_ROWS / M: the float32 partial planes, split_k * M rows, are
# written and read back.
SPLIT_K_ROWS = 1024
MIN_PROGRAMS = 256
MAX_SPLIT_K = 8
PARTIAL_ROWS = 512
SUM_BLOCK = 1024  # elements per program of the partial-plane sum
DEQUANT_BLOCK_K, DEQUANT_BLOCK_N = 64, 128
# Any int code c < 2**23 ORed into the mantissa of 2**23 is the float 2**23 + c: one logic op instead of an
# int-to-float conversion per weight element; subtracting 2**23 + zero (also exact) leaves code - zero.
EXACT_FLOAT_BITS = tl.constexpr(0x4B000000)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # a multiple of 16 and of 32 // bits
    split_k: int = 1  # at most this many K splits (fewer if K has fewer BLOCK_K tiles)
    num_warps: int = 4
    num_stages: int = 3


def choose_path(m: int) -> str:
    """"split-k" (decode), "tiled" or "dequantize" (prefill), by the number of rows."""
    return "split-k" if m <= SPLIT_K_MAX_M else "tiled" if m < DEQUANT_MIN_M else "dequantize"


def gemm_config(path: str, m: int, n: int, k: int) -> GemmConfig:
    """The configuration of the "split-k" or "tiled" GEMM for `[m, k] @ [k, n]`."""
    block_m, block_n, block_k, warps, stages = SPLIT_K_BLOCKS if path == "split-k" else TILED_BLOCKS
    if path == "split-k" and m > 16:
        block_m = 32
    tiles = max(1, triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
    split_k = max(triton.cdiv(k, SPLIT_K_ROWS), round(MIN_PROGRAMS / tiles))
    split_k = max(1, min(split_k, MAX_SPLIT_K, triton.cdiv(k, block_k), PARTIAL_ROWS // max(m, 1)))
    return GemmConfig(block_m, block_n, block_k, split_k, num_warps=warps, num_stages=stages)


def int_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                      group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """See `reference.int_matmul`: `[M, N]` in x's dtype. x's rows must be unit-stride."""
    path = choose_path(x.shape[0])
    if path == "dequantize":
        return x @ dequantize_int_triton(qweight, scales, zeros, bits, group_size, g_idx, dtype=x.dtype)
    config = gemm_config(path, x.shape[0], qweight.shape[1], x.shape[1])
    return int_gemm_triton(x, qweight, scales, zeros, bits, group_size, g_idx, config)


def _check(qweight, scales, zeros, bits, group_size, g_idx, k):
    assert bits in (4, 8), bits
    assert qweight.dtype == torch.int32 and qweight.shape[0] * (32 // bits) == k, (qweight.dtype, qweight.shape, k)
    assert scales.dtype == torch.float32 and zeros.dtype == torch.uint8 and scales.shape == zeros.shape
    assert qweight.stride(1) == 1 and scales.stride() == zeros.stride() and scales.stride(1) == 1
    # Without g_idx a word's rows share a group: group boundaries fall on word boundaries. The last group may be
    # partial (K not a multiple of group_size: scales has ceil(K / group_size) rows).
    assert g_idx is not None or group_size % 8 == 0, group_size
    assert g_idx is not None or scales.shape[0] == -(-k // group_size), (scales.shape, k, group_size)
    assert g_idx is None or (g_idx.dtype == torch.int32 and g_idx.shape == (k,) and g_idx.is_contiguous())


def int_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    group_size: int, g_idx: torch.Tensor | None, config: GemmConfig) -> torch.Tensor:
    """The in-register dequantizing GEMM (the decode and medium paths) with an explicit configuration."""
    m, k = x.shape
    n = qweight.shape[1]
    _check(qweight, scales, zeros, bits, group_size, g_idx, k)
    assert x.stride(1) == 1 and config.block_k % (32 // bits) == 0, (x.stride(), config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    # Split s covers rows [s * chunk, (s + 1) * chunk) of K: whole BLOCK_K tiles, the last one perhaps short.
    chunk = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, chunk)
    partials = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split_k)
    _int_gemm_kernel[grid](
        x, qweight, scales, zeros, qweight if g_idx is None else g_idx, partials, m, n, k, chunk, x.stride(0),
        qweight.stride(0), scales.stride(0), group_size, BITS=bits, HAS_G_IDX=g_idx is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        # fp32 inputs get fp32 products; on the GPU the default would round operands to tf32.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](partials, out, m * n, SPLIT_K=split_k, BLOCK=SUM_BLOCK)
    return out


def dequantize_int_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                          group_size: int, g_idx: torch.Tensor | None = None,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`reference.dequantize_int` rounded to `dtype`: a contiguous `[K, N]` weight."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    _check(qweight, scales, zeros, bits, group_size, g_idx, k)
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    if k and n:
        grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, DEQUANT_BLOCK_K))
        _dequantize_kernel[grid](qweight, scales, zeros, qweight if g_idx is None else g_idx, w, n, k,
                                 qweight.stride(0), scales.stride(0), group_size, BITS=bits,
                                 HAS_G_IDX=g_idx is not None, BLOCK_K=DEQUANT_BLOCK_K, BLOCK_N=DEQUANT_BLOCK_N)
    return w


@triton.jit
def _exact_float(code):
    return (code | EXACT_FLOAT_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, k_end, cols, n, stride_q, stride_s,
                     group_size, DTYPE: tl.constexpr, BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows `k0 .. k0 + BLOCK_K` of w (k0 a multiple of pack) at columns `cols`, `[BLOCK_K, BLOCK_N]` in DTYPE;
    zero at rows from k_end (a multiple of pack) and at columns from n."""
    PACK: tl.constexpr = 32 // BITS
    word_rows = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    lanes = tl.arange(0, PACK)
    in_rows = word_rows < k_end // PACK
    mask = in_rows[:, None] & (cols < n)[None, :]
    words = tl.load(qweight_ptr + word_rows[:, None] * stride_q + cols[None, :], mask=mask, other=0)
    codes = (words[:, None, :] >> (lanes * BITS)[None, :, None]) & ((1 << BITS) - 1)  # [rows, PACK, BLOCK_N]
    if HAS_G_IDX:  # each row its own group: gather the scale and zero rows per K row
        rows = word_rows[:, None] * PACK + lanes[None, :]
        groups = tl.load(g_idx_ptr + rows, mask=in_rows[:, None], other=0)[:, :, None]
    else:  # one group per word row, shared by its PACK lanes (repeated rows of a group hit the cache)
        groups = (word_rows * PACK // group_size)[:, None, None]
    group_ptrs = groups * stride_s + cols[None, None, :]
    scale = tl.load(scales_ptr + group_ptrs, mask=mask[:, None, :], other=0.0)
    zero = tl.load(zeros_ptr + group_ptrs, mask=mask[:, None, :], other=0).to(tl.int32)
    w = ((_exact_float(codes) - _exact_float(zero)) * scale).to(DTYPE)
    return tl.reshape(w, (BLOCK_K, BLOCK_N))  # row k0 + r * PACK + lane is [r, lane]: row-major order


@triton.jit
def _int_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, m, n, k, chunk, stride_x,
                     stride_q, stride_s, group_size, BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Grid `(cdiv(n, BLOCK_N), cdiv(m, BLOCK_M), split_k)`; N tiles vary fastest, so programs running together
    share x's rows. Split s's sum over its `chunk` rows of K goes to plane s of out, contiguous `[split_k, m, n]`
    (float32 partial sums, or the output itself in x's dtype when there is one split)."""
    split = tl.program_id(2)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = rows < m
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    k_start = split * chunk
    k_end = tl.minimum(k, k_start + chunk)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_tile = tl.load(x_rows + ks[None, :], mask=in_m[:, None] & (ks < k_end)[None, :], other=0.0)
        w_tile = _dequantize_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, k_end, cols, n, stride_q,
                                  stride_s, group_size, x_ptr.dtype.element_ty, BITS, HAS_G_IDX, BLOCK_K, BLOCK_N)
        acc += tl.dot(x_tile, w_tile, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + split.to(tl.int64) * m * n + rows.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & (cols < n)[None, :])


@triton.jit
def _sum_splits_kernel(partials_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """`out = sum of the SPLIT_K planes of partials` (contiguous, numel elements each), in plane order."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    acc = tl.load(partials_ptr + offsets, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # unrolled, so the loads overlap
        acc += tl.load(partials_ptr + s * numel + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, w_ptr, n, k, stride_q, stride_s, group_size,
                       BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid `(cdiv(n, BLOCK_N), cdiv(k, BLOCK_K))`: w `[k, n]` contiguous."""
    k0 = tl.program_id(1) * BLOCK_K
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _dequantize_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, k, cols, n, stride_q, stride_s,
                         group_size, w_ptr.dtype.element_ty, BITS, HAS_G_IDX, BLOCK_K, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + ks.to(tl.int64)[:, None] * n + cols[None, :], w, mask=(ks < k)[:, None] & (cols < n)[None, :])
