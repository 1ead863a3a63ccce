"""The Triton kernels against their pure-torch references (`batchllm.kernels.reference`).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py) at small shapes; the
`gpu`-marked tests repeat the checks at real sizes. Inputs are fresh random tensors; outputs and unused cache
slots are poisoned with NaN first, so an element a kernel fails to write, or a slot it reads but should
not, shows up as a mismatch. bfloat16 attention is GPU-only: the interpreter multiplies the raw bit
patterns of bfloat16 `tl.dot` operands (triton-lang/triton#11584). The interpreter also truncates when it
rounds float32 to bfloat16 where the GPU rounds to nearest even, so the checks that the elementwise kernels
round bit-exactly like the reference hold only on the GPU; on CPU they allow a few bfloat16 ulps.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from batchllm.forward_context import AttentionMetadata
from batchllm.kernels import reference

pytest.importorskip("triton")

from batchllm.kernels import attention as attention_module  # noqa: E402
from batchllm.kernels.activation import silu_and_mul_triton  # noqa: E402
from batchllm.kernels.attention import (  # noqa: E402
    MAX_SPLITS,
    SplitKVWorkspace,
    TileConfig,
    choose_num_splits,
    paged_attention_triton,
    tile_config,
)
from batchllm.kernels.kv_write import write_kv_triton  # noqa: E402
from batchllm.kernels.rmsnorm import rms_norm_triton  # noqa: E402
from batchllm.kernels.rotary import apply_rotary_triton  # noqa: E402
from batchllm.kernels.token_bitmask import apply_token_bitmask_triton  # noqa: E402
from batchllm.model.layers.rotary import RotaryEmbedding  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
BLOCK_SIZE = 16
NUM_BLOCKS = 4096
NUM_KV_HEADS = 2
PAD_TOKENS = 3  # rows after the last sequence's tokens, as when a batch is padded to a CUDA-graph size
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

def rounding_tolerance(dtype: torch.dtype, exact: bool = False) -> dict[str, float]:
    """assert_close's default tolerance, or none at all if `exact`; a few ulps for interpreted bfloat16."""
    if dtype == torch.bfloat16 and not CUDA:
        return dict(atol=2e-2, rtol=2e-2)
    return dict(atol=0, rtol=0) if exact else {}


# (query_len, seq_len): decode rows (the first token of a sequence, on and just past a block boundary, long
# context), prefill chunks on cached context, fresh prefills, and a sequence with nothing scheduled.
MIXED_BATCH = [(1, 1), (1, 37), (12, 30), (1, 16), (9, 9), (1, 17), (24, 24), (5, 41), (40, 100), (1, 300), (0, 20)]
SMALL_MIXED_BATCH = [(1, 150), (7, 70), (1, 1), (13, 13), (2, 200)]
# Decode only (the decode tiles of `tile_config`): a first token, partial last pages, one to five 128-key tiles.
DECODE_BATCH = [(1, 1), (1, 17), (1, 130), (1, 300), (1, 513)]


@dataclass
class Batch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata

    def expected(self, scale: float) -> torch.Tensor:
        """The reference in float32, whatever the batch's dtype."""
        return reference.paged_attention(
            self.query.float(), self.k_cache.float(), self.v_cache.float(), self.metadata, scale
        )


