"""The fused decode LoRA kernel (kernels/lora_fused.py) against the reference, a float64 hand computation, and
the two-kernel path's bits; and `add_lora_triton`'s choice between the two.

In Triton's interpreter on CPU tensors without a GPU (tests/conftest.py), float32 and float16 only (the
interpreter mishandles bfloat16 `tl.dot`), at small shapes. The step builder and the float64 computation are
test_lora_kernels.py's: tokens shuffled so a segment's are not contiguous, tokens in no segment whose `out` rows
must come back bit-identical, unused `sorted_tokens` entries pointing at such a token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchllm.kernels import reference
from batchllm.model.layers.lora import LoRASlots
from tests.kernels.test_lora_kernels import DEVICE, check, hand_computed, make_step, requires_cuda

pytest.importorskip("triton")
from batchllm.kernels import lora, lora_fused  # noqa: E402 (needs triton)

# (segment sizes, tokens in no segment, in_features, W = slices * max_rank, out_features, strided x / out rows).
# SHRINK_BLOCK_K is 64 and EXPAND_BLOCK_N 128: in and out are not multiples of them; in = 520 has two K splits,
# the second a partial chunk; W = 192 (qkv's three slices of rank 64) takes three W tiles.
SHAPES = [
    pytest.param([1, 0, 2, 1], 3, 100, 8, 200, False, id="rank8-one-and-no-rows"),
    pytest.param([0, 5, 0], 2, 72, 16, 136, True, id="rank16-strided"),
    pytest.param([0, 0, 24], 0, 96, 64, 72, False, id="rank64-one-slot-all-rows"),
    pytest.param([3, 17, 0, 1], 4, 520, 16, 130, True, id="rank16-two-k-splits-two-row-blocks"),
    pytest.param([2, 0, 6], 1, 72, 192, 136, False, id="qkv-rank64-three-w-tiles"),
]
DTYPES = [torch.float32, torch.float16]


def check_step(step) -> None:
    before = step.out.clone()
    expected_reference = reference.add_lora_(step.x, before.clone(), *step.args()[2:])
    expected_float64 = hand_computed(step)
    two_kernel_out = lora.add_lora_shrink_expand(step.x, before.clone(), *step.args()[2:])
    result = lora_fused.add_lora_fused(*step.args())
    check(step, before, result, expected_reference)
    check(step, before, result, expected_float64)
    # Same summation order and roundings as the two-kernel path: the same bits, not merely close.
    assert torch.equal(result, two_kernel_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes, num_base, in_features, width, out_features, strided", SHAPES)
def test_fused_against_reference_float64_and_two_kernels(sizes, num_base, in_features, width, out_features,
                                                         strided, dtype):
    step = make_step(sizes, num_base, in_features, width, out_features, dtype, seed=11, device=DEVICE,
                     strided=strided)
    check_step(step)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_on_a_qkv_slice_layout(dtype):
    """Slots as the model fills them: three sub-projections of unequal size, adapters of rank 8 and 16 in
    max_rank 16 (zero columns in A, a block-diagonal B), a slot left empty, base-model rows."""
    gen = torch.Generator().manual_seed(12)
    slices = [(0, 64), (64, 24), (88, 24)]  # q, k, v: out_features 112, not a multiple of 128
    slots = LoRASlots(slices, input_size=80, output_size=112, max_loras=3, max_rank=16, dtype=dtype,
                      device=torch.device(DEVICE))
    for slot, rank in [(0, 8), (2, 16)]:
        for index, (_, size) in enumerate(slices):
            a = torch.randn(rank, 80, generator=gen) * 80 ** -0.5
            b = torch.randn(size, rank, generator=gen) * rank ** -0.5
            slots.write(slot, index, a.to(dtype), b.to(dtype))
    step = make_step([3, 2, 4], 2, 80, 48, 112, dtype, seed=13, device=DEVICE, strided=True)
    check_step(dataclasses.replace(step, a=slots.a, b=slots.b))


@pytest.mark.parametrize("split_k", [1, 3])
def test_fused_honours_split_k_with_the_two_kernels_bits(split_k):
    step = make_step([4, 0, 7], 3, 300, 16, 48, torch.float32, seed=14, device=DEVICE)
    before, expected = step.out.clone(), hand_computed(step)
    fused_out = lora_fused.add_lora_fused(step.x, step.out.clone(), *step.args()[2:], split_k=split_k)
    two_kernel_out = lora.add_lora_shrink_expand(step.x, step.out.clone(), *step.args()[2:], split_k=split_k)
    assert torch.equal(fused_out, two_kernel_out)
    check(step, before, lora_fused.add_lora_fused(*step.args(), split_k=split_k), expected)


def test_fused_with_no_rows_in_any_segment_leaves_out_untouched():
    step = make_step([0, 0], 5, 64, 16, 48, torch.float16, seed=15, device=DEVICE)
    before = step.out.clone()
    assert torch.equal(lora_fused.add_lora_fused(*step.args()), before)


@pytest.mark.parametrize("extra_tokens, fused", [(0, True), (1, False)])
def test_add_lora_triton_takes_the_fused_kernel_up_to_its_threshold(monkeypatch, extra_tokens, fused):
    calls = []
    real_fused = lora_fused.add_lora_fused

    def recording_fused(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(lora_fused, "add_lora_fused", recording_fused)
    num_tokens = lora.FUSED_MAX_TOKENS + extra_tokens
    step = make_step([num_tokens - 40, 0, 30], 10, 64, 16, 40, torch.float32, seed=16, device=DEVICE)
    before = step.out.clone()
    expected = reference.add_lora_(step.x, before.clone(), *step.args()[2:])
    check(step, before, lora.add_lora_triton(*step.args()), expected)
    assert calls == ([num_tokens] if fused else [])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_real_size(dtype):
    # A decode step of llama3-8b's qkv layer: 4 slots of 3 x rank 16, 64 decode rows, an empty slot, base rows.
    step = make_step([30, 1, 0, 25], 8, 4096, 48, 6144, dtype, seed=17, device="cuda")
    check_step(step)
