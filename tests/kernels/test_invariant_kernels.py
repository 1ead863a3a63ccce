"""The batch-invariant kernels of `deterministic=True` on CUDA: `invariant_linear` and
`paged_attention_triton(invariant=True)`. A row's bits must not move with the batch around it: row r of x alone
(M = 1) and inside M = 7, 64, 300; a sequence's query rows as one prefill, as 2-3 chunks on cached context, as
decode steps, and among other sequences. Values are checked against float32 torch references within a tolerance;
invariance is bitwise.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) at small shapes, in float16 and float32 (the
interpreter multiplies bfloat16 `tl.dot` operands' raw bits: triton-lang/triton#11584). The `gpu`-marked tests
repeat the checks in bfloat16 at llama3-8b sizes.
"""

from __future__ import annotations

import pytest
import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference

pytest.importorskip("triton")

from batchllm.kernels.attention import paged_attention_triton  # noqa: E402
from batchllm.kernels.invariant_gemm import invariant_linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
BLOCK_SIZE = 16
CPU_DTYPES = [torch.float16, torch.float32]
LLAMA3_8B_LINEARS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # (N, K)


def gpu_test(test):
    return pytest.mark.gpu(requires_cuda(test))


def check_gemm_rows_invariant(n: int, k: int, dtype: torch.dtype, bias: bool, rows_checked: list[int]) -> None:
    gen = torch.Generator(DEVICE).manual_seed(n + k)
    x = torch.randn(300, k, generator=gen, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    full = invariant_linear(x, weight, b)
    expected = x.float() @ weight.float().T + (0 if b is None else b.float())
    torch.testing.assert_close(full.float(), expected, atol=2e-2 if dtype != torch.float32 else 1e-4, rtol=1e-2)
    for r in rows_checked:
        for m in (1, 7, 64):
            start = min(max(r - m // 2, 0), 300 - m)  # r sits inside the window, at a different offset each time
            window = invariant_linear(x[start:start + m], weight, b)
            assert torch.equal(window[r - start], full[r]), f"row {r} alone in M={m} differs from M=300"


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n,k,bias", [(80, 96, True), (33, 40, False)])
def test_invariant_gemm_rows_do_not_depend_on_m(n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    check_gemm_rows_invariant(n, k, dtype, bias, [0, 6, 63, 64, 299])


def test_invariant_gemm_keeps_leading_dims_and_rejects_mixed_dtypes() -> None:
    x = torch.randn(2, 3, 32, device=DEVICE, dtype=torch.float16)
    weight = torch.randn(24, 32, device=DEVICE, dtype=torch.float16)
    assert invariant_linear(x, weight).shape == (2, 3, 24)
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(x, weight.float())


def test_grouped_launch_order_covers_every_tile_once() -> None:
    """Tiles visited GROUP_M row tiles at a time: 7 row tiles in groups of 2 (the last group short) by 3 column
    tiles (the last one short) give every output element once, equal to float32 torch."""
    from batchllm.kernels import invariant_gemm

    gen = torch.Generator(DEVICE).manual_seed(4)
    x = torch.randn(100, 40, generator=gen, device=DEVICE)
    weight = torch.randn(40, 40, generator=gen, device=DEVICE)
    config = invariant_gemm.GemmConfig(16, 16, num_warps=4, num_stages=2, block_m=16, group_m=2)
    got = invariant_linear(x, weight, config=config)
    torch.testing.assert_close(got, x @ weight.T, atol=1e-4, rtol=1e-5)


def test_decode_sized_tiles_serve_small_m_only_where_they_round_as_the_default(monkeypatch) -> None:
    """Small M takes `small_m_config` once a check found it bit-equal to the default; a config that rounds
    differently is refused, and rows stay invariant either way. Whether two tile shapes round alike is the
    hardware's business (the GPU's float32 FMA loop sums K in order at any K tile), so the differing config is
    simulated: its launches come back one ulp up."""
    from batchllm.kernels import invariant_gemm

    assert invariant_gemm._small_tiles_equal(80, 96, torch.float32, DEVICE)  # same K tiles: equal
    check_gemm_rows_invariant(80, 96, torch.float32, True, [0, 63, 299])
    monkeypatch.setattr(invariant_gemm, "_small_tiles_ok", {})
    default = invariant_gemm.gemm_config(80, 96, torch.float32)
    other_rounding = invariant_gemm.GemmConfig(64, default.block_k // 2, 4, 3, 64)
    launch = invariant_gemm._launch

    def rounding_up(rows, weight, bias, config):
        out = launch(rows, weight, bias, config)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if config == other_rounding else out

    monkeypatch.setattr(invariant_gemm, "_launch", rounding_up)
    monkeypatch.setattr(invariant_gemm, "small_m_config", lambda n, k, dtype: other_rounding)
    invariant_gemm._device_configs.cache_clear()  # the launch shapes are cached per weight shape
    try:
        assert not invariant_gemm._small_tiles_equal(80, 96, torch.float32, DEVICE)
        check_gemm_rows_invariant(80, 96, torch.float32, True, [0, 63, 299])
    finally:
        invariant_gemm._device_configs.cache_clear()  # not the patched shapes for the tests after this one


def test_tma_loads_give_the_pointer_loads_bits() -> None:
    """The TMA loader (Hopper's default) reads past the edges as zeros, as the pointer loads' masks do: ragged
    M, N and K tiles give the same bits both ways. In the interpreter on CPU; on a GPU with TMA, for real."""
    import dataclasses

    from batchllm.kernels import invariant_gemm

    gen = torch.Generator(DEVICE).manual_seed(9)
    for m, n, k in [(300, 80, 96), (7, 33, 40), (1, 48, 64)]:
        x = torch.randn(m * k + 1, generator=gen, device=DEVICE).to(torch.float16)[1:].view(m, k)  # 2 bytes off 16
        weight = torch.randn(n, k, generator=gen, device=DEVICE).to(torch.float16)
        bias = torch.randn(n, generator=gen, device=DEVICE).to(torch.float16)
        pointers = invariant_gemm.GemmConfig(16, 32, num_warps=4, num_stages=2, block_m=16, group_m=2)
        want = invariant_linear(x, weight, bias, config=pointers)
        torch.testing.assert_close(want.float(), x.float() @ weight.float().T + bias.float(), atol=2e-2, rtol=1e-2)
        got = invariant_linear(x, weight, bias, config=dataclasses.replace(pointers, tma=True))
        assert torch.equal(got, want), (m, n, k)


@gpu_test
@pytest.mark.parametrize("n,k", LLAMA3_8B_LINEARS)
def test_invariant_gemm_llama3_8b_sizes_gpu(n: int, k: int) -> None:
    check_gemm_rows_invariant(n, k, torch.bfloat16, False, [0, 1, 63, 64, 200, 299])


class Cache:
    """Paged K/V of several sequences, in shuffled blocks; slots no sequence owns hold NaN."""

    def __init__(self, seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the caches' (float8_e4m3fn: FP8 K/V, values rounded from `dtype`'s); default `dtype`."""
        gen = torch.Generator(DEVICE).manual_seed(seed)
        counts = [-(-n // BLOCK_SIZE) for n in seq_lens]
        order = torch.randperm(sum(counts) + 1, generator=gen, device=DEVICE)
        self.tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=DEVICE)
        first = 0
        for i, count in enumerate(counts):
            self.tables[i, :count] = order[first:first + count].int()
            first += count
        shape = (sum(counts) + 1, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        for i, n in enumerate(seq_lens):
            pos = torch.arange(n, device=DEVICE)
            slots = self.tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
            for cache in (self.k, self.v):
                cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                    n, num_kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
        if kv_dtype is not None:  # NaN slots stay NaN in E4M3
            self.k, self.v = self.k.to(kv_dtype), self.v.to(kv_dtype)

    def attend(self, query: torch.Tensor, rows: list[tuple[int, int, int]], reference_kernel: bool = False,
               **options) -> torch.Tensor:
        """Attention of `query`'s rows laid out as `rows` of (sequence, query_len, seq_len), plus 3 padding rows:
        by the invariant Triton kernel, or by the float32 torch reference."""
        starts = [0]
        for _, query_len, _ in rows:
            starts.append(starts[-1] + query_len)
        padded = torch.cat([query, query.new_zeros(3, *query.shape[1:])])
        metadata = AttentionMetadata(
            slot_mapping=torch.full((padded.shape[0],), -1, dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([s for _, _, s in rows], dtype=torch.int32, device=DEVICE),
            block_tables=self.tables[[seq for seq, _, _ in rows]].contiguous(),
            max_query_len=max(q for _, q, _ in rows), max_seq_len=max(s for _, _, s in rows),
            query_start_loc_cpu=starts, seq_lens_cpu=[s for _, _, s in rows])
        scale = query.shape[-1] ** -0.5
        if reference_kernel:
            return reference.paged_attention(padded.float(), self.k.float(), self.v.float(), metadata, scale,
                                             **options)[:query.shape[0]]
        out = paged_attention_triton(padded, self.k, self.v, metadata, scale, invariant=True, **options)
        return out[:query.shape[0]]


def check_attention_rows_invariant(seq_lens: list[int], chunks: list[int], gqa: int, num_kv_heads: int,
                                   head_dim: int, dtype: torch.dtype, decode_positions: list[int],
                                   kv_dtype: torch.dtype | None = None, **options) -> None:
    """Sequence 0's rows (all `seq_lens[0]` of them) computed five ways, bit for bit the same."""
    length = seq_lens[0]
    cache = Cache(seq_lens, num_kv_heads, head_dim, dtype, seed=length, kv_dtype=kv_dtype)
    gen = torch.Generator(DEVICE).manual_seed(1)
    heads = num_kv_heads * gqa
    query = torch.randn(length, heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    prefill = cache.attend(query, [(0, length, length)], **options)
    expected = cache.attend(query, [(0, length, length)], reference_kernel=True, **options)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(prefill.float(), expected, atol=tolerance, rtol=tolerance)

    bounds = [0, *chunks, length]
    chunked = torch.cat([cache.attend(query[lo:hi], [(0, hi - lo, hi)], **options)
                         for lo, hi in zip(bounds, bounds[1:])])
    assert torch.equal(chunked, prefill), "chunked prefill (cached context) differs from one prefill"

    for pos in decode_positions:  # one decode row alone
        alone = cache.attend(query[pos:pos + 1], [(0, 1, pos + 1)], **options)
        assert torch.equal(alone[0], prefill[pos]), f"decode row at position {pos} differs from the prefill"

    # Every position as a decode row of one batch, next to the other sequences' decode rows and prefills.
    others = [(i, 5 if i % 2 else 1, n) for i, n in enumerate(seq_lens) if i > 0]
    other_query = torch.randn(sum(q for _, q, _ in others), heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    mixed_rows = others[:1] + [(0, 1, pos + 1) for pos in range(length)] + others[1:]
    first = others[0][1]
    mixed_query = torch.cat([other_query[:first], query, other_query[first:]])
    mixed = cache.attend(mixed_query, mixed_rows, **options)
    assert torch.equal(mixed[first:first + length], prefill), "decode rows inside a mixed batch differ"

    # The last chunk as a prefill in the middle of a batch, shifted off the query-block boundaries.
    lo = bounds[-2]
    batch_rows = others[:1] + [(0, length - lo, length)] + others[1:]
    batch_query = torch.cat([other_query[:first], query[lo:], other_query[first:]])
    inside = cache.attend(batch_query, batch_rows, **options)
    assert torch.equal(inside[first:first + length - lo], prefill[lo:]), "a chunk inside a batch differs"


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("options", [{}, {"sliding_window": 21, "logit_soft_cap": 30.0}], ids=["plain", "window"])
def test_invariant_attention_rows_do_not_depend_on_the_batch(dtype: torch.dtype, options: dict) -> None:
    check_attention_rows_invariant([45, 20, 9], [13, 30], gqa=2, num_kv_heads=1, head_dim=16, dtype=dtype,
                                   decode_positions=[0, 31, 32, 44], **options)


def test_invariant_attention_with_sinks() -> None:
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    check_attention_rows_invariant([40, 17], [19], gqa=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                                   decode_positions=[0, 39], sinks=sinks)


def test_invariant_attention_with_an_fp8_cache() -> None:
    """FP8 K/V (deterministic=True takes kv_cache_dtype="fp8") with float16 queries: its own decode tile, for prefill
    rows too; against the float32 reference on the same E4M3 values."""
    check_attention_rows_invariant([40, 17, 6], [19], gqa=2, num_kv_heads=2, head_dim=16, dtype=torch.float16,
                                   decode_positions=[0, 39], kv_dtype=torch.float8_e4m3fn)


def test_invariant_attention_refuses_a_tile_or_splits() -> None:
    cache = Cache([4], 1, 16, torch.float32, seed=0)
    query = torch.randn(4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="invariant=True"):
        cache.attend(query, [(0, 4, 4)], num_splits=2)


@gpu_test
@pytest.mark.parametrize("options", [{}, {"sliding_window": 500}], ids=["plain", "window"])
def test_invariant_attention_llama3_8b_sizes_gpu(options: dict) -> None:
    check_attention_rows_invariant([1000, 300, 7, 2000], [1, 333, 700], gqa=4, num_kv_heads=8, head_dim=128,
                                   dtype=torch.bfloat16, decode_positions=[0, 31, 32, 511, 999], **options)