def make_batch(rows: list[tuple[int, int]], gqa: int, head_dim: int, dtype: torch.dtype, seed: int,
               num_kv_heads: int = NUM_KV_HEADS, num_blocks: int = NUM_BLOCKS, pad_tokens: int = PAD_TOKENS) -> Batch:
    """A cache of NaN except the K/V of every sequence's `seq_len` tokens, in shuffled blocks from the top of
    the pool; block-table entries past a sequence's last block name a spare block that holds only NaN. The query
    has `pad_tokens` rows after the last sequence's tokens (an engine's decode step has none: it pads sequences)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    query_lens = torch.tensor([q for q, _ in rows])
    seq_lens = torch.tensor([s for _, s in rows])
    blocks_per_seq = -(-seq_lens // BLOCK_SIZE)
    num_used = int(blocks_per_seq.sum())
    assert 2 * num_used + 1 <= num_blocks, "the pool is too small for the batch's blocks and their decoys"
    top = num_blocks - 1 - torch.randperm(2 * num_used + 1, generator=gen, device=DEVICE)
    spare, used = top[0], top[1 : num_used + 1]
    block_tables = torch.full((len(rows), int(blocks_per_seq.max())), int(spare), dtype=torch.int32, device=DEVICE)
    owner = torch.repeat_interleave(torch.arange(len(rows)), blocks_per_seq).to(DEVICE)
    column = torch.cat([torch.arange(n) for n in blocks_per_seq.tolist()]).to(DEVICE)
    block_tables[owner, column] = used.int()

    seq_of_key = torch.repeat_interleave(torch.arange(len(rows)), seq_lens).to(DEVICE)
    key_pos = torch.cat([torch.arange(n) for n in seq_lens.tolist()]).to(DEVICE)
    slots = block_tables[seq_of_key, key_pos // BLOCK_SIZE].long() * BLOCK_SIZE + key_pos % BLOCK_SIZE
    k_cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            len(slots), num_kv_heads, head_dim, generator=gen, device=DEVICE
        ).to(dtype)

    starts = [0] + query_lens.cumsum(0).tolist()
    num_tokens = starts[-1] + pad_tokens
    query = torch.randn(num_tokens, num_kv_heads * gqa, head_dim, generator=gen, device=DEVICE).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=seq_lens.to(torch.int32).to(DEVICE),
        block_tables=block_tables,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens.tolist(),
    )
    return Batch(query, k_cache, v_cache, metadata)


def check_attention(batch: Batch, num_splits: int | None, workspace: SplitKVWorkspace | None = None,
                    tile: TileConfig | None = None) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale,
                                    out=out, workspace=workspace, num_splits=num_splits, tile=tile)
    assert result is out
    expected = batch.expected(scale)
    padding = out[batch.metadata.query_start_loc_cpu[-1]:]
    assert torch.equal(padding, torch.zeros_like(padding)), "padding rows must be zeros"
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[batch.query.dtype])


def gpu_test(test):
    return pytest.mark.gpu(requires_cuda(test))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, requires_cuda])]
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_attention_mixed_batch(gqa: int, head_dim: int, dtype: torch.dtype) -> None:
    check_attention(make_batch(MIXED_BATCH, gqa, head_dim, dtype, seed=gqa * head_dim), num_splits=1)


@pytest.mark.parametrize(("gqa", "head_dim"), [(3, 96), (4, 32)])
def test_attention_head_dims_that_are_not_powers_of_two_or_small(gqa: int, head_dim: int) -> None:
    check_attention(make_batch(SMALL_MIXED_BATCH, gqa, head_dim, torch.float32, seed=head_dim), num_splits=1)


@pytest.mark.parametrize(
    ("gqa", "head_dim", "dtype", "num_splits"),
    [(1, 128, torch.float32, 3), (3, 64, torch.float16, 4), (4, 128, torch.float16, 2), (8, 64, torch.float32, 5)],
)
def test_split_kv_mixed_batch(gqa: int, head_dim: int, dtype: torch.dtype, num_splits: int) -> None:
    """Split-KV is meant for decode batches, but it must be right for any batch: its slices are cut per
    query block on the device, including slices that fall entirely past a row's causal limit."""
    check_attention(make_batch(SMALL_MIXED_BATCH, gqa, head_dim, dtype, seed=num_splits), num_splits=num_splits)


@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 64), (3, 64), (4, 128), (8, 128)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("pad_tokens", [0, PAD_TOKENS])
def test_decode_batch_with_16_bit_queries(gqa: int, head_dim: int, num_splits: int, pad_tokens: int) -> None:
    """Decode-only batches of 16-bit queries take the decode key tiles (64 keys at head_dim 64, 32 at 128); without
    padding rows (an engine's decode step), the grid of one program per sequence."""
    expected_tile_n = 64 if head_dim == 64 else 32
    group_p2 = 1 << (gqa - 1).bit_length()
    assert tile_config(1, group_p2, head_dim, torch.float16).tile_n == expected_tile_n
    batch = make_batch(DECODE_BATCH, gqa, head_dim, torch.float16, seed=gqa + head_dim, num_blocks=256,
                       pad_tokens=pad_tokens)
    check_attention(batch, num_splits=num_splits)


@pytest.mark.parametrize(("gqa", "head_dim", "dtype"),
                         [(1, 64, torch.float32), (3, 96, torch.float32), (4, 128, torch.float16),
                          (8, 64, torch.float16)])
