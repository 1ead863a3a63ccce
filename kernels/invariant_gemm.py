"""A batch-invariant Triton GEMM, `y = x W^T (+ bias)`, for `deterministic=True` on CUDA.

A library GEMM picks its kernel, tiles and split-K by M (the rows of the call), so the same row of `x` rounds
differently inside a decode step of 1 row and a prefill of 300. Here nothing a row's result depends on moves
with M: the launch shape comes from (N, K, dtype) (`gemm_config`), there is no split-K, and each output tile
accumulates its K tiles in float32 in increasing order. Rows are independent in `tl.dot` (a row's products and
their sum never mix with another row's), so row r of `x` gives the same bits alone (M = 1) or inside any M: only
the number of row tiles in the grid changes. M is not specialised on (`do_not_specialize`): one compiled kernel
per launch shape serves every step, and a CUDA graph captured at one M replays another's.

Decode steps (M <= `SMALL_M`) fill few of the GPU's SMs with 128-row tiles. They may take smaller row and column
tiles (`small_m_config`) with the same K tiles: each output element still sums the same K tiles in the same order,
so its bits are the default's wherever the tensor cores' instructions reduce a K tile the same way at both tile
shapes. That is the hardware's business, so it is checked, not assumed: the first call for a weight shape outside
CUDA-graph capture multiplies `SMALL_M` random rows at both configs (`_small_tiles_equal`) and uses the small tiles
only if every element is equal; until then, and forever if not, the default serves every M.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """The launch shape of `invariant_gemm_kernel` for one (N, K, dtype). Any fixed choice is batch-invariant (a
    row's bits depend on it, not on M); `benchmarks/invariant_gemm.py` times the candidates against cuBLAS."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_m: int
    group_m: int = 16  # row tiles per group of the launch order (L2 reuse); never enters a row's sum
    tma: bool = False  # tiles loaded by the Tensor Memory Accelerator (Hopper): how bytes arrive, not the sum


def gemm_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The one launch shape for a weight of `[n, k]` in `dtype`; never a function of M. From the H100 sweep of
    `benchmarks/invariant_gemm.py --sweep` (llama3-8b's five weights, M = 1 ... 8192): 128-row tiles, 64-deep K
    tiles, 8 warps and 3 stages, 256 columns for the wide weights (gate_up, the LM head) and 128 for the others;
    weighted by W1's steps this is 0.73x of cuBLAS's time, where 64 x 128 x 64 tiles with 4 warps were 0.54x, and
    within 0.1 % of the best config chosen per weight. float32 operands take 32-deep K tiles (the same shared
    memory per stage)."""
    block_k = 32 if dtype == torch.float32 else 64
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(256 if n >= 16384 else 128, max(16, triton.next_power_of_2(n)))
    return GemmConfig(block_n, block_k, num_warps=8, num_stages=3, block_m=128)


SMALL_M = 256  # steps of at most this many rows may take the decode-sized tiles


def small_m_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The decode-sized launch shape for a weight of `[n, k]`: the default's K tiles, smaller row and column tiles,
    a deeper pipeline. From the H100 sweeps at M = 256 (`invariant_gemm.py --small-m [--tma]`, µs against the
    default's): the wide weights (gate_up, the LM head) 128 columns instead of 256 (gate_up 116 vs 140, the LM
    head 530 vs 599, TMA loads), the others 64 x 64 tiles with 4 warps and 5 stages (down 79 vs 130)."""
    default = gemm_config(n, k, dtype)
    if n >= 16384:
        return dataclasses.replace(default, block_n=min(default.block_n, 128))
    return GemmConfig(64, default.block_k, num_warps=4, num_stages=5, block_m=64)


TMA_ON_HOPPER = True  # load the tiles by TMA where the GPU has one (benchmarks/invariant_gemm.py times both)


def _configs(n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    """The default and the decode-sized launch shapes for `[n, k]` weights on `device` (asked per call: cached)."""
    return _device_configs(n, k, dtype, device, TMA_ON_HOPPER)


@functools.cache
def _device_configs(n: int, k: int, dtype: torch.dtype, device: torch.device,
                    tma_on_hopper: bool) -> tuple[GemmConfig, GemmConfig]:
    """Both launch shapes loading by TMA on a Hopper-or-later GPU, for 16-bit operands whose rows span whole 16 bytes
    (TMA's stride rule): a function of (K, dtype, device) only, so a weight's rows never change loaders with M."""
    configs = gemm_config(n, k, dtype), small_m_config(n, k, dtype)
    if (tma_on_hopper and device.type == "cuda" and dtype != torch.float32 and (k * dtype.itemsize) % 16 == 0
            and torch.cuda.get_device_capability(device)[0] >= 9):
        return tuple(dataclasses.replace(config, tma=True) for config in configs)
    return configs


_small_tiles_ok: dict[tuple[int, int, torch.dtype, torch.device], bool] = {}


def _small_tiles_equal(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `small_m_config` rounds as `gemm_config` does for `[n, k]` weights on this device (cached). Checked on
    random operands: a different reduction inside the tensor cores' instructions shows in some of SMALL_M x n
    elements. False while a CUDA graph is being captured (nothing can be compared then) without caching it."""
    key = (n, k, dtype, device)
    if key not in _small_tiles_ok:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(SMALL_M, k, generator=gen, device=device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
        default, small = _configs(n, k, dtype, device)
        _small_tiles_ok[key] = small == default or torch.equal(_launch(x, w, None, default), _launch(x, w, None, small))
    return _small_tiles_ok[key]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x [..., K]`, `weight [N, K]`, `bias [N]` of one dtype (bfloat16, float16 or
    float32), with each row of the result independent of the others' number (see the module docstring). `config`
    overrides the choice of `gemm_config` / `small_m_config` (the benchmark's sweep); a caller must keep it fixed per
    weight."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"invariant_linear takes bfloat16, float16 or float32 operands of one dtype, got x "
                         f"{x.dtype} and weight {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"invariant_linear: x has {x.shape[-1]} features, weight [{n}, {k}] takes {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = rows.shape[0]
    if config is None:  # the check runs at the first call of any M, before CUDA graphs capture the decode sizes
        small = _small_tiles_equal(n, k, x.dtype, x.device) and 0 < m <= SMALL_M
        config = _configs(n, k, x.dtype, x.device)[1 if small else 0]
    return _launch(rows, weight, bias, config).view(*x.shape[:-1], n)


def _launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig) -> torch.Tensor:
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m > 0:
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
        x, w = rows, weight
        if config.tma:
            x, w = _descriptors(rows, weight, config)
        invariant_gemm_kernel[grid](
            x, w, bias if bias is not None else weight, out, m, n, k,
            rows.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, USE_TMA=config.tma,
            # float32 models get float32 products; on the GPU the default would round operands to tf32.
            DOT_PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


def _descriptors(rows: torch.Tensor, weight: torch.Tensor, config: GemmConfig):
    """TMA descriptors of x's `[block_m, block_k]` and W's `[block_n, block_k]` tiles. TMA reads past the edges
    as zeros (what the pointer loads' masks give) and needs 16-byte aligned bases and row strides."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if rows.data_ptr() % 16 or (rows.stride(0) * rows.element_size()) % 16:
        rows = rows.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned, rows packed
    if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16:
        raise ValueError(f"invariant_linear: a TMA config needs a 16-byte aligned weight with 16-byte rows, got "
                         f"[{weight.shape[0]}, {weight.shape[1]}] {weight.dtype}")
    return (TensorDescriptor.from_tensor(rows, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]))


@triton.jit(do_not_specialize=["M"])
def invariant_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid `(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)`: one `[BLOCK_M, BLOCK_N]` tile of `out` per program, visited
    GROUP_M row tiles at a time down each column of tiles (the programs running at once share their x and W tiles
    in L2; at M in the thousands a row-major order re-reads x from memory once per column tile). With USE_TMA,
    `x_ptr` and `w_ptr` are TMA descriptors (`_descriptors`); the products and their order are the same."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_first = pid // (GROUP_M * tiles_n) * GROUP_M
    group_rows = tl.minimum(tiles_m - group_first, GROUP_M)
    tile_m = group_first + (pid % (GROUP_M * tiles_n)) % group_rows
    tile_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    if not USE_TMA:
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        # Out-of-range K columns load as 0 for both operands: their products add exact zeros.
        if USE_TMA:
            x = x_ptr.load([tile_m * BLOCK_M, k_start])
            w = w_ptr.load([tile_n * BLOCK_N, k_start]).T
        else:
            k_ok = k_start + ks < K
            x = tl.load(x_ptrs + k_start, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k_start, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
