"""The batched multi-LoRA delta: the reference (the CPU path) against a per-token hand computation in float64,
and the Triton kernels against the reference.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (tests/conftest.py), at small
shapes, in float32 and float16 only: the interpreter mishandles bfloat16 `tl.dot` (see test_triton_kernels.py).
The `gpu`-marked test repeats the check at a real size in bfloat16. Every batch has an empty segment, tokens in
no segment (base model and padding), and unused `sorted_tokens` entries pointing at such a token: their `out`
rows must come back bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from batchllm.kernels import reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
}


@dataclass
class LoRAStep:
    x: torch.Tensor
    out: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_starts: torch.Tensor
    groups: dict[int, list[int]]  # slot -> its tokens
    base_tokens: list[int]  # tokens in no segment

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.out, self.a, self.b, self.sorted_tokens, self.slot_starts


def make_step(segment_sizes: list[int], num_base: int, in_features: int, width: int, out_features: int,
              dtype: torch.dtype, seed: int, device: torch.device | str = "cpu", strided: bool = False) -> LoRAStep:
    """Segment s has `segment_sizes[s]` tokens; `num_base` more tokens are in none. Tokens are shuffled so a
    segment's are not contiguous. With `strided`, x and out are column slices of wider tensors."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(segment_sizes) + num_base
    order = torch.randperm(num_tokens, generator=gen)
    bounds = [0]
    for size in segment_sizes:
        bounds.append(bounds[-1] + size)
    groups = {s: order[bounds[s]:bounds[s + 1]].tolist() for s in range(len(segment_sizes))}
    base_tokens = order[bounds[-1]:].tolist()
    sorted_tokens = order.clone().to(torch.int32)
    if base_tokens:
        sorted_tokens[bounds[-1]:] = base_tokens[0]  # unused entries: a token whose row must stay untouched

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    num_slots = len(segment_sizes)
    x, out = rand(num_tokens, in_features + 8 * strided), rand(num_tokens, out_features + 5 * strided)
    x, out = x[:, 8 * strided:], out[:, :out_features]
    a = rand(num_slots, width, in_features, scale=in_features ** -0.5)
    b = rand(num_slots, out_features, width, scale=width ** -0.5)
    return LoRAStep(x.to(device), out.to(device), a.to(device), b.to(device), sorted_tokens.to(device),
                    torch.tensor(bounds, dtype=torch.int32, device=device), groups, base_tokens)


def hand_computed(step: LoRAStep) -> torch.Tensor:
    """Token by token in float64 (out of place), the intermediate `x a^T` rounded to x's dtype as documented."""
    expected = step.out.double().clone()
    for slot, tokens in step.groups.items():
        a, b = step.a[slot].double(), step.b[slot].double()
        for t in tokens:
            y = (step.x[t].double() @ a.T).to(step.x.dtype).double()
            expected[t] += y @ b.T
    return expected


def check(step: LoRAStep, before: torch.Tensor, result: torch.Tensor, expected: torch.Tensor) -> None:
    assert result is step.out
    assert result.dtype == before.dtype
    if step.base_tokens:
        base = torch.tensor(step.base_tokens, device=before.device)
        assert torch.equal(result[base], before[base]), "rows of tokens in no segment must be untouched"
    torch.testing.assert_close(result.double(), expected.to(result.device).double(), **TOLERANCE[before.dtype])


# (segment sizes, tokens in no segment, in, W, out, shrink's K splits for Triton): decode-like, a segment over
# two row blocks, one slot's segment the whole batch, W, out and the last K split not multiples of the tiles.
SHAPES = [
    ([1, 0, 2, 1], 3, 64, 16, 48, 1),
    ([17, 0, 5], 6, 96, 48, 200, 2),
    ([0, 0, 40], 0, 64, 48, 72, 1),
    ([3, 9, 0, 20], 2, 160, 24, 130, 3),
    ([300, 0, 230], 5, 64, 16, 40, 1),  # prefill-sized: 64-row blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_against_hand_computation(shape, dtype):
    sizes, num_base, in_features, width, out_features, _ = shape
    step = make_step(sizes, num_base, in_features, width, out_features, dtype, seed=1, strided=True)
    before, expected = step.out.clone(), hand_computed(step)
    check(step, before, reference.add_lora_(*step.args()), expected)


def test_reference_no_tokens():
    step = make_step([0, 0, 0], 4, 64, 16, 48, torch.float32, seed=2)
    before = step.out.clone()
    assert torch.equal(reference.add_lora_(*step.args()), before)


def _triton_add_lora():
    pytest.importorskip("triton")
    from batchllm.kernels.lora import add_lora_triton

    return add_lora_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_against_reference(shape, dtype):
    add_lora_triton = _triton_add_lora()
    sizes, num_base, in_features, width, out_features, split_k = shape
    step = make_step(sizes, num_base, in_features, width, out_features, dtype, seed=3, device=DEVICE,
                     strided=shape is SHAPES[1])
    before = step.out.clone()
    expected = reference.add_lora_(step.x, before.clone(), *step.args()[2:])
    check(step, before, add_lora_triton(*step.args(), split_k=split_k), expected)


def test_triton_all_base_tokens():
    add_lora_triton = _triton_add_lora()
    step = make_step([0, 0], 5, 64, 16, 48, torch.float32, seed=4, device=DEVICE)
    before = step.out.clone()
    assert torch.equal(add_lora_triton(*step.args()), before)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_real_size(dtype):
    add_lora_triton = _triton_add_lora()
    # 256 tokens: a long prefill segment, decode rows, an empty slot, base-model tokens.
    step = make_step([150, 1, 0, 3, 70], 32, 4096, 48, 6144, dtype, seed=5, device="cuda")
    before = step.out.clone()
    expected = reference.add_lora_(step.x, before.clone(), *step.args()[2:])
    check(step, before, add_lora_triton(*step.args()), expected)