@pytest.mark.parametrize("pad_tokens", [0, PAD_TOKENS])
def test_mixed_batch_with_its_decode_rows_launched_apart(gqa: int, head_dim: int, dtype: torch.dtype,
                                                         pad_tokens: int) -> None:
    """A chunked-prefill step's leading decode rows (`metadata.num_decodes`) go to the decode grid in a launch of
    their own and the rest to the general grid from their tokens on; also with a count short of the leading rows
    (decode rows then left to the general grid, as when a prefill chunk sits among the running rows)."""
    # More decode tokens than a prefill query block holds (16 / gqa tokens at most), so the general grid's numbering
    # must start after them.
    rows = [(1, 1 + 13 * i) for i in range(20)] + [(7, 70), (1, 40), (13, 13), (0, 20), (40, 100)]
    for num_decodes in (20, 3):
        batch = make_batch(rows, gqa, head_dim, dtype, seed=num_decodes + gqa, num_blocks=512, pad_tokens=pad_tokens)
        batch.metadata.num_decodes = num_decodes
        check_attention(batch, num_splits=None)


@pytest.mark.parametrize(("rows", "block_m"), [(DECODE_BATCH, 16), (MIXED_BATCH, 64)])
def test_a_register_cap_is_a_launch_option(rows: list[tuple[int, int]], block_m: int, monkeypatch) -> None:
    """TileConfig.max_registers reaches every launch as Triton's `maxnreg` (the interpreter ignores it; on the GPU
    the compiler spills past it) and leaves the result as it is."""
    kernel, seen = attention_module.paged_attention_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs.get("maxnreg"))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention_module, "paged_attention_kernel", Recorder())
    batch = make_batch(rows, 4, 64, torch.float16, seed=block_m, num_blocks=256, pad_tokens=0)
    check_attention(batch, num_splits=1, tile=TileConfig(block_m, 64, 4, max_registers=96))
    assert seen == [96]


def test_split_kv_decode_batch_with_a_reused_poisoned_workspace() -> None:
    batch = make_batch([(1, 700), (1, 260), (1, 5), (1, 513)], 4, 64, torch.float16, seed=7)
    # Larger than needed and NaN: only the slices a launch writes may be read back.
    workspace = SplitKVWorkspace(
        *(torch.full(shape, float("nan"), device=DEVICE) for shape in [(16, 8, 8, 64), (16, 8, 8), (16, 8, 8)])
    )
    check_attention(batch, num_splits=None, workspace=workspace)
    # More splits than the workspace holds: capped to its 8, of which the last two are empty for 700 keys.
    check_attention(batch, num_splits=12, workspace=workspace)


def test_split_heuristic() -> None:
    # Decode-only, few sequences, long contexts: split until ~2 programs per SM, slices >= 256 keys.
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132) == 9
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=65536, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_query_len=1, max_seq_len=1000, num_sms=132) == 3
    # Enough programs already, short contexts, or prefill tokens in the batch: the single-pass kernel.
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_query_len=1, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_query_len=1, max_seq_len=300, num_sms=132) == 1
    assert choose_num_splits(num_seqs=4, num_kv_heads=8, max_query_len=2, max_seq_len=8192, num_sms=132) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv(dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 23, 3, 64
    # K and V as views of a fused qkv output, the layout the model hands over.
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=gen, device=DEVICE).to(dtype)
    key = qkv[:, 3 * num_kv_heads * head_dim : 4 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 4 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = (NUM_BLOCKS * BLOCK_SIZE - 1 - torch.randperm(8 * num_tokens, generator=gen, device=DEVICE))[:num_tokens]
    slots[torch.tensor([2, 9, 10, 22])] = -1
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    write_kv_triton(key, value, k_cache, v_cache, slots)

    reference.write_kv(key, value, expected_k, expected_v, slots)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(1)
    hidden = 576  # smollm2-135m: not a power of two
    x = torch.randn(9, hidden, generator=gen, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=DEVICE)).to(dtype)
    residual = torch.randn(9, hidden, generator=gen, device=DEVICE).to(dtype) if with_residual else None

    got = rms_norm_triton(x, weight, 1e-5, residual)
    expected = reference.rms_norm(x, weight, 1e-5, residual)

    if with_residual:
        # The add rounds exactly like the reference's.
        torch.testing.assert_close(got[1], expected[1], **rounding_tolerance(dtype, exact=True))
        got, expected = got[0], expected[0]
    torch.testing.assert_close(got, expected, **rounding_tolerance(dtype))


