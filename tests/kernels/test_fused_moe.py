"""The Triton fused MoE kernel (`batchllm.kernels.fused_moe`) against the torch reference (`moe_reference.fused_moe`,
itself checked against a dense per-token loop in test_reference_kernels.py), and its expert alignment against
hand-computed blocks.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py), at small shapes whose
hidden and intermediate sizes are not multiples of the 64-wide tiles, in float32 and float16: the interpreter
multiplies the raw bit patterns of bfloat16 `tl.dot` operands (triton-lang/triton#11584), so bfloat16 is checked
by the `gpu`-marked tests. The weights and biases of experts no token chose are NaN in every case: reading them
into any output would show.
"""

from __future__ import annotations

import pytest
import torch

from batchllm.kernels.moe_reference import fused_moe as reference_fused_moe

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# Relative to max|out|. float32: the summation order alone. float16 / bfloat16: the reference rounds gate and up
# to the dtype, applies the activation in the dtype and rounds the down projection before weighting it; the kernel
# keeps all of it in float32 and rounds only the activation's output (the second GEMM's operand). A few ulps of
# the dtype per intermediate element, averaged over I terms: well under 1% of max|out| (bfloat16's ulp is 2^-8),
# while a lost routing weight, a row of another expert or a missing bias moves outputs by tens of percent.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _fused_moe_triton():
    pytest.importorskip("triton")
    from batchllm.kernels.moe import fused_moe_triton

    return fused_moe_triton


def random_routing(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator,
                   allowed: list[int] | None = None) -> torch.Tensor:
    """`[T, k]` distinct experts per token, drawn from `allowed` (all experts by default)."""
    allowed = list(range(num_experts)) if allowed is None else allowed
    scores = torch.rand(num_tokens, len(allowed), generator=gen)
    return torch.tensor(allowed)[scores.topk(top_k, dim=1).indices]


def segments_routing(segment_sizes: list[int], gen: torch.Generator) -> torch.Tensor:
    """k = 1, expert e taking `segment_sizes[e]` tokens, shuffled so that a segment's tokens are not contiguous."""
    ids = torch.cat([torch.full((size,), e) for e, size in enumerate(segment_sizes)])
    return ids[torch.randperm(len(ids), generator=gen)][:, None]


