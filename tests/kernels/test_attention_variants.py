"""The Triton paged-attention kernel's per-layer variants (sliding window, logit soft-cap, sinks, and all three)
against the torch reference, `reference.paged_attention`, whose own variants are checked against a hand-written
softmax in test_attention_backend.py.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py), at small shapes. Each
variant runs on a mixed batch (decode rows, a prefill chunk on cached context, fresh prefills, a sequence with
nothing scheduled, padding rows) through the single-pass kernel and split-KV, and on FP8 caches. Windows are
shorter than most sequences and not multiples of the block or tile sizes, so whole blocks fall out of them.
"""

from __future__ import annotations

import pytest
import torch

from batchllm.kernels import reference

pytest.importorskip("triton")

from batchllm.kernels.attention import paged_attention_triton  # noqa: E402
from batchllm.model.attention.torch_backend import TORCH_BACKEND  # noqa: E402
from batchllm.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchllm.model.layers.attention import Attention  # noqa: E402
from tests.kernels.test_fp8_kernels import (  # noqa: E402, F401 (an autouse fixture: exact FP8 casts on CPU)
    exact_fp8_casts_in_the_interpreter,
    to_fp8_batch,
)
from tests.kernels.test_triton_kernels import (  # noqa: E402
    BLOCK_SIZE,
    DEVICE,
    PAD_TOKENS,
    TOLERANCE,
    Batch,
    gpu_test,
    make_batch,
)

# (query_len, seq_len): decode rows past several windows, a two-query-block prefill on cached context, fresh
# prefills (one shorter than the window), a row with nothing scheduled.
VARIANT_BATCH = [(1, 70), (40, 100), (1, 1), (13, 13), (7, 40), (2, 90), (0, 20)]
VARIANTS = {
    "window": dict(sliding_window=21),
    "soft_cap": dict(logit_soft_cap=2.5),
    "sinks": dict(sinks=True),
    "window-soft_cap-sinks": dict(sliding_window=9, logit_soft_cap=1.5, sinks=True),
}


def head_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Logits of the scale of the scores, one large, so that the sinks take a visible share of the softmax."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))
    sinks[0] = 4.0
    return sinks.to(DEVICE)


def variant_options(name: str, num_heads: int) -> dict:
    options = dict(VARIANTS[name])
    if options.pop("sinks", False):
        options["sinks"] = head_sinks(num_heads, seed=len(name))
    return options


def check_variant(batch: Batch, expected_from: Batch, options: dict, num_splits: int | None,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The kernel on `batch` against the float32 reference on `expected_from` (the same values, dequantized)."""
    scale = batch.query.shape[-1] ** -0.5
    expected = reference.paged_attention(expected_from.query.float(), expected_from.k_cache.float(),
                                         expected_from.v_cache.float(), expected_from.metadata, scale, **options)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, out=out,
                           num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, **options)
    assert torch.equal(out[-PAD_TOKENS:], torch.zeros_like(out[-PAD_TOKENS:])), "padding rows must be zeros"
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[batch.query.dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_on_a_mixed_batch(variant: str, num_splits: int) -> None:
    batch = make_batch(VARIANT_BATCH, 2, 32, torch.float32, seed=num_splits, num_blocks=128)
    check_variant(batch, batch, variant_options(variant, batch.query.shape[1]), num_splits)


def test_all_variants_in_float16_with_gqa_4() -> None:
    batch = make_batch(VARIANT_BATCH, 4, 64, torch.float16, seed=5, num_blocks=128)
    check_variant(batch, batch, variant_options("window-soft_cap-sinks", batch.query.shape[1]), num_splits=1)


@pytest.mark.parametrize(("num_splits", "num_decodes"), [(1, 0), (3, 0), (1, 1)])
def test_all_variants_on_fp8_caches(num_splits: int, num_decodes: int) -> None:
    """With `num_decodes` the batch's leading decode row is launched apart (the decode grid), the rest after it."""
    batch = make_batch(VARIANT_BATCH, 2, 32, torch.float32, seed=6, num_blocks=128)
    fp8, dequantized = to_fp8_batch(batch, k_scale=0.05, v_scale=2.0)
    fp8.metadata.num_decodes = num_decodes
    check_variant(fp8, dequantized, variant_options("window-soft_cap-sinks", batch.query.shape[1]), num_splits,
                  k_scale=0.05, v_scale=2.0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_windowed_decode_never_reads_the_blocks_before_its_window(num_splits: int) -> None:
    """K/V more than 64 keys before a decode row's window (two tiles, whatever the tile alignment) are made
    NaN after the reference has run: a kernel that loads them, even masked, returns NaN."""
    window, rows = 20, [(1, 300), (1, 213), (1, 15)]
    batch = make_batch(rows, 2, 32, torch.float32, seed=8, num_blocks=128)
    clean = Batch(batch.query, batch.k_cache.clone(), batch.v_cache.clone(), batch.metadata)
    for seq, (_, seq_len) in enumerate(rows):
        for pos in range(max(seq_len - window - 64, 0)):
            block = batch.metadata.block_tables[seq, pos // BLOCK_SIZE]
            batch.k_cache[block, pos % BLOCK_SIZE] = float("nan")
            batch.v_cache[block, pos % BLOCK_SIZE] = float("nan")
    check_variant(batch, clean, dict(sliding_window=window), num_splits)


@gpu_test
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_gemma3_shaped_window_over_8k_contexts(num_splits: int | None) -> None:
    """Gemma 3's local layers (window 1024, head_dim 256, 2 query heads per KV head) in bfloat16, with a soft cap
    and sinks: decode rows at 8k context, where split-KV cuts the window, and prefill chunks that cross it."""
    rows = [(1, 8192 - 61 * i) for i in range(64)] + [(700, 2500), (1500, 1500), (3, 1030)]
    batch = make_batch(rows, gqa=2, head_dim=256, dtype=torch.bfloat16, seed=12, num_kv_heads=8, num_blocks=60_000)
    options = dict(sliding_window=1024, logit_soft_cap=50.0, sinks=head_sinks(16, seed=13))
    check_variant(batch, batch, options, num_splits)


def test_triton_backend_passes_the_layer_options_to_the_kernel() -> None:
    """The Triton backend (KV write, then attention) against the torch backend on the same layer and batch."""
    options = dict(sliding_window=6, logit_soft_cap=3.0, sinks=True)
    batch = make_batch([(5, 14), (1, 30), (9, 9)], 2, 16, torch.float32, seed=9, num_blocks=32)
    num_tokens = batch.query.shape[0]
    gen = torch.Generator(DEVICE).manual_seed(10)
    key, value = (torch.randn(num_tokens, 2, 16, generator=gen, device=DEVICE) for _ in range(2))
    # Each query token's own K/V goes to its position's slot; padding rows keep slot -1 (not written).
    slots = batch.metadata.slot_mapping
    for seq, (start, seq_len) in enumerate(zip(batch.metadata.query_start_loc_cpu, batch.metadata.seq_lens_cpu)):
        query_len = batch.metadata.query_start_loc_cpu[seq + 1] - start
        for j in range(query_len):
            pos = seq_len - query_len + j
            slots[start + j] = batch.metadata.block_tables[seq, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    outputs = []
    for backend in (TritonAttentionBackend(), TORCH_BACKEND):
        layer = Attention(4, 2, 16, 0.3, **options)
        layer.sinks.copy_(head_sinks(4, seed=11))
        layer.k_cache, layer.v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        outputs.append(backend.forward(layer, batch.query, key, value, batch.metadata))
    torch.testing.assert_close(outputs[0], outputs[1], **TOLERANCE[torch.float32])