def test_rms_norm_of_per_head_views() -> None:
    """Qwen3's q/k norm: rows are the heads of a strided `[T, H, D]` view into the fused qkv output."""
    gen = torch.Generator(DEVICE).manual_seed(2)
    qkv = torch.randn(5, 12 * 64, generator=gen, device=DEVICE).to(torch.bfloat16)
    q = qkv[:, : 8 * 64].view(5, 8, 64)
    weight = torch.randn(64, generator=gen, device=DEVICE).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm_triton(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6),
                               **rounding_tolerance(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(64, 9, 3), (128, 8, 2)])
def test_rotary_in_place(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, max_positions=4096, base=10000.0).to(DEVICE)
    num_tokens = 11
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen, device=DEVICE).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device=DEVICE)
    expected_q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim).clone()
    expected_k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim).clone()
    reference.apply_rotary(positions, expected_q, expected_k, rope.cos, rope.sin)
    untouched = qkv[:, q_size + kv_size :].clone()

    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    apply_rotary_triton(positions, q, k, rope.cos, rope.sin)

    # float32: the GPU may fuse a product and the sum into one FMA, which rounds once instead of twice.
    # bf16: one ulp, since the GPU compiler may contract the reference's separate mul and add into an FMA.
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)
    assert torch.equal(qkv[:, q_size + kv_size :], untouched), "the value slice of qkv must not be written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(3)
    d = 1536 + 8  # more than one column block, with a ragged tail
    gate_up = (3 * torch.randn(2, 3, 2 * d, generator=gen, device=DEVICE)).to(dtype)
    torch.testing.assert_close(silu_and_mul_triton(gate_up), reference.silu_and_mul(gate_up),
                               **rounding_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 0]])
@pytest.mark.parametrize("padding", [0, 1000])  # 1000: model ids past the bitmask's words, all forbidden
def test_token_bitmask(dtype: torch.dtype, rows: list[int], padding: int) -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 2048 + 100  # more than one vocabulary block, with a tail that is not a whole word
    logits = torch.randn(4, vocab, generator=gen).to(dtype).to(DEVICE)
    words = torch.randint(-2**31, 2**31 - 1, (len(rows), -(-(vocab - padding) // 32)), dtype=torch.int32,
                          generator=gen)
    words[:, ::3] = -1
    words[:, 1::5] = 0
    row_index = torch.tensor(rows, dtype=torch.long)
    expected = reference.apply_token_bitmask_(logits.cpu(), row_index, words)
    out = apply_token_bitmask_triton(logits, row_index.to(DEVICE), words.to(DEVICE))
    assert out is logits
    assert torch.equal(logits.cpu(), expected)


def test_import_batchllm_does_not_import_triton() -> None:
    code = "import sys, batchllm, batchllm.kernels, batchllm.model.llama; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- Real sizes, on the GPU ----------------------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("num_splits", [None, 4])
def test_gpu_decode_batch_256_rows_2k_context(num_splits: int | None) -> None:
    rows = [(1, 2048 - i) for i in range(256)]
    batch = make_batch(rows, gqa=4, head_dim=128, dtype=torch.bfloat16, seed=11, num_kv_heads=8, num_blocks=70_000)
    check_attention(batch, num_splits=num_splits)


@gpu_test
@pytest.mark.parametrize(("gqa", "head_dim", "dtype"), [(4, 128, torch.bfloat16), (8, 64, torch.float16)])
def test_gpu_mixed_batch_8k_tokens(gqa: int, head_dim: int, dtype: torch.dtype) -> None:
    rows = [(2048, 3000), (2048, 2048), (1500, 1600), (1000, 5000), (1283, 1400), (1, 1)]
    rows += [(1, 100 + 37 * i) for i in range(120)]
    assert 8000 <= sum(q for q, _ in rows) < 8800
    batch = make_batch(rows, gqa, head_dim, dtype, seed=12, num_kv_heads=8, num_blocks=40_000)
    check_attention(batch, num_splits=1)


@gpu_test
def test_gpu_w7_shaped_prefill_step_with_its_decode_rows_launched_apart() -> None:
    """A W7 prefill step at llama3-8b's heads: 512 decode rows (64-320 keys) launched apart, then 56 prompts of 128."""
    rows = [(1, 64 + (i * 37) % 257) for i in range(512)] + [(128, 128)] * 56
    batch = make_batch(rows, gqa=4, head_dim=128, dtype=torch.bfloat16, seed=15, num_kv_heads=8, num_blocks=40_000,
                       pad_tokens=0)
    batch.metadata.num_decodes = 512
    check_attention(batch, num_splits=None)


@gpu_test
def test_gpu_small_decode_batch_long_context_splits() -> None:
    rows = [(1, 16_000), (1, 9_000), (1, 12_345), (1, 300)]
    batch = make_batch(rows, gqa=4, head_dim=128, dtype=torch.bfloat16, seed=13, num_kv_heads=8, num_blocks=8_000)
    metadata = batch.metadata
    assert choose_num_splits(len(rows), 8, metadata.max_query_len, metadata.max_seq_len, 132) > 1
    check_attention(batch, num_splits=None)


@gpu_test
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_attention_replays_in_a_cuda_graph(num_splits: int) -> None:
    """Captured once, replayed over new sequence lengths and block tables written into the same tensors."""
    rows = [(1, 1000 + 97 * i) for i in range(32)]
    batch = make_batch(rows, gqa=4, head_dim=128, dtype=torch.bfloat16, seed=14, num_kv_heads=8, num_blocks=16_000)
    metadata, scale = batch.metadata, 128**-0.5
    workspace = SplitKVWorkspace.allocate(batch.query.shape[0], 32, 128, num_splits, DEVICE)
    out = torch.empty_like(batch.query)

    def launch() -> None:
        paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, metadata, scale, out=out,
                               workspace=workspace, num_splits=num_splits)

    launch()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    # Shorter sequences (at most 962 <= 1000 keys) on the reversed rows' blocks: every row stays valid.
    new_lens = torch.tensor([1 + 31 * i for i in range(32)], dtype=torch.int32, device=DEVICE)
    metadata.seq_lens.copy_(new_lens)
    metadata.block_tables.copy_(metadata.block_tables.flip(0))
    metadata.seq_lens_cpu, metadata.max_seq_len = new_lens.tolist(), int(new_lens.max())
    batch.query.normal_()
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out.float(), batch.expected(scale), **TOLERANCE[torch.bfloat16])


