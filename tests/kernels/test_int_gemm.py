"""The packed-integer (W4A16 / W8A16) matmul: the reference against hand-built weights, and the Triton kernels
(`batchllm.kernels.int_gemm`) against the reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py), at small odd shapes
(N not a multiple of the block, K with a short last tile, M below, at and above a row block). The GEMM paths
are checked there in float16 and float32 only: the interpreter multiplies the raw bit patterns of bfloat16
`tl.dot` operands (triton-lang/triton#11584), so bfloat16 GEMMs are checked on the GPU; the dequantize kernel
(no `tl.dot`) is checked in bfloat16 on CPU too, with a few ulps since the interpreter truncates where the GPU
rounds. The kernels round the dequantized tile to x's dtype before the dot, so they are held tightly to
`x @ w.to(x.dtype)` summed in float32 and loosely (the weight's rounding) to `reference.int_matmul`.
"""

from __future__ import annotations

import pytest
import torch

from batchllm.kernels import reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# Against x @ w.to(dtype) in float32: the summation order, and one rounding of the output (an ulp or two);
# absolute, as a share of max|out|, for outputs near zero.
SAME_ROUNDING = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SAME_ROUNDING_ATOL = {torch.float32: 2e-6, torch.float16: 2e-5, torch.bfloat16: 1.6e-4}
# Against reference.int_matmul (w in float32): the weight's rounding to x's dtype as well, relative to max|out|.
DTYPE_LEVEL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_reference_on_a_hand_packed_4bit_weight() -> None:
    # K = 16, N = 2, two groups of 8 rows. Column 0 holds codes 0..15 (row k: code k), column 1 codes 15..0;
    # word row r holds rows 8r..8r+7, row 8r + j in bits 4j..4j+3 (the lowest nibble first).
    qweight = torch.tensor([[0x76543210, _int32(0x89ABCDEF)], [_int32(0xFEDCBA98), 0x01234567]], dtype=torch.int32)
    assert reference.unpack_int(qweight, 4).tolist() == [[k, 15 - k] for k in range(16)]
    scales = torch.tensor([[0.5, 2.0], [0.25, 1.0]])
    zeros = torch.tensor([[8, 3], [0, 15]], dtype=torch.uint8)
    x = torch.zeros(3, 16)
    x[0, 3] = 1.0
    x[1, 12] = 1.0
    x[2] = 1.0
    # Row 3 (group 0): (3 - 8) * 0.5, (12 - 3) * 2; row 12 (group 1): 12 * 0.25, (3 - 15) * 1. The sums over k:
    # 0.5 * sum_{k<8}(k - 8) + 0.25 * sum_{k>=8} k = -18 + 23 and 2 * sum_{k<8}(12 - k) - sum_{k>=8} k = 136 - 92.
    out = reference.int_matmul(x, qweight, scales, zeros, bits=4, group_size=8)
    assert out.tolist() == [[-2.5, 18.0], [3.0, -12.0], [5.0, 44.0]]
    # Act-order: the first 8 rows in group 1, the last 8 in group 0.
    g_idx = torch.tensor([1] * 8 + [0] * 8, dtype=torch.int32)
    out = reference.int_matmul(x[:2], qweight, scales, zeros, bits=4, group_size=8, g_idx=g_idx)
    assert out.tolist() == [[0.75, -3.0], [2.0, 0.0]]


def test_reference_on_a_hand_packed_8bit_weight() -> None:
    # K = 8, N = 1: word 0 holds codes 0x01, 0x80, 0xFF, 0x7F (lowest byte first), word 1 four zeros.
    qweight = torch.tensor([[0x7FFF8001], [0]], dtype=torch.int32)
    w = reference.dequantize_int(qweight, torch.tensor([[0.5]]), torch.tensor([[128]], dtype=torch.uint8), 8, 8)
    assert w.flatten().tolist() == [-63.5, 0.0, 63.5, -0.5] + [-64.0] * 4
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0]])
    assert reference.int_matmul(x, qweight, torch.tensor([[0.5]]), torch.tensor([[128]], dtype=torch.uint8),
                                8, 8).tolist() == [[125.0 - 64.0]]


