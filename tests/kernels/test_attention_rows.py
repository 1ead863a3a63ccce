"""`decode_attention_rows` (every KV head of a row in one program, a block-diagonal query tile) against the torch
reference, in the interpreter on the CPU: decode batches with a first token, partial last pages, a row with nothing
scheduled and padding tokens; narrow and GQA heads; split-KV; FP8 caches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchllm.kernels.attention import SplitKVWorkspace  # noqa: E402
from batchllm.kernels.attention_rows import decode_attention_rows, row_heads  # noqa: E402
from tests.kernels.test_fp8_kernels import to_fp8_batch  # noqa: E402
from tests.kernels.test_triton_kernels import DEVICE, PAD_TOKENS, TOLERANCE, Batch, gpu_test, make_batch  # noqa: E402

ROWS = [(1, 1), (1, 17), (0, 20), (1, 130), (1, 300)]


def check(batch: Batch, num_splits: int, expected: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
          tile_n: int = 32, heads_per_program: int | None = None) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = torch.full_like(batch.query, float("nan"))
    workspace = None
    if num_splits > 1:  # NaN scratch: only what the launch writes may be read back
        tokens, heads, dim = batch.query.shape
        workspace = SplitKVWorkspace(*(torch.full(shape, float("nan"), device=DEVICE)
                                       for shape in [(tokens, heads, 4, dim), (tokens, heads, 4), (tokens, heads, 4)]))
    result = decode_attention_rows(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, out=out,
                                   workspace=workspace, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale,
                                   tile_n=tile_n, heads_per_program=heads_per_program)
    assert result is out
    assert torch.equal(out[-PAD_TOKENS:], torch.zeros_like(out[-PAD_TOKENS:])), "padding rows must be zeros"
    # The row with nothing scheduled has no query token: the others are every token before the padding.
    torch.testing.assert_close(out[:-PAD_TOKENS].float(), expected[:-PAD_TOKENS], **TOLERANCE[batch.query.dtype])


@pytest.mark.parametrize(("gqa", "num_kv_heads", "head_dim"), [(3, 3, 64), (4, 2, 32), (1, 4, 64), (2, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_equal_the_reference(gqa: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                         num_splits: int) -> None:
    batch = make_batch(ROWS, gqa, head_dim, dtype, seed=gqa * head_dim + num_splits, num_kv_heads=num_kv_heads,
                       num_blocks=128)
    check(batch, num_splits, batch.expected(batch.query.shape[-1] ** -0.5), heads_per_program=num_kv_heads)


@pytest.mark.parametrize(("gqa", "num_kv_heads", "heads_per_program", "num_splits"),
                         [(2, 4, 2, 1), (4, 4, 1, 3), (1, 6, 3, 2)])
def test_decode_rows_of_some_heads_per_program(gqa: int, num_kv_heads: int, heads_per_program: int,
                                               num_splits: int) -> None:
    batch = make_batch(ROWS, gqa, 32, torch.float16, seed=num_kv_heads + heads_per_program, num_kv_heads=num_kv_heads,
                       num_blocks=128)
    check(batch, num_splits, batch.expected(32 ** -0.5), heads_per_program=heads_per_program)


@pytest.mark.parametrize(("num_kv_heads", "heads_per_program", "num_splits"), [(3, None, 1), (3, None, 2), (4, 2, 2)])
def test_decode_rows_over_fp8_caches(num_kv_heads: int, heads_per_program: int | None, num_splits: int) -> None:
    batch = make_batch(ROWS, 3, 64, torch.float32, seed=11, num_kv_heads=num_kv_heads, num_blocks=128)
    fp8, dequantized = to_fp8_batch(batch, k_scale=0.05, v_scale=2.0)
    check(fp8, num_splits, dequantized.expected(64 ** -0.5), k_scale=0.05, v_scale=2.0, tile_n=16,
          heads_per_program=heads_per_program)


def test_row_heads_reads_rows_of_256_bytes_or_all_heads() -> None:
    assert row_heads(3, 64, 2) == 3  # smollm2, bf16: 128 bytes a head, and 3 is prime
    assert row_heads(8, 128, 1) == 2  # llama3-8b, FP8 cache
    assert row_heads(8, 128, 2) == 1  # llama3-8b, bf16
    assert row_heads(4, 32, 2) == 4  # 64 bytes a head: all four give 256
    assert row_heads(6, 32, 2) == 6  # 4 would, but does not divide 6


def test_prefill_rows_and_uneven_head_groups_are_refused() -> None:
    batch = make_batch([(1, 10), (3, 12)], 3, 64, torch.float32, seed=1, num_kv_heads=3, num_blocks=16)
    with pytest.raises(ValueError, match="max_query_len=3"):
        decode_attention_rows(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125)
    decode = make_batch([(1, 10)], 3, 64, torch.float32, seed=1, num_kv_heads=3, num_blocks=16)
    with pytest.raises(ValueError, match="heads_per_program=2 does not divide the 3 KV heads"):
        decode_attention_rows(decode.query, decode.k_cache, decode.v_cache, decode.metadata, 0.125,
                              heads_per_program=2)



@gpu_test
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_decode_rows_at_smollm2_size(num_splits: int) -> None:
    """200 bf16 decode rows of smollm2's heads (9 query, 3 KV, 64 wide) over 100-700 keys."""
    rows = [(1, 100 + 3 * i) for i in range(200)]
    batch = make_batch(rows, 3, 64, torch.bfloat16, seed=5, num_kv_heads=3, num_blocks=16384)
    check(batch, num_splits, batch.expected(64 ** -0.5), tile_n=32)