def make_moe(topk_ids: torch.Tensor, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool,
             seed: int, device: torch.device | str = DEVICE, strided: bool = False) -> dict:
    """Random inputs for `fused_moe`, the experts no token chose poisoned with NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, top_k = topk_ids.shape
    x = torch.randn(num_tokens, hidden + 7 * strided, generator=gen)[:, 7 * strided:]
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=gen) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=gen) if bias else None
    unchosen = sorted(set(range(num_experts)) - set(topk_ids.flatten().tolist()))
    for tensor in (w13, w2, b13, b2):
        if tensor is not None:
            tensor[unchosen] = float("nan")
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1  # not renormalised: a lost weight shows

    def to(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return dict(hidden=to(x), w13=to(w13), w2=to(w2), topk_weights=weights.to(device),
                topk_ids=topk_ids.to(device), w13_bias=to(b13), w2_bias=to(b2))


def check(got: torch.Tensor, args: dict, activation: str, swiglu_limit: float | None) -> None:
    expected = reference_fused_moe(**args, activation=activation, swiglu_limit=swiglu_limit)
    assert got.shape == expected.shape and got.dtype == args["hidden"].dtype
    assert torch.isfinite(got).all(), "an unchosen expert's (NaN) weights reached the output"
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected.double(), atol=TOLERANCE[got.dtype] * scale, rtol=0)


def _routings() -> dict[str, tuple[torch.Tensor, int]]:
    """Name -> (topk_ids, number of experts)."""
    gen = torch.Generator().manual_seed(0)
    return {
        "decode T=1 k=2 (6 of 8 experts unchosen)": (random_routing(1, 2, 8, gen), 8),
        "T=9 k=2, 3 of 8 experts chosen": (random_routing(9, 2, 8, gen, allowed=[1, 5, 6]), 8),
        "one expert takes every token, k=1": (torch.full((20, 1), 2), 4),
        "one expert in every token's slots, k=2": (torch.stack([torch.full((12,), 3), torch.arange(12) % 3], 1), 4),
        "uneven segments 17, 1, 0, 33": (segments_routing([17, 1, 0, 33], gen), 4),
        "k=4 of 6 experts": (random_routing(6, 4, 6, gen), 6),
        "32-row blocks": (random_routing(40, 2, 2, gen), 2),
        "64-row blocks, a partial last one": (random_routing(70, 2, 2, gen), 2),
    }


ROUTINGS = _routings()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("activation", "swiglu_limit"), [("silu", None), ("gelu_tanh", None),
                                                          ("swigluoai", 0.8), ("swigluoai", None)])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_triton_against_reference(routing, activation, swiglu_limit, bias):
    fused_moe_triton = _fused_moe_triton()
    # H = 80 and I = 72: two 64-wide tiles, the last one short, in every N and K loop; the limit 0.8 clamps.
    args = make_moe(*ROUTINGS[routing], 80, 72, torch.float32, bias, seed=1,
                    strided=routing.startswith("uneven"))
    check(fused_moe_triton(**args, activation=activation, swiglu_limit=swiglu_limit), args, activation, swiglu_limit)


@pytest.mark.parametrize("routing", ["T=9 k=2, 3 of 8 experts chosen", "uneven segments 17, 1, 0, 33"])
def test_triton_float16(routing):
    fused_moe_triton = _fused_moe_triton()
    args = make_moe(*ROUTINGS[routing], 80, 72, torch.float16, bias=True, seed=2)
    check(fused_moe_triton(**args, activation="silu"), args, "silu", None)


def test_triton_int32_ids_and_no_tokens():
    fused_moe_triton = _fused_moe_triton()
    ids, num_experts = ROUTINGS["k=4 of 6 experts"]
    args = make_moe(ids.to(torch.int32), num_experts, 80, 72, torch.float32, bias=False, seed=3)
    check(fused_moe_triton(**args), args, "silu", None)
    empty = make_moe(torch.zeros(0, 2, dtype=torch.long), 4, 80, 72, torch.float32, bias=False, seed=3)
    assert fused_moe_triton(**empty).shape == (0, 80)


def test_triton_refuses_an_unknown_activation():
    fused_moe_triton = _fused_moe_triton()
    args = make_moe(torch.tensor([[0]]), 2, 16, 16, torch.float32, bias=False, seed=4)
    with pytest.raises(ValueError, match="relu"):
        fused_moe_triton(**args, activation="relu")


def test_alignment_by_hand():
    pytest.importorskip("triton")
    from batchllm.kernels.moe import align_pairs_by_expert

    # Pairs (token * k + slot): 0 -> e2, 1 -> e0, 2 -> e2, 3 -> e1, 4 -> e0, 5 -> e2; expert 3: none. Blocks of 4:
    # e0's pairs 1, 4 then two padding rows (sentinel 6), e1's 3 and three, e2's 0, 2, 5 and one. The bound on
    # the rows (the host does not know which experts were chosen) is 6 pairs + 4 experts * 3 padding rows,
    # rounded up to a block: 20, and its blocks past the 12 rows have the expert 4 (none).
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_pairs, block_experts, num_rows = align_pairs_by_expert(ids, num_experts=4, block_m=4)
    assert sorted_pairs.tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6] + [6] * 8
    assert block_experts.tolist() == [0, 1, 2, 4, 4]
    assert num_rows.tolist() == [12]


@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_blocks_hold_one_expert_each(block_m):
    pytest.importorskip("triton")
    from batchllm.kernels.moe import align_pairs_by_expert

    ids = random_routing(50, 4, 16, torch.Generator().manual_seed(5), allowed=list(range(0, 16, 3)))
    sorted_pairs, block_experts, num_rows = align_pairs_by_expert(ids, 16, block_m)
    flat, rows = ids.flatten(), int(num_rows)
    assert rows % block_m == 0 and sorted_pairs[rows:].eq(flat.numel()).all()
    real = sorted_pairs[:rows] < flat.numel()
    assert sorted(sorted_pairs[:rows][real].tolist()) == list(range(flat.numel())), "each pair exactly once"
    row_experts = block_experts[:rows // block_m].repeat_interleave(block_m)
    assert torch.equal(row_experts[real], flat[sorted_pairs[:rows][real].long()].int())
    counts = torch.bincount(flat, minlength=16)
    blocks_per_expert = [-(-int(counts[e]) // block_m) for e in range(16)]
    assert block_experts[:rows // block_m].tolist() == [e for e in range(16) for _ in range(blocks_per_expert[e])]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 100, 600])
@pytest.mark.parametrize(("activation", "bias", "num_experts", "top_k"), [("silu", False, 128, 8),
                                                                         ("swigluoai", True, 32, 4)])
def test_triton_bfloat16_on_gpu(num_tokens, activation, bias, num_experts, top_k):
    from batchllm import kernels

    fused_moe_triton = _fused_moe_triton()
    ids = random_routing(num_tokens, top_k, num_experts, torch.Generator().manual_seed(6))
    args = make_moe(ids, num_experts, 1024, 384, torch.bfloat16, bias, seed=7, device="cuda")
    limit = 7.0 if activation == "swigluoai" else None
    got = fused_moe_triton(**args, activation=activation, swiglu_limit=limit)
    check(got, args, activation, limit)
    if kernels.triton_enabled():  # the dispatch takes the kernel on CUDA
        assert torch.equal(kernels.fused_moe(**args, activation=activation, swiglu_limit=limit), got)


def test_dispatch_functions_survive_the_kernel_modules_import():
    """Importing a kernel module binds it as an attribute of the package: one named like a dispatch function
    (kernels/fused_moe.py once did) would replace that function after Triton's first use."""
    from batchllm import kernels

    kernels._triton()
    assert all(callable(getattr(kernels, name)) and not isinstance(getattr(kernels, name), type(kernels))
               for name in kernels.__all__)