def make_weight(k: int, n: int, bits: int, group_size: int, act_order: bool, seed: int, device=DEVICE):
    """Random codes, scales and zero points; with `act_order`, a g_idx whose groups of `group_size` rows are
    scattered over K (the row order a GPTQ act-order checkpoint quantized in)."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), generator=gen, dtype=torch.int32)
    groups = -(-k // group_size)  # the last group may be partial
    scales = (torch.rand(groups, n, generator=gen) + 0.5) / 2**bits
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen, dtype=torch.uint8)
    g_idx = None
    if act_order:
        g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // group_size).to(torch.int32).to(device)
    return qweight.to(device), scales.to(device), zeros.to(device), g_idx


def make_x(m: int, k: int, dtype: torch.dtype, seed: int, device=DEVICE) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def check(out: torch.Tensor, x: torch.Tensor, qweight, scales, zeros, bits: int, group_size: int, g_idx) -> None:
    assert out.dtype == x.dtype and out.shape == (x.shape[0], qweight.shape[1])
    w = reference.dequantize_int(qweight, scales, zeros, bits, group_size, g_idx)
    same_rounding = (x.float() @ w.to(x.dtype).float()).to(x.dtype).float()
    scale = same_rounding.abs().max().item()
    torch.testing.assert_close(out.float(), same_rounding, rtol=SAME_ROUNDING[x.dtype],
                               atol=SAME_ROUNDING_ATOL[x.dtype] * scale)
    expected = reference.int_matmul(x, qweight, scales, zeros, bits, group_size, g_idx).float()
    torch.testing.assert_close(out.float(), expected, rtol=DTYPE_LEVEL[x.dtype], atol=DTYPE_LEVEL[x.dtype] * scale)


def _int_gemm():
    pytest.importorskip("triton")
    from batchllm.kernels import int_gemm

    return int_gemm


K = 256
GROUPS = [(32, False), (64, False), (128, False), (K, False), (32, True)]  # (group_size, act_order); K: one group


@pytest.mark.parametrize("m", [1, 3, 17, 70])  # 1, 3: split-K with 16-row blocks, 17: with 32-row ones; 70: tiled
@pytest.mark.parametrize("group_size, act_order", GROUPS)
@pytest.mark.parametrize("bits", [4, 8])
def test_int_matmul_triton_matches_reference(bits, group_size, act_order, m):
    int_gemm = _int_gemm()
    n = 72 if bits == 4 else 40
    qweight, scales, zeros, g_idx = make_weight(K, n, bits, group_size, act_order, seed=bits + group_size)
    x = make_x(m, K, torch.float16, seed=m)
    check(int_gemm.int_matmul_triton(x, qweight, scales, zeros, bits, group_size, g_idx), x, qweight, scales, zeros,
          bits, group_size, g_idx)


# Each path forced at small blocks: split-K (K = 120 in 3 splits of 48, 48 and 24 rows in BLOCK_K = 16 tiles, the
# last short), the tiled configuration (two 64-row tiles of K, the second short), and dequantize-then-matmul.
CONFIGS = {"split-k": dict(block_m=16, block_n=32, block_k=16, split_k=3), "tiled": dict(block_m=32, block_n=32,
                                                                                          block_k=64)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("path", ["split-k", "tiled", "dequantize"])
def test_each_path_at_odd_sizes(path, bits, act_order, dtype):
    int_gemm = _int_gemm()
    k, n, group_size = 120, 37, 48  # a short last tile of K; odd N; groups of 48, 48 and a partial 24
    qweight, scales, zeros, g_idx = make_weight(k, n, bits, group_size, act_order, seed=7)
    x = make_x(19, k, dtype, seed=8)  # one full and one partial 16-row block; one partial 32-row block
    if path == "dequantize":
        out = x @ int_gemm.dequantize_int_triton(qweight, scales, zeros, bits, group_size, g_idx, dtype=dtype)
    else:
        config = int_gemm.GemmConfig(**CONFIGS[path])
        out = int_gemm.int_gemm_triton(x, qweight, scales, zeros, bits, group_size, g_idx, config)
    check(out, x, qweight, scales, zeros, bits, group_size, g_idx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_int_triton_matches_reference(bits, act_order, dtype):
    int_gemm = _int_gemm()
    qweight, scales, zeros, g_idx = make_weight(K, 200, bits, 64, act_order, seed=9)
    w = int_gemm.dequantize_int_triton(qweight, scales, zeros, bits, 64, g_idx, dtype=dtype)
    expected = reference.dequantize_int(qweight, scales, zeros, bits, 64, g_idx).to(dtype)
    assert w.dtype == dtype and w.shape == (K, 200) and w.is_contiguous()
    exact = CUDA or dtype != torch.bfloat16  # the interpreter truncates to bfloat16
    torch.testing.assert_close(w, expected, **(dict(atol=0, rtol=0) if exact else dict(atol=1e-6, rtol=1e-2)))


def test_the_path_and_configuration_follow_from_the_shape():
    int_gemm = _int_gemm()
    assert [int_gemm.choose_path(m) for m in (1, int_gemm.SPLIT_K_MAX_M, int_gemm.SPLIT_K_MAX_M + 1,
                                              int_gemm.DEQUANT_MIN_M - 1, int_gemm.DEQUANT_MIN_M)] == [
        "split-k", "split-k", "tiled", "tiled", "dequantize"]
    decode = int_gemm.gemm_config("split-k", 1, 4096, 4096)
    assert decode.block_m == 16 and decode.split_k > 1
    assert int_gemm.gemm_config("split-k", 17, 4096, 4096).block_m == 32
    assert int_gemm.gemm_config("split-k", 1, 64, 128).split_k == 128 // decode.block_k  # one per BLOCK_K tile at most
    # The partial planes stay within PARTIAL_ROWS rows.
    tiled = int_gemm.gemm_config("tiled", 128, 4096, 14336)
    assert tiled.split_k * 128 <= int_gemm.PARTIAL_ROWS


def test_no_rows():
    int_gemm = _int_gemm()
    qweight, scales, zeros, _ = make_weight(64, 16, 4, 32, False, seed=0)
    out = int_gemm.int_matmul_triton(torch.empty(0, 64, dtype=torch.float16, device=DEVICE), qweight, scales, zeros,
                                     4, 32)
    assert out.shape == (0, 16)


GPU_ROWS = (1, 16, 64, 256, 4096)
GPU_SIZES = ([(4, False, m, n) for m in GPU_ROWS for n in (4096, 6144, 28672)]
             + [(bits, act, m, 6144) for bits, act in ((4, True), (8, False), (8, True)) for m in GPU_ROWS])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits, act_order, m, n", GPU_SIZES)
def test_int_matmul_real_size(bits, act_order, m, n):
    """K = 4096, group 128, bfloat16, through `batchllm.kernels.int_matmul` (the dispatch to Triton); twice, so
    the split-K sum is seen to be deterministic."""
    from batchllm import kernels

    qweight, scales, zeros, g_idx = make_weight(4096, n, bits, 128, act_order, seed=m + n)
    x = make_x(m, 4096, torch.bfloat16, seed=m)
    out = kernels.int_matmul(x, qweight, scales, zeros, bits, 128, g_idx)
    assert torch.equal(out, kernels.int_matmul(x, qweight, scales, zeros, bits, 128, g_idx))
    check(out, x, qweight, scales, zeros, bits, 128, g_idx)
