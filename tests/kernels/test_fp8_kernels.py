"""The FP8 (E4M3) kernels and quantizers against this file's own arithmetic, and the Triton kernels against
their references (`batchllm.kernels.reference`).

Quantization is checked bit for bit against an E4M3 encoder written here from the format's definition (4
exponent bits, bias 7, 3 mantissa bits, subnormals, no infinities, 0x7F NaN): the nearest code, ties to the
even one, saturated to ±448, with the scales computed here as absmax / 448 (at least 1e-12). Per-token
activation quantization (Triton, reference, dispatcher) and per-channel weight quantization are also checked
as round trips within the E4M3 error bound; FP8 KV writes against the same encoder and bound; FP8 paged
attention against the float32 reference on float32 caches that hold the dequantized FP8 values.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (tests/conftest.py), at small
shapes. The interpreter converts float32 to FP8 wrongly: ties round away from zero, a rounding carry out of the
mantissa is dropped when the exponent is odd (126.24 becomes 64, not 128), subnormals are rounded twice, and
0x7F decodes as 480 instead of NaN (triton-lang/triton#11897 fixes it). So on CPU every test here runs with
the interpreter's FP8 conversions replaced by torch's (nearest even, saturating like the GPU's `cvt.satfinite`):
what is tested is the kernels' arithmetic (scales, division, clamping, addressing), exactly. The `gpu`-marked
tests repeat the checks at real sizes on the GPU, where fp32 division in a Triton kernel is approximate and may
move a value by one E4M3 step. Outputs and unused cache slots are poisoned with NaN (0x7F for FP8) first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchllm import kernels
from batchllm.kernels import reference
from batchllm.model.quantization.fp8 import quantize_fp8_per_channel

pytest.importorskip("triton")

from batchllm.kernels.activation import silu_and_mul_fp8_triton, silu_and_mul_triton  # noqa: E402
from batchllm.kernels.attention import SplitKVWorkspace, paged_attention_triton, tile_config  # noqa: E402
from batchllm.kernels.fp8 import quantize_fp8_per_token_triton  # noqa: E402
from batchllm.kernels.kv_write import write_kv_triton  # noqa: E402
from batchllm.kernels.rmsnorm import rms_norm_fp8_triton, rms_norm_triton  # noqa: E402
from tests.kernels.test_triton_kernels import (  # noqa: E402
    BLOCK_SIZE,
    CUDA,
    DECODE_BATCH,
    DEVICE,
    SMALL_MIXED_BATCH,
    TOLERANCE,
    Batch,
    gpu_test,
    make_batch,
)

FP8 = torch.float8_e4m3fn
FP8_NAN_BYTE = 0x7F
MAX_CODE = 0x7E  # +448; -448 is 0xFE

# The values of the 127 non-negative finite E4M3 codes 0x00..0x7E, from the format's definition.
_CODES = torch.arange(127, dtype=torch.float64)
E4M3_VALUES = torch.where(_CODES < 8, (_CODES % 8) * 2.0**-9, (1 + (_CODES % 8) / 8) * 2.0 ** (_CODES // 8 - 7))
E4M3_MIDPOINTS = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2  # each exactly a tie between two neighbours


def fp8_bits(y: torch.Tensor) -> torch.Tensor:
    """The E4M3 code nearest each (non-NaN) value of `y`, ties to the even code, saturated to ±448: uint8 bits."""
    values = E4M3_VALUES.to(y.device)
    magnitude = y.double().abs()
    hi = torch.searchsorted(values, magnitude.contiguous()).clamp(max=126)  # the first code >= |y|
    lo = (hi - 1).clamp(min=0)
    below, above = magnitude - values[lo], values[hi] - magnitude
    code = torch.where(below < above, lo, torch.where(above < below, hi, torch.where(lo % 2 == 0, lo, hi)))
    return (code + 128 * torch.signbit(y).long()).to(torch.uint8)


def fp8_value(bits: torch.Tensor) -> torch.Tensor:
    """float64 values of finite E4M3 codes, decoded with the table above (not torch's float8 conversion)."""
    bits = bits.long()
    assert ((bits & 0x7F) != FP8_NAN_BYTE).all(), "NaN code where a value was expected"
    magnitude = E4M3_VALUES.to(bits.device)[bits & 0x7F]
    return torch.where(bits >= 128, -magnitude, magnitude)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 `max(absmax / 448, 1e-12)` of each row of `x`, shape `[rows, 1]`."""
    absmax = torch.stack([row.float().abs().max() for row in x]) if len(x) else torch.zeros(0)
    return torch.maximum(absmax / 448, torch.tensor(1e-12, dtype=torch.float32)).view(-1, 1)


def assert_within_e4m3_error(dequantized: torch.Tensor, original: torch.Tensor, scale: torch.Tensor | float) -> None:
    """RNE to 3 mantissa bits errs by at most half a step: 2**-4 |y| for normal y = x / scale, and 2**-10 for
    subnormals (step 2**-9); times the scale, plus 2**-24 relative for the float32 division (and saturation at
    448 of the row's absmax, which that covers)."""
    original = original.double().cpu()
    error = (dequantized.double().cpu() - original).abs()
    bound = (2**-4 * original.abs() + 2**-10 * torch.as_tensor(scale).double().cpu()) * (1 + 2**-20)
    assert (error <= bound).all(), f"max excess {(error - bound).max().item():.3g}"


def assert_within_one_e4m3_step(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | float) -> None:
    """GPU: dequantized values at most one E4M3 step apart (2**-3 |x| for normals, 2**-9 scale for subnormals),
    since fp32 division in a Triton kernel is approximate; and such moves must be rare, not a rounding rule."""
    scale = torch.as_tensor(scale, device=got.device).double()
    difference = (got.double() - expected.double()).abs()
    assert (difference <= (2**-3 * expected.double().abs() + 2**-9 * scale) * (1 + 2**-20)).all()
    assert (difference > 0).float().mean().item() < 1e-3, "more than 0.1% of the values round differently"


def assert_same_codes(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | float, what: str) -> None:
    """E4M3 codes (uint8) identical on CPU; on the GPU within one step (`assert_within_one_e4m3_step`)."""
    if CUDA:
        assert_within_one_e4m3_step(fp8_value(got) * scale, fp8_value(expected) * scale, scale)
        return
    differ = got != expected
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {differ.numel()} codes differ, e.g. "
                              f"{got[differ][:6].tolist()} where {expected[differ][:6].tolist()} was expected")


def assert_same_scales(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Identical on CPU; on the GPU within 2 ulps (`amax / 448`: the absmax is exact, the division may not be)."""
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=0, rtol=3e-7 if CUDA else 0, msg=what)


@pytest.fixture(autouse=True)
def exact_fp8_casts_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, the interpreter's conversions to and from float8e4nv done by torch instead (module docstring)."""
    if CUDA:
        return
    from triton.runtime import interpreter

    original = interpreter._convert_float
    floats = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8e4nv": FP8}
    ints = {8: (np.int8, np.uint8, torch.int8), 16: (np.int16, np.uint16, torch.int16),
            32: (np.int32, np.uint32, torch.int32)}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        names = (input_dtype.name, output_dtype.name)
        nearest = rounding_mode is None or rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE
        if "fp8e4nv" not in names or not set(names) <= floats.keys() or not nearest:
            return original(data, input_dtype, output_dtype, rounding_mode)
        signed = ints[input_dtype.primitive_bitwidth][0]
        x = torch.from_numpy(np.ascontiguousarray(data).view(signed).copy()).view(floats[input_dtype.name])
        if output_dtype.name == "fp8e4nv":
            x = x.float()
            x = torch.where(x.isnan(), x, x.clamp(-448, 448))  # saturating, as the GPU's cvt.rn.satfinite
        _, unsigned, torch_int = ints[output_dtype.primitive_bitwidth]
        return x.to(floats[output_dtype.name]).view(torch_int).numpy().view(unsigned).reshape(np.shape(data))

    monkeypatch.setattr(interpreter, "_convert_float", convert)


# ---- Per-token activation quantization ------------------------------------------------------------------------


def activation_rows(width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows that exercise every branch: ordinary, all zero, one huge outlier (the rest quantize to subnormals),
    tiny (the 1e-12 scale floor, and just above it), exact E4M3 ties at scale 1, and all negative."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, width, generator=gen)
    x[1] *= 30
    x[2] = 0
    x[3, width - 7] = 3e5  # past the first 1024-column block
    x[4] *= 1e-14  # absmax / 448 < 1e-12: the floor, and quotients down in the subnormals
    x[5] *= 1e-9
    ties = torch.cat([E4M3_MIDPOINTS, -E4M3_MIDPOINTS, E4M3_VALUES, -E4M3_VALUES]).float()
    x[6] = ties.repeat(-(-width // len(ties)))[:width]
    x[6, -1] = 448  # scale exactly 1
    x[7] = -x[7].abs() - 1e-3
    x[8, ::3] = 0
    assert torch.equal(x[6].to(dtype).float(), x[6]), "ties must be exact in the input dtype"
    return x.to(dtype)


def expected_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = row_scales(x)
    return fp8_bits(x.float() / scale), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_per_token_is_exact(dtype: torch.dtype) -> None:
    width = 1024 + 300  # two column blocks, the second ragged
    rows = activation_rows(width, dtype, seed=20)
    # Rows of a wider tensor whose extra columns are NaN: the kernel must respect the row stride and the width.
    wide = torch.full((rows.shape[0], width + 13), float("nan"), dtype=dtype)
    wide[:, :width] = rows
    x = wide[:, :width].to(DEVICE)
    expected_bits, expected_scale = expected_per_token(rows)

    for quantize in (quantize_fp8_per_token_triton, reference.quantize_fp8_per_token, kernels.quantize_fp8_per_token):
        q, scale = quantize(x)
        assert q.dtype == FP8 and q.shape == (rows.shape[0], width)
        assert scale.dtype == torch.float32 and scale.shape == (rows.shape[0], 1)
        assert_same_scales(scale, expected_scale, quantize.__name__)
        bits = q.view(torch.uint8).cpu()
        assert_same_codes(bits, expected_bits, expected_scale, quantize.__name__)

    assert scale[2].item() == pytest.approx(1e-12) and (bits[2] == 0).all()
    assert torch.equal(q[2].float() * scale[2], torch.zeros(width, device=DEVICE)), "a zero row comes back as 0"
    assert bits[3, width - 7] == MAX_CODE and ((bits[3] & 0x7F) < 0x08).float().mean() > 0.9  # the rest subnormal
    assert scale[4].item() == pytest.approx(1e-12) and scale[5].item() > 1e-12
    assert scale[6].item() == 1.0
    scale = scale.cpu()
    assert_within_e4m3_error(fp8_value(bits) * scale.double(), rows.float(), scale)
    absmax_at = rows.float().abs().argmax(dim=1)
    for row in (0, 1, 3, 5, 6, 7, 8):  # a row's absmax lands on ±448 (not row 4's: its scale is the floor)
        assert bits[row, absmax_at[row]] & 0x7F == MAX_CODE


def test_quantize_fp8_per_token_of_no_rows() -> None:
    x = torch.randn(0, 64, device=DEVICE)
    for quantize in (quantize_fp8_per_token_triton, reference.quantize_fp8_per_token, kernels.quantize_fp8_per_token):
        q, scale = quantize(x)
        assert q.shape == (0, 64) and q.dtype == FP8
        assert scale.shape == (0, 1) and scale.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_fp8_quantizes_the_product_per_token(dtype: torch.dtype) -> None:
    """The fused SiLU-and-mul of an FP8 down projection: the product of the SiLU-and-mul kernel quantized per token
    (by torch, and on the GPU bit for bit by the quantization kernel it replaces), and against torch's own
    `F.silu(gate) * up` quantized by hand."""
    d = 1024 + 300  # two column blocks, the second ragged
    gen = torch.Generator().manual_seed(22)
    gate_up = (torch.randn(6, 2 * d, generator=gen) * 3).to(dtype)
    gate_up[1] = 0  # a zero row: the floor scale
    gate_up[2, d + 5] = 2000  # one product far above the rest: saturates at ±448, the rest small
    gate_up[3, :d] = -30  # SiLU of large negative gates: tiny products
    gate_up[4, d - 3], gate_up[4, 2 * d - 3] = 40, 9  # the row's largest product in its ragged second block
    # Rows of a wider tensor whose extra columns are NaN: the kernel must respect the row stride.
    wide = torch.full((6, 2 * d + 7), float("nan"), dtype=dtype)
    wide[:, :2 * d] = gate_up
    x = wide[:, :2 * d].to(DEVICE)
    product = silu_and_mul_triton(x)
    kernel_bits, kernel_scale = expected_per_token(product.cpu())
    torch_bits, torch_scale = expected_per_token(torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:])
    if CUDA:
        unfused_q, unfused_scale = quantize_fp8_per_token_triton(product)
    # On the CPU the dispatcher runs the reference (torch's product); the kernel's product there is the interpreter's,
    # which rounds float32 to bfloat16 a few ulps off torch: only its float32 rows meet torch's.
    for fused, triton_path in ((silu_and_mul_fp8_triton, True), (kernels.silu_and_mul_fp8, CUDA)):
        q, scale = fused(x)
        bits = q.view(torch.uint8).cpu()
        assert q.dtype == FP8 and q.shape == (6, d) and scale.shape == (6, 1)
        if triton_path:
            assert_same_scales(scale, kernel_scale, fused.__name__)
            assert_same_codes(bits, kernel_bits, kernel_scale, fused.__name__)
        if not triton_path or dtype == torch.float32 or CUDA:
            assert_same_scales(scale, torch_scale, fused.__name__)
            assert_same_codes(bits, torch_bits, torch_scale, fused.__name__)
        if CUDA:
            assert torch.equal(q.view(torch.uint8), unfused_q.view(torch.uint8)) and torch.equal(scale, unfused_scale)
    assert scale[1].item() == pytest.approx(1e-12) and (bits[1] == 0).all()
    assert bits[2, 5].item() & 0x7F == MAX_CODE and bits[4, d - 3].item() & 0x7F == MAX_CODE
    empty_q, empty_scale = silu_and_mul_fp8_triton(x[:0])
    assert empty_q.shape == (0, d) and empty_scale.shape == (0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_quantizes_the_norm_per_token(dtype: torch.dtype, with_residual: bool) -> None:
    """The fused norm before an FP8 qkv or gate_up projection: the norm kernel's output quantized per token by this
    file's encoder (and on the GPU bit for bit by the quantization kernel it replaces), the residual stream the
    norm kernel's own; the dispatcher (on the CPU the reference norm and quantizer) likewise against the reference
    norm."""
    hidden = 300  # not a power of two: the row's block is masked
    gen = torch.Generator().manual_seed(23)
    rows = (torch.randn(5, hidden, generator=gen) * 2).to(dtype)
    residual = (torch.randn(5, hidden, generator=gen) * 2).to(dtype) if with_residual else None
    rows[1] = 0 if residual is None else -residual[1]  # a zero row (after the add): the floor scale
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    weight[7] = 300.0  # one output far above the rest: its row's scale is set by it, the rest small
    # Rows of a wider tensor whose extra columns are NaN: the kernel must respect the row stride.
    wide = torch.full((5, hidden + 9), float("nan"), dtype=dtype)
    wide[:, :hidden] = rows
    x = wide[:, :hidden].to(DEVICE)
    res = None if residual is None else residual.to(DEVICE)
    eps = 1e-5
    unfused = rms_norm_triton(x, weight.to(DEVICE), eps, res)
    normed, new_residual = unfused if res is not None else (unfused, None)
    kernel_bits, kernel_scale = expected_per_token(normed.cpu())
    torch_out = reference.rms_norm(rows, weight, eps, residual)
    torch_normed, torch_residual = torch_out if residual is not None else (torch_out, None)
    torch_bits, torch_scale = expected_per_token(torch_normed)
    for fused, triton_path in ((rms_norm_fp8_triton, True), (kernels.rms_norm_fp8, CUDA)):
        q, scale, fused_residual = fused(x, weight.to(DEVICE), eps, res)
        bits = q.view(torch.uint8).cpu()
        assert q.dtype == FP8 and q.shape == (5, hidden) and scale.shape == (5, 1)
        if triton_path:
            assert_same_scales(scale, kernel_scale, fused.__name__)
            assert_same_codes(bits, kernel_bits, kernel_scale, fused.__name__)
            assert (fused_residual is None) == (res is None)
            if res is not None:
                assert torch.equal(fused_residual, new_residual)
        if not triton_path:  # the norm's float32 sum and rsqrt are the kernel's own: the kernel meets its output above
            assert_same_scales(scale, torch_scale, fused.__name__)
            assert_same_codes(bits, torch_bits, torch_scale, fused.__name__)
            if res is not None:
                assert torch.equal(fused_residual.cpu(), torch_residual)
        if CUDA:
            unfused_q, unfused_scale = quantize_fp8_per_token_triton(normed)
            assert torch.equal(q.view(torch.uint8), unfused_q.view(torch.uint8)) and torch.equal(scale, unfused_scale)
    assert scale[1].item() == pytest.approx(1e-12) and (bits[1] == 0).all()
    assert (bits[[0, 2, 3, 4], 7] & 0x7F == MAX_CODE).all()  # the zero row aside
    empty_q, empty_scale, _ = rms_norm_fp8_triton(x[:0], weight.to(DEVICE), eps, None if res is None else res[:0])
    assert empty_q.shape == (0, hidden) and empty_scale.shape == (0, 1)


# ---- Per-channel weight quantization (CPU only: it runs at load time) ----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_per_channel_round_trip(dtype: torch.dtype) -> None:
    weight = activation_rows(300, dtype, seed=21)
    weight[0, 17] = -1e5  # a negative outlier
    q, scale = quantize_fp8_per_channel(weight)

    expected_scale = row_scales(weight).view(-1)
    assert q.dtype == FP8 and q.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (weight.shape[0],)
    assert torch.equal(scale, expected_scale)
    bits = q.view(torch.uint8)
    differ = bits != fp8_bits(weight.float() / expected_scale[:, None])
    assert not differ.any(), f"{int(differ.sum())} codes differ, at {differ.nonzero()[:6].tolist()}"

    dequantized = fp8_value(bits) * scale.double()[:, None]
    assert_within_e4m3_error(dequantized, weight.float(), scale[:, None])
    assert torch.equal(dequantized[2], torch.zeros(300, dtype=torch.float64)), "a zero row comes back as 0"
    assert bits[0, 17] == 0x80 | MAX_CODE and ((bits[0] & 0x7F) < 0x08).float().mean() > 0.9  # the rest subnormal
    # The bound is not slack: normal values use most of it, and the ties row rounds to even both ways.
    normal = (bits[1] & 0x7F) >= 0x08
    relative = ((dequantized[1] - weight[1].double()).abs() / weight[1].double().abs())[normal]
    assert relative.max() > 2**-5
    assert bits[6, -1] == MAX_CODE and scale[6] == 1.0
    for tie, rounded in ((1.0625, 0x38), (1.1875, 0x3A), (2**-10, 0x00), (3 * 2**-10, 0x02), (432.0, MAX_CODE)):
        at, negated = weight[6].float() == tie, weight[6].float() == -tie
        assert at.any() and (bits[6][at] == rounded).all() and (bits[6][negated] == 0x80 | rounded).all()


# ---- FP8 KV-cache writes ----------------------------------------------------------------------------------------


def fp8_cache(num_blocks: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    cache = torch.empty(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=FP8, device=DEVICE)
    cache.view(torch.uint8).fill_(FP8_NAN_BYTE)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(0.05, 2.0), (2.0, 0.05)])
def test_write_kv_fp8(k_scale: float, v_scale: float, dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(22)
    num_tokens, num_kv_heads, head_dim, num_blocks = 23, 3, 64, 64
    # K and V as views of a fused qkv output, the layout the model hands over.
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=gen, device=DEVICE)
    qkv[[4, 11]] *= 1000  # past 448 * scale for either scale: saturates to ±448
    qkv[[6, 15]] *= 1e-3  # subnormal codes, and zeros
    qkv = qkv.to(dtype)
    key = qkv[:, 3 * num_kv_heads * head_dim : 4 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 4 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = (num_blocks * BLOCK_SIZE - 1 - torch.randperm(8 * num_tokens, generator=gen, device=DEVICE))[:num_tokens]
    slots[torch.tensor([2, 9, 10, 22])] = -1
    k_cache, v_cache = fp8_cache(num_blocks, num_kv_heads, head_dim), fp8_cache(num_blocks, num_kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    write_kv_triton(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)

    reference.write_kv(key, value, expected_k, expected_v, slots, k_scale=k_scale, v_scale=v_scale)
    kept = slots >= 0
    written = slots[kept]
    for new, cache, expected, scale in ((key, k_cache, expected_k, k_scale), (value, v_cache, expected_v, v_scale)):
        flat = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        expected_flat = expected.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        original = new[kept].float()
        bits = flat[written]
        assert_same_codes(bits, expected_flat[written], scale, "Triton against reference.write_kv")
        assert_same_codes(bits, fp8_bits(original / torch.tensor(scale, dtype=torch.float32)), scale, "Triton")
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[written] = False
        assert (flat[untouched] == FP8_NAN_BYTE).all(), "Triton wrote a slot that no token maps to"
        assert (expected_flat[untouched] == FP8_NAN_BYTE).all(), "the reference wrote a slot that no token maps to"

        dequantized = fp8_value(bits) * scale
        in_range = original.abs() <= 448 * scale
        magnitude = bits & 0x7F
        assert in_range.any() and not in_range.all() and ((magnitude > 0) & (magnitude < 0x08)).any()
        assert_within_e4m3_error(dequantized[in_range], original[in_range], scale)
        assert torch.equal(dequantized[~in_range], torch.sign(original[~in_range]).double() * 448 * scale)


def test_write_kv_ignores_scales_for_model_dtype_caches() -> None:
    gen = torch.Generator(DEVICE).manual_seed(23)
    key, value = (torch.randn(5, 2, 32, generator=gen, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, -1, 40, 17, 0], device=DEVICE)
    for write in (write_kv_triton, reference.write_kv):
        k_cache = torch.full((4, BLOCK_SIZE, 2, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        v_cache = torch.full_like(k_cache, float("nan"))
        write(key, value, k_cache, v_cache, slots, k_scale=0.05, v_scale=2.0)
        kept = slots >= 0
        assert torch.equal(k_cache.view(-1, 2, 32)[slots[kept]], key[kept]), write.__name__
        assert torch.equal(v_cache.view(-1, 2, 32)[slots[kept]], value[kept]), write.__name__


# ---- FP8 paged attention ----------------------------------------------------------------------------------------


def to_fp8_batch(batch: Batch, k_scale: float, v_scale: float) -> tuple[Batch, Batch]:
    """The batch with FP8 caches holding K / k_scale and V / v_scale (NaN slots stay NaN, 0x7F), and the float32
    batch whose caches hold what those FP8 caches mean, dequantized here: `cache.float() * scale`."""
    k8, v8 = ((cache.float() / s).clamp(-448, 448).to(FP8) for cache, s in ((batch.k_cache, k_scale),
                                                                            (batch.v_cache, v_scale)))
    dequantized = Batch(batch.query, k8.float() * k_scale, v8.float() * v_scale, batch.metadata)
    return Batch(batch.query, k8, v8, batch.metadata), dequantized


def check_fp8_attention(batch: Batch, k_scale: float, v_scale: float, num_splits: int | None,
                        workspace: SplitKVWorkspace | None = None) -> None:
    fp8, dequantized = to_fp8_batch(batch, k_scale, v_scale)
    assert (fp8.k_cache.view(torch.uint8) == FP8_NAN_BYTE).float().mean() > 0.5, "unused slots must be NaN"
    scale = batch.query.shape[-1] ** -0.5
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention_triton(fp8.query, fp8.k_cache, fp8.v_cache, fp8.metadata, scale, out=out,
                                    workspace=workspace, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    assert result is out
    expected = dequantized.expected(scale)
    padding = out[batch.metadata.query_start_loc_cpu[-1]:]
    assert torch.equal(padding, torch.zeros_like(padding)), "padding rows must be zeros"
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[batch.query.dtype])
    # The reference reads FP8 caches the same way.
    got = reference.paged_attention(fp8.query, fp8.k_cache, fp8.v_cache, fp8.metadata, scale, k_scale, v_scale)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[batch.query.dtype])


def test_fp8_attention_mixed_batch() -> None:
    """Decode rows (a first token, long contexts), prefill chunks on cached context and a fresh prefill."""
    batch = make_batch(SMALL_MIXED_BATCH, 4, 64, torch.float32, seed=24, num_blocks=128)
    check_fp8_attention(batch, k_scale=0.05, v_scale=2.0, num_splits=1)


def test_fp8_attention_split_kv() -> None:
    batch = make_batch(SMALL_MIXED_BATCH, 2, 128, torch.float32, seed=25, num_blocks=128)
    workspace = SplitKVWorkspace(
        *(torch.full(shape, float("nan"), device=DEVICE) for shape in [(32, 4, 4, 128), (32, 4, 4), (32, 4, 4)])
    )
    check_fp8_attention(batch, k_scale=2.0, v_scale=0.05, num_splits=3, workspace=workspace)


@pytest.mark.parametrize(("gqa", "head_dim"), [(1, 64), (4, 128), (8, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_batch_with_16_bit_queries(gqa: int, head_dim: int, num_splits: int) -> None:
    """Decode-only batches over FP8 caches take 64-key tiles (tile_config): one to nine of them per sequence here,
    the last partial, and slices of whole tiles when split; no padding rows, as in an engine's decode step (the
    grid of one program per sequence)."""
    assert tile_config(1, 8, head_dim, torch.float16, kv_fp8=True).tile_n == 64
    batch = make_batch(DECODE_BATCH, gqa, head_dim, torch.float16, seed=gqa * head_dim, num_blocks=256, pad_tokens=0)
    check_fp8_attention(batch, k_scale=0.05, v_scale=2.0, num_splits=num_splits)


def test_attention_ignores_scales_for_model_dtype_caches() -> None:
    """KV scales come from the checkpoint whatever the cache dtype; only an FP8 cache applies them."""
    batch = make_batch([(1, 40), (5, 21)], 2, 32, torch.float32, seed=26, num_blocks=16)
    scale = 32**-0.5
    expected = batch.expected(scale)
    for num_splits in (1, 2):
        out = paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale,
                                     num_splits=num_splits, k_scale=0.5, v_scale=2.0)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    got = reference.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, 0.5, 2.0)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


# ---- Real sizes, on the GPU ------------------------------------------------------------------------------------


@gpu_test
@pytest.mark.parametrize("num_rows", [1, 333, 4096])
@pytest.mark.parametrize("width", [4096, 14336])
def test_gpu_quantize_fp8_per_token_at_llama3_8b_sizes(width: int, num_rows: int) -> None:
    gen = torch.Generator(DEVICE).manual_seed(num_rows + width)
    x = (torch.randn(num_rows, width, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
    x[0, 5] = 500  # an outlier row
    if num_rows > 1:
        x[1] = 0
    q, scale = quantize_fp8_per_token_triton(x)
    expected_q, expected_scale = reference.quantize_fp8_per_token(x)
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=3e-7)  # amax exact, / 448 within 2 ulps
    torch.testing.assert_close(scale.cpu(), row_scales(x.cpu()), atol=0, rtol=3e-7)
    assert_within_one_e4m3_step(q.float() * scale, expected_q.float() * expected_scale,
                                torch.maximum(scale, expected_scale))
    dispatched, dispatched_scale = kernels.quantize_fp8_per_token(x)
    assert torch.equal(dispatched.view(torch.uint8), q.view(torch.uint8)) and torch.equal(dispatched_scale, scale)
    if num_rows > 1:
        assert (q[1].view(torch.uint8) == 0).all()


@gpu_test
@pytest.mark.parametrize("num_rows", [1, 512, 4096])
def test_gpu_silu_and_mul_fp8_at_llama3_8b_sizes(num_rows: int) -> None:
    """Bit for bit the activation kernel then the quantization kernel, at llama3-8b's intermediate width."""
    gen = torch.Generator(DEVICE).manual_seed(num_rows)
    gate_up = (torch.randn(num_rows, 2 * 14336, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
    q, scale = kernels.silu_and_mul_fp8(gate_up)
    unfused_q, unfused_scale = quantize_fp8_per_token_triton(silu_and_mul_triton(gate_up))
    assert torch.equal(q.view(torch.uint8), unfused_q.view(torch.uint8)) and torch.equal(scale, unfused_scale)


@gpu_test
@pytest.mark.parametrize("num_rows", [1, 512, 4096])
def test_gpu_rms_norm_fp8_at_llama3_8b_sizes(num_rows: int) -> None:
    """Bit for bit the norm kernel then the quantization kernel, at llama3-8b's hidden size."""
    gen = torch.Generator(DEVICE).manual_seed(num_rows)
    x, residual = (torch.randn(2, num_rows, 4096, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
    weight = (torch.rand(4096, generator=gen, device=DEVICE) + 0.5).to(torch.bfloat16)
    q, scale, new_residual = kernels.rms_norm_fp8(x, weight, 1e-5, residual)
    normed, unfused_residual = rms_norm_triton(x, weight, 1e-5, residual)
    unfused_q, unfused_scale = quantize_fp8_per_token_triton(normed)
    assert torch.equal(q.view(torch.uint8), unfused_q.view(torch.uint8)) and torch.equal(scale, unfused_scale)
    assert torch.equal(new_residual, unfused_residual)


@gpu_test
def test_gpu_write_kv_fp8_at_llama3_8b_sizes() -> None:
    gen = torch.Generator(DEVICE).manual_seed(27)
    num_tokens, num_kv_heads, head_dim, num_blocks = 8192, 8, 128, 40_000
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=DEVICE).to(torch.bfloat16)
                  for _ in range(2))
    key[::97] *= 100  # saturates
    slots = num_blocks * BLOCK_SIZE - 1 - torch.randperm(num_tokens * 4, generator=gen, device=DEVICE)[:num_tokens]
    slots[::7] = -1
    k_cache, v_cache = fp8_cache(num_blocks, num_kv_heads, head_dim), fp8_cache(num_blocks, num_kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_triton(key, value, k_cache, v_cache, slots, k_scale=0.05, v_scale=2.0)
    reference.write_kv(key, value, expected_k, expected_v, slots, k_scale=0.05, v_scale=2.0)
    written = slots[slots >= 0]
    for cache, expected, scale in ((k_cache, expected_k, 0.05), (v_cache, expected_v, 2.0)):
        got_bits = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        expected_bits = expected.view(torch.uint8).view(-1, num_kv_heads, head_dim)
        assert_within_one_e4m3_step(fp8_value(got_bits[written]) * scale, fp8_value(expected_bits[written]) * scale,
                                    scale)
        untouched = torch.ones(got_bits.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[written] = False
        assert (got_bits[untouched] == FP8_NAN_BYTE).all()


@gpu_test
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_fp8_attention_bf16_queries(num_splits: int) -> None:
    rows = [(1, 2048), (1, 1999), (300, 2000), (1, 17), (512, 512), (1, 1)] + [(1, 700 + 61 * i) for i in range(20)]
    batch = make_batch(rows, gqa=4, head_dim=128, dtype=torch.bfloat16, seed=28, num_kv_heads=8, num_blocks=8_000)
    check_fp8_attention(batch, k_scale=0.05, v_scale=0.02, num_splits=num_splits)
