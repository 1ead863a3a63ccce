"""4- and 8-bit integer checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) of the real default model
(SmolLM2-135M-Instruct), written here in each producer's layout (tests/unit/int4_writers.py says how, and from
which producer code), loaded with our loader and compared with the test's own dequantization.

- Weights: every fused linear's `dequantized_weight()` (float32 `[out, in]`, the HF shards concatenated q, k, v /
  gate, up) equals, bit for bit, `(q - zero) * scale` computed here from the codes, zeros and scales that were
  packed (GPTQ, AWQ) or from this file's own unpacking of what compressed-tensors wrote; embeddings and norms
  stay the checkpoint's. Exact: the codes and zeros are small integers and the scales fp16 / float32, so both
  sides compute one exact subtraction and one correctly rounded float32 product.
- Greedy: for four representative formats, `LLM(dir)` greedy tokens equal HF transformers' `generate` on the
  original model with the same dequantized weights substituted. The original there is a small random Llama of
  the default model's vocabulary and head layout, whose hidden size (192) is, like the real 576, not a multiple of
  128: the engine's int4 path and HF meet on the same weights, which need not be the real ones to be compared;
  the real model's checkpoints of these formats are checked weight by weight above.
- Independent references, so that this file's writers are not the only witness of each layout: compressed-tensors'
  own decompression equals this file's reading of its checkpoints; a hand-made 8 x 32 k_proj per format, its
  packed words written out as hex literals (nibble by nibble from the format description), is loaded and
  dequantized to the values of its defining formula; and, where AutoGPTQ / AutoAWQ are importable (not test
  dependencies: see `test_writers_pack_like_autogptq_and_autoawq`), their own packers give the same words.
- Refusals: bit widths, AWQ versions, compressed-tensors formats and GPTQ checkpoint formats we do not read raise
  a ValueError saying what is supported.

Group sizes: 576 (the hidden size) is not a multiple of 128. AutoGPTQ / GPTQModel write a partial last group
there (ceil(576 / 128) = 5 groups), so GPTQ g128 is tested on the real model; AutoAWQ (`assert in_features %
group_size == 0`) and compressed-tensors (`_process_group` raises) cannot quantize it, so AWQ g128 and
compressed-tensors W4A16 (group 128) are tested, weights only, on a random tiny Llama whose sizes are multiples of
128, as are the variants whose point is only the layout (gptq_v2 zeros, 8-bit act-order, compressed-tensors
asymmetric channel and 8-bit), to keep the file's run short. The real-model act-order case holds one group whose
values are all >= 0, so zero point 0, which v1 can only store as GPTQModel does (see
`test_gptq_v1_zero_point_of_zero_borrows_as_gptqmodel_writes_it`).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from batchllm import LLM, SamplingParams
from batchllm.model.default_model import default_model_path
from batchllm.model.loader import load_model
from tests.hf_greedy import hf_greedy_tokens
from tests.unit import int4_writers as iw
from tests.unit.test_fp8_checkpoints import (
    FUSED,
    PROMPTS,
    assert_unquantized_tensors_kept,
    compressed_tensors_config,
    hf_parts,
    write_checkpoint,
)
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

MAX_NEW = 24
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=True)
# The hand example's model: k_proj is 8 x 32 (one KV head of 8), two groups of 16 in-features.
HAND = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
            head_dim=8, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=True)
HAND_GROUP = 16
# The greedy cases' model: the default model's vocabulary (its tokenizer reads the prompts) and GQA layout (3 query
# heads per KV head of 64), a hidden size that leaves GPTQ g128 a partial last group, as 576 does.
SMALL = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
             head_dim=64, vocab_size=49152, max_position_embeddings=256, tie_word_embeddings=True)


def fused_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    modules = dict(model.named_modules())
    return {f"model.layers.{n}.{fused}": modules[f"model.layers.{n}.{fused}"]
            for n in range(len(model.model.layers)) for fused in FUSED}


def assert_weights_equal(model: torch.nn.Module, expected: Callable[[str], torch.Tensor]) -> None:
    for name, module in fused_modules(model).items():
        ours = module.dequantized_weight()
        reference = torch.cat([expected(part) for part in hf_parts(name)])
        assert ours.dtype == torch.float32 and ours.shape == reference.shape, (name, ours.dtype, ours.shape)
        if not torch.equal(ours, reference):
            rows = (ours != reference).any(dim=1).nonzero().flatten()
            pytest.fail(f"{name}: {len(rows)} of {len(ours)} rows differ (first {rows[:8].tolist()}), max |diff| "
                        f"{(ours - reference).abs().max().item():.3g}")


# --- the cases: each checkpoint written once per module, on first use -------------------------------------------


def input_of(hf_name: str) -> str:
    """`model.layers.3.self_attn.k_proj` → `model.layers.3.self_attn.qkv_proj`: the fused module reading its input."""
    prefix, part = hf_name.rsplit(".", 2)[0], ".".join(hf_name.rsplit(".", 2)[1:])
    return next(f"{prefix}.{fused}" for fused, parts in FUSED.items() if part in parts)


def gptq_case(bits: int, group_size: int, sym: bool, act_order: bool = False, v1: bool = True):
    def write(directory: Path, original: Path, weights: dict[str, torch.Tensor]) -> iw.Case:
        # GPTQ's act-order permutation sorts the Hessian diagonal of the layer's input, so projections of one input
        # (q/k/v, gate/up) share it: one seeded permutation per input.
        inputs = sorted({input_of(name) for name in iw.linear_names(weights)})

        def quantize(name: str, w: torch.Tensor) -> iw.Quantized:
            seed = inputs.index(input_of(name))
            groups, num_groups = (iw.act_order_groups(w.shape[1], group_size, seed) if act_order
                                  else iw.contiguous_groups(w.shape[1], group_size))
            return iw.quantize_gptq(w, groups, num_groups, bits, sym)

        config = iw.gptq_config(bits, group_size, act_order, sym, "gptq" if v1 else "gptq_v2", gptqmodel=not v1)
        return iw.write_int_checkpoint(directory, original, weights, quantize,
                                       lambda q: iw.gptq_tensors(q, bits, v1), config)
    return write


def awq_case(group_size: int):
    def write(directory: Path, original: Path, weights: dict[str, torch.Tensor]) -> iw.Case:
        def quantize(name: str, w: torch.Tensor) -> iw.Quantized:
            return iw.quantize_awq(w, *iw.contiguous_groups(w.shape[1], group_size))

        return iw.write_int_checkpoint(directory, original, weights, quantize, iw.awq_tensors,
                                       iw.awq_config(group_size))
    return write


def ct_case(preset: str, strategy: str, group_size: int | None, dtype: torch.dtype = torch.float32):
    def write(directory: Path, original: Path, weights: dict[str, torch.Tensor]) -> iw.Case:
        pytest.importorskip("compressed_tensors")
        iw.write_compressed_tensors(directory, original, preset, strategy, group_size, dtype)
        stored = load_file(directory / "model.safetensors")
        bits = 8 if preset.startswith("W8") else 4
        return iw.Case(directory, lambda name: iw.ct_dequantize(stored, name, bits))
    return write


# name: (model, writer); "default" is SmolLM2-135M, "tiny" and "small" random Llamas of TINY's and SMALL's sizes.
CASES = {
    "gptq-4bit-sym-g128": ("default", gptq_case(4, 128, sym=True)),
    "gptq-4bit-asym-g32-desc-act": ("default", gptq_case(4, 32, sym=False, act_order=True)),
    "gptq-4bit-sym-channel": ("default", gptq_case(4, -1, sym=True)),
    "gptq-8bit-sym-g128": ("default", gptq_case(8, 128, sym=True)),
    "gptq-v2-4bit-asym-g128-tiny": ("tiny", gptq_case(4, 128, sym=False, v1=False)),
    "gptq-8bit-asym-g64-desc-act-tiny": ("tiny", gptq_case(8, 64, sym=False, act_order=True)),
    "awq-g64": ("default", awq_case(64)),
    "awq-g128-tiny": ("tiny", awq_case(128)),
    "ct-w4a16-asym-g32": ("default", ct_case("W4A16_ASYM", "group", 32)),
    "ct-w4a16-sym-channel": ("default", ct_case("W4A16", "channel", None)),
    "ct-w4a16-sym-g128-tiny-bf16": ("tiny", ct_case("W4A16", "group", 128, torch.bfloat16)),
    "ct-w4a16-asym-channel-tiny": ("tiny", ct_case("W4A16_ASYM", "channel", None)),
    "ct-w8a16-sym-g128-tiny": ("tiny", ct_case("W8A16", "group", 128)),
    # The greedy comparisons' formats again, on the small model.
    "gptq-4bit-sym-g128-small": ("small", gptq_case(4, 128, sym=True)),
    "gptq-4bit-asym-g32-desc-act-small": ("small", gptq_case(4, 32, sym=False, act_order=True)),
    "awq-g64-small": ("small", awq_case(64)),
    "ct-w4a16-asym-g32-small": ("small", ct_case("W4A16_ASYM", "group", 32)),
}
GREEDY = [name for name in CASES if name.endswith("-small")]
CT_CASES = [name for name in CASES if name.startswith("ct-")]
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


@pytest.fixture(scope="module")
def original() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tiny_original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-float")
    save_tiny_checkpoint(LlamaConfig(**TINY), directory)
    return directory


@pytest.fixture(scope="module")
def small_original(tmp_path_factory: pytest.TempPathFactory, original: Path) -> Path:
    directory = tmp_path_factory.mktemp("small-float")
    save_tiny_checkpoint(LlamaConfig(**SMALL), directory)
    for path in original.iterdir():  # the tokenizer, for `LLM(dir)`
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, original: Path, tiny_original: Path, small_original: Path):
    """name → (Case, original directory, original weights), writing each checkpoint on first use."""
    written: dict[str, tuple[iw.Case, Path, dict[str, torch.Tensor]]] = {}
    sources = {"default": original, "tiny": tiny_original, "small": small_original}
    originals: dict[str, dict[str, torch.Tensor]] = {}

    def get(name: str):
        if name not in written:
            model, write = CASES[name]
            if model not in originals:
                originals[model] = load_file(sources[model] / "model.safetensors")
            case = write(tmp_path_factory.mktemp(name), sources[model], originals[model])
            written[name] = (case, sources[model], originals[model])
        return written[name]
    return get


@pytest.fixture(scope="module")
def prompts(original: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(original)
    return [tokenizer(text).input_ids for text in PROMPTS]


# --- (a) weights ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_dequantized_weights_equal_the_tests_own(name: str, checkpoints) -> None:
    case, _, _ = checkpoints(name)
    model, _ = load_model(case.directory, "cpu", torch.float32)

    assert_weights_equal(model, case.expected)
    # Embeddings and norms as the checkpoint holds them (the bf16 case's, upcast exactly).
    stored = load_file(case.directory / "model.safetensors")
    assert_unquantized_tensors_kept(model, {name: t.float() for name, t in stored.items() if t.is_floating_point()})


# --- (b) greedy outputs against HF on the same dequantized weights -------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(small_original: Path):
    """HF's float32 model of the greedy cases' original; each greedy case overwrites every decoder linear's
    weight."""
    return AutoModelForCausalLM.from_pretrained(small_original, dtype=torch.float32).eval()


def hf_greedy(model, expected: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor],
              prompts: list[list[int]]) -> list[list[int]]:
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in iw.linear_names(weights):
            modules[name].weight.copy_(expected(name))
    return hf_greedy_tokens(model, prompts, MAX_NEW)


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_equals_hf_on_the_dequantized_weights(name: str, checkpoints, hf_model,
                                                      prompts: list[list[int]]) -> None:
    case, _, weights = checkpoints(name)
    reference = hf_greedy(hf_model, case.expected, weights, prompts)

    llm = LLM(str(case.directory), device="cpu", max_model_len=256, num_kv_blocks=64, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(len(r) > 4 for r in reference), "the reference stopped early: a test of nothing"


# --- (c) independent references for the layouts ---------------------------------------------------------------------


@pytest.mark.parametrize("name", CT_CASES)
def test_compressed_tensors_decompression_equals_the_tests_own(name: str, checkpoints) -> None:
    """compressed-tensors' own `PackedQuantizationCompressor.decompress` (unpack_from_int32 + dequantize) of every
    linear equals `ct_dequantize`, this file's reading; with the weights test above, ours equals the library's.
    bf16 scales are given to the library as float32: in bf16 its `(q - zero) * scale` rounds the product to bf16,
    while the checkpoint's exact weight (and what we compute) is the float32 product."""
    case, _, weights = checkpoints(name)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(
        json.loads((case.directory / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    assert config.format == "pack-quantized" and scheme.weights.type == "int"
    stored = load_file(case.directory / "model.safetensors")
    for hf_name in iw.linear_names(weights):
        local = {suffix: stored[f"{hf_name}.{suffix}"] for suffix in CT_SUFFIXES if f"{hf_name}.{suffix}" in stored}
        local["weight_scale"] = local["weight_scale"].float()
        theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(theirs, case.expected(hf_name)), hf_name


def test_gptq_and_awq_writers_round_trip_in_the_producers_shapes(checkpoints) -> None:
    """This file's field-by-field unpacking of what its writers stored gives back the codes and zeros they
    packed, in the producers' shapes and dtypes (a check on the writers, not on the loader)."""
    for name, pack, zero_offset, order in [("gptq-4bit-sym-g128", 8, -1, None), ("gptq-8bit-sym-g128", 4, -1, None),
                                          ("gptq-v2-4bit-asym-g128-tiny", 8, 0, None), ("awq-g64", 8, 0, iw.AWQ_ORDER)]:
        case, _, _ = checkpoints(name)
        stored = load_file(case.directory / "model.safetensors")
        bits = 32 // pack
        for hf_name in ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]:
            q = case.quantized[hf_name]
            (out_features, in_features), groups = q.codes.shape, q.scales.shape[0]
            qweight, qzeros, scales = (stored[f"{hf_name}.{s}"] for s in ("qweight", "qzeros", "scales"))
            assert qweight.dtype == qzeros.dtype == torch.int32 and scales.dtype == torch.float16
            assert tuple(qzeros.shape) == (groups, out_features // pack) and tuple(scales.shape) == (groups,
                                                                                                    out_features)
            if order is None:  # GPTQ: packed along the in-features
                assert tuple(qweight.shape) == (in_features // pack, out_features)
                assert torch.equal(iw.unpack_last(qweight.T.contiguous(), bits), q.codes.long())
                assert torch.equal(stored[f"{hf_name}.g_idx"], q.groups.to(torch.int32))
            else:  # AWQ: along the out-features, interleaved
                assert tuple(qweight.shape) == (in_features, out_features // pack)
                assert torch.equal(iw.unpack_last(qweight, bits, order), q.codes.long().T)
            assert torch.equal(iw.unpack_last(qzeros, bits, order) - zero_offset, q.zeros), (name, hf_name)
            assert torch.equal(scales, q.scales)


def _producer_module(package: str, relative: str):
    """One file of an installed producer package, loaded by path: auto_gptq 0.7's package __init__ needs
    transformers < 5, but its pack code is plain torch + numpy."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (optional: pip install --no-deps {package})")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    module_spec = importlib.util.spec_from_file_location(f"_producer_{package}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("producer", ["auto_gptq", "awq"])
def test_writers_pack_like_autogptq_and_autoawq(producer: str, original: Path) -> None:
    """Where the producers are installed (neither is a test dependency; both install on a CPU box with
    `pip install --no-deps auto-gptq` / `autoawq`), their own packers, given our quantization, write the same
    words: AutoGPTQ's `QuantLinear.pack` (v1, with g_idx) and AutoAWQ's `WQLinear_GEMM.from_linear`."""
    weight = load_file(original / "model.safetensors")["model.layers.3.self_attn.k_proj.weight"]  # 192 x 576
    out_features, in_features = weight.shape
    if producer == "auto_gptq":
        qlinear = _producer_module("auto_gptq", "nn_modules/qlinear/qlinear_cuda.py")
        for bits, group_size, act_order, sym in [(4, 128, False, True), (4, 32, True, False), (8, 128, False, True),
                                                 (4, -1, False, False)]:
            groups, num_groups = (iw.act_order_groups(in_features, group_size, 0) if act_order
                                  else iw.contiguous_groups(in_features, group_size))
            q = iw.quantize_gptq(weight, groups, num_groups, bits, sym)
            ours = iw.gptq_tensors(q, bits, v1=True)
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = q.dequantize()
            theirs = qlinear.QuantLinear(bits, group_size, in_features, out_features, False)
            theirs.pack(linear, q.scales.float().T.contiguous(), q.zeros.T.contiguous().clone(),
                        g_idx=q.groups.to(torch.int32))
            for part in ("qweight", "qzeros", "g_idx"):
                assert torch.equal(getattr(theirs, part), ours[part]), (bits, group_size, part)
    else:
        gemm = pytest.importorskip("awq.modules.linear.gemm")
        for group_size in (32, 64):
            q = iw.quantize_awq(weight, *iw.contiguous_groups(in_features, group_size))
            ours = iw.awq_tensors(q)
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = q.dequantize()
            theirs = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=q.scales.float(),
                                                    zeros=q.zeros.clone())
            for part in ("qweight", "qzeros", "scales"):
                assert torch.equal(getattr(theirs, part), ours[part]), (group_size, part)


# --- the hand example: 8 x 32 k_proj, words written out ------------------------------------------------------------
# Codes q[n, k] = (k + n + k // 16) % 16 (n the out-feature, k the in-feature); two groups of 16 in-features,
# scales s[g, n] = 2**-(n % 4) * (1 + g / 2) (exact in fp16); w[n, k] = (q[n, k] - zero[k // 16, n]) * s[k // 16, n].
# Each hex word is read right to left: its last digit is field 0.

# GPTQ qweight [32 / 8, 8]: word (r, n), digit i = q[n, 8 r + i].
HAND_GPTQ_QWEIGHT = [
    "76543210 87654321 98765432 A9876543 BA987654 CBA98765 DCBA9876 EDCBA987",
    "FEDCBA98 0FEDCBA9 10FEDCBA 210FEDCB 3210FEDC 43210FED 543210FE 6543210F",
    "87654321 98765432 A9876543 BA987654 CBA98765 DCBA9876 EDCBA987 FEDCBA98",
    "0FEDCBA9 10FEDCBA 210FEDCB 3210FEDC 43210FED 543210FE 6543210F 76543210",
]
# GPTQ zero[g, n] = 1 + n + 4 g; qzeros [2, 1]: digit i = zero[g, i] - 1 (v1) or zero[g, i] (v2).
HAND_GPTQ_QZEROS = {"v1": ["76543210", "BA987654"], "v2": ["87654321", "CBA98765"]}
# AWQ qweight [32, 1]: word k, digit i = q[AWQ_ORDER[i], k] = q[(0, 2, 4, 6, 1, 3, 5, 7)[i], k]; with
# c = k + k // 16, the digits (c+7)(c+5)(c+3)(c+1)(c+6)(c+4)(c+2)(c), mod 16. Rows k = 16..31 have c = 17..32.
_AWQ_ROWS = ["75316420", "86427531", "97538642", "A8649753", "B975A864", "CA86B975", "DB97CA86", "ECA8DB97",
             "FDB9ECA8", "0ECAFDB9", "1FDB0ECA", "20EC1FDB", "31FD20EC", "420E31FD", "531F420E", "6420531F"]
HAND_AWQ_QWEIGHT = _AWQ_ROWS + _AWQ_ROWS[1:] + _AWQ_ROWS[:1]
# AWQ zero[g, n] = n + 4 g, interleaved like the weights (c = 0 and c = 4 above).
HAND_AWQ_QZEROS = ["75316420", "B975A864"]
# compressed-tensors weight_packed [8, 32 / 8]: word (n, j), digit i = q[n, 8 j + i] (= signed code + 8): the GPTQ
# words transposed. weight_zero_point [8 / 8, 2]: digit i of word g = zero[g, i] = i + 4 g (signed zero + 8).
HAND_CT_ZERO_POINT = ["76543210 BA987654"]


def words(rows: list[str]) -> torch.Tensor:
    return iw.to_int32(torch.tensor([[int(word, 16) for word in row.split()] for row in rows]))


def hand_codes() -> torch.Tensor:
    k, n = torch.arange(32), torch.arange(8)[:, None]
    return (k + n + k // 16) % 16


def hand_scales() -> torch.Tensor:
    n, g = torch.arange(8), torch.arange(2)[:, None]
    return (2.0 ** -(n % 4) * (1 + g / 2)).half()


def hand_zeros(fmt: str) -> torch.Tensor:
    n, g = torch.arange(8), torch.arange(2)[:, None]
    return n + 4 * g + (1 if fmt.startswith("gptq") else 0)


def hand_weight(fmt: str, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The defining formula, in float64 (every value exact), as float32."""
    zeros, scales = hand_zeros(fmt) if zeros is None else zeros, hand_scales().double()
    group = torch.arange(32) // 16
    return ((hand_codes() - zeros[group].T).double() * scales[group].T).float()


def hand_tensors(fmt: str) -> dict[str, torch.Tensor]:
    """The hand k_proj's checkpoint tensors, from the literals above."""
    if fmt in ("gptq-v1", "gptq-v2"):
        return {"qweight": words(HAND_GPTQ_QWEIGHT), "qzeros": words(HAND_GPTQ_QZEROS[fmt[-2:]]),
                "scales": hand_scales(), "g_idx": (torch.arange(32) // 16).to(torch.int32)}
    if fmt == "awq":
        return {"qweight": words(HAND_AWQ_QWEIGHT), "qzeros": words(HAND_AWQ_QZEROS),
                "scales": hand_scales()}
    return {"weight_packed": words(HAND_GPTQ_QWEIGHT).T.contiguous(), "weight_zero_point": words(HAND_CT_ZERO_POINT),
            "weight_scale": hand_scales().float().T.contiguous(), "weight_shape": torch.tensor([8, 32])}


HAND_FORMATS = ["gptq-v1", "gptq-v2", "awq", "ct-asym"]


def test_writers_reproduce_the_hand_words() -> None:
    """This file's packers (and compressed-tensors' `pack_to_int32`) turn the hand codes into the hand words."""
    codes, scales, group = hand_codes(), hand_scales(), torch.arange(32) // 16
    for fmt in ("gptq-v1", "gptq-v2"):
        q = iw.Quantized(codes.to(torch.uint8), hand_zeros(fmt), scales, group)
        packed = iw.gptq_tensors(q, 4, v1=fmt == "gptq-v1")
        for part, tensor in hand_tensors(fmt).items():
            assert torch.equal(packed[part], tensor), (fmt, part)
        assert torch.equal(q.dequantize(), hand_weight(fmt))
    q = iw.Quantized(codes.to(torch.uint8), hand_zeros("awq"), scales, group)
    for part, tensor in hand_tensors("awq").items():
        assert torch.equal(iw.awq_tensors(q)[part], tensor), part
    ct = hand_tensors("ct-asym")
    assert torch.equal(iw.ct_dequantize({f"k.{s}": t for s, t in ct.items()}, "k"), hand_weight("ct-asym"))
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    assert torch.equal(pack_to_int32((codes - 8).to(torch.int8), 4), ct["weight_packed"])
    signed_zero = (hand_zeros("ct-asym").T - 8).to(torch.int8)  # [8, 2], as the library holds it
    assert torch.equal(pack_to_int32(signed_zero, 4, packed_dim=0), ct["weight_zero_point"])


@pytest.fixture(scope="module")
def hand_original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hand-float")
    save_tiny_checkpoint(LlamaConfig(**HAND), directory)
    return directory


@pytest.mark.parametrize("fmt", HAND_FORMATS)
def test_hand_example_loads_to_its_formula(fmt: str, tmp_path: Path, hand_original: Path) -> None:
    """The hand model: every linear written by this file's writers (compressed-tensors: by the library) but
    layer 0's k_proj, which is the hand literals; its rows of the fused qkv_proj (32..40) are the formula."""
    weights = load_file(hand_original / "model.safetensors")
    if fmt == "ct-asym":
        pytest.importorskip("compressed_tensors")
        iw.write_compressed_tensors(tmp_path, hand_original, "W4A16_ASYM", "group", HAND_GROUP)
        stored = load_file(tmp_path / "model.safetensors")
        expected = lambda name: iw.ct_dequantize(stored, name)  # noqa: E731
    else:
        case = (gptq_case(4, HAND_GROUP, sym=False, v1=fmt == "gptq-v1") if fmt.startswith("gptq")
                else awq_case(HAND_GROUP))(tmp_path, hand_original, weights)
        stored, expected = load_file(tmp_path / "model.safetensors"), case.expected
    name = "model.layers.0.self_attn.k_proj"
    assert all(stored[f"{name}.{part}"].shape == tensor.shape for part, tensor in hand_tensors(fmt).items())
    stored.update({f"{name}.{part}": tensor for part, tensor in hand_tensors(fmt).items()})
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(tmp_path, "cpu", torch.float32)

    qkv = model.model.layers[0].self_attn.qkv_proj.dequantized_weight()
    assert torch.equal(qkv[32:40], hand_weight(fmt))
    assert torch.equal(qkv[:32], expected("model.layers.0.self_attn.q_proj"))
    assert torch.equal(qkv[40:], expected("model.layers.0.self_attn.v_proj"))


def test_gptq_v1_zero_point_of_zero_borrows_as_gptqmodel_writes_it(tmp_path: Path, hand_original: Path) -> None:
    """An asymmetric group whose values are all >= 0 has zero point 0 (GPTQ widens the range to hold 0), and v1's
    `zero - 1` is then -1. GPTQModel, today's GPTQ producer, writes v1 by subtracting 0x11111111 from each packed
    v2 word and reads it back by adding 0x11111111 (`convert_gptq_v2_to_v1_format_module` and its inverse,
    gptqmodel/utils/model.py): the -1 borrows from the next field, and only the whole-word addition undoes it.
    (AutoGPTQ's per-field `zeros -= 1` ORs an unmasked uint32 -1 into the word, so its v1 cannot hold a zero of 0
    at all.) Hand k_proj: zero[0, 4] = 0, the v2 word 0x87604321 written as 0x87604321 - 0x11111111 = 0x764F3210
    (field 4 is F, field 5 is 6 - 1 - 1 = 4). The real-model act-order case meets one such group
    (model.layers.2.mlp.down_proj, row 100)."""
    zeros = hand_zeros("gptq-v1")
    zeros[0, 4] = 0
    packed = {**hand_tensors("gptq-v1"), "qzeros": words(["764F3210", "BA987654"])}
    assert torch.equal(iw.gptq_tensors(iw.Quantized(hand_codes().to(torch.uint8), zeros, hand_scales(),
                                                    torch.arange(32) // 16), 4, v1=True)["qzeros"], packed["qzeros"])
    weights = load_file(hand_original / "model.safetensors")
    gptq_case(4, HAND_GROUP, sym=False)(tmp_path, hand_original, weights)
    stored = load_file(tmp_path / "model.safetensors")
    stored.update({f"model.layers.0.self_attn.k_proj.{part}": tensor for part, tensor in packed.items()})
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(tmp_path, "cpu", torch.float32)

    k = model.model.layers[0].self_attn.qkv_proj.dequantized_weight()[32:40]
    expected = hand_weight("gptq-v1", zeros)
    assert torch.equal(k[:4], expected[:4]) and torch.equal(k[6:], expected[6:])
    assert torch.equal(k[4:6], expected[4:6]), ("rows 4, 5 (zero points 0 and 6)", k[4:6, :3], expected[4:6, :3])


# --- (d) refusals ----------------------------------------------------------------------------------------------------

CT_INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
REFUSED: dict[str, tuple[Callable[[], dict], str]] = {  # name: (quantization_config, a word the message must name)
    "gptq-3bit": (lambda: iw.gptq_config(3, 128, False, True), "3"),
    "gptq-2bit": (lambda: iw.gptq_config(2, 128, False, True), "2"),
    "awq-gemv": (lambda: iw.awq_config(128, version="gemv"), "gemv"),
    "gptq-marlin-format": (lambda: iw.gptq_config(4, 128, False, True, checkpoint_format="marlin"), "marlin"),
    "exl2": (lambda: {"quant_method": "exl2", "bits": 4.0, "head_bits": 6}, "exl2"),
    "ct-marlin-24": (lambda: compressed_tensors_config("marlin-24", CT_INT4, None), "marlin-24"),
    "ct-float-4bit-pack-quantized": (lambda: compressed_tensors_config(
        "pack-quantized", {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}, None), "float"),
    "ct-nvfp4": (lambda: compressed_tensors_config(
        "nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
        None), "nvfp4"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_integer_formats_are_refused(case: str, tmp_path: Path, original: Path) -> None:
    config, word = REFUSED[case]
    # The original float32 weights beside the config, so the quantization_config is the only thing wrong.
    write_checkpoint(tmp_path, original, {}, config())
    (tmp_path / "model.safetensors").symlink_to(original / "model.safetensors")
    with pytest.raises(ValueError, match=r"(?i)support") as raised:
        load_model(tmp_path, "cpu", torch.float32)
    assert word in str(raised.value), str(raised.value)