@gpu_test
def test_gpu_elementwise_kernels_at_llama3_8b_sizes() -> None:
    gen = torch.Generator(DEVICE).manual_seed(15)
    num_tokens, hidden, inter, heads, kv_heads, head_dim = 8192, 4096, 14336, 32, 8, 128
    bf16 = torch.bfloat16
    x, residual = (torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(bf16) for _ in range(2))
    weight = torch.randn(hidden, generator=gen, device=DEVICE).to(bf16)
    got, expected = rms_norm_triton(x, weight, 1e-5, residual), reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, expected)

    gate_up = torch.randn(num_tokens, 2 * inter, generator=gen, device=DEVICE).to(bf16)
    torch.testing.assert_close(silu_and_mul_triton(gate_up), reference.silu_and_mul(gate_up))

    rope = RotaryEmbedding(head_dim, max_positions=8192, base=500000.0).to(DEVICE)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen, device=DEVICE)
    q, k = (torch.randn(num_tokens, n, head_dim, generator=gen, device=DEVICE).to(bf16) for n in (heads, kv_heads))
    expected_q, expected_k = reference.apply_rotary(positions, q.clone(), k.clone(), rope.cos, rope.sin)
    apply_rotary_triton(positions, q, k, rope.cos, rope.sin)
    torch.testing.assert_close(q, expected_q, atol=2e-2, rtol=2e-2)  # one bf16 ulp: FMA contraction
    torch.testing.assert_close(k, expected_k, atol=2e-2, rtol=2e-2)

    k_cache = torch.full((40_000, BLOCK_SIZE, kv_heads, head_dim), float("nan"), dtype=bf16, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    slots = 40_000 * BLOCK_SIZE - 1 - torch.randperm(num_tokens * 4, generator=gen, device=DEVICE)[:num_tokens]
    slots[::7] = -1
    write_kv_triton(q[:, :kv_heads], k, k_cache, v_cache, slots)
    reference.write_kv(q[:, :kv_heads], k, expected_k_cache, expected_v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v_cache, atol=0, rtol=0, equal_nan=True)


@gpu_test
def test_gpu_dispatch_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors go to Triton; BATCHLLM_DISABLE_TRITON=1 sends them to the references instead."""
    from batchllm import kernels

    x = torch.randn(4, 64, device=DEVICE)
    kernels.triton_enabled.cache_clear()
    assert kernels._use_triton(x) and not kernels._use_triton(x.cpu())
    monkeypatch.setenv("BATCHLLM_DISABLE_TRITON", "1")
    kernels.triton_enabled.cache_clear()
    try:
        assert not kernels._use_triton(x)
    finally:
        monkeypatch.undo()
        kernels.triton_enabled.cache_clear()

