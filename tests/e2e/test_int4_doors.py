"""A 4-bit GPTQ checkpoint (act-order, asymmetric, groups of 32: the hardest layout) through every door: the CLI on
a Parquet table with two data-parallel replicas, an OpenAI batch file and a pandas frame, preemption, chunked
prefill and the prefix cache on the asynchronous loop, LoRA adapters on the quantized layers, and tensor
parallelism splitting packed words, groups and g_idx.

The reference for every door is a plain float32 checkpoint holding the test's own dequantization of the same
weights (tests/unit/int4_writers.py), loaded by the unquantized path: on the CPU, where the 4-bit weights are
dequantized once on load, each door must give its greedy text exactly. The GPU test runs the Triton W4A16 GEMM
against the same dense weights in bf16.

The doors quantize the session's tiny random Llama (tests/conftest.py; the default tokenizer): their point is the
checkpoint reaching the engines, and the reference is exact either way. The LoRA test quantizes the default model,
whose adapters (tests/e2e/conftest.py) it applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

import batchllm
from batchllm import LLM, SamplingParams
from batchllm.entrypoints.cli.main import main
from batchllm.model.default_model import default_model_path
from batchllm.model.loader import load_model
from tests.distributed.test_tensor_parallel import SHAPES, engine, prompts, write_checkpoint
from tests.e2e.conftest import QUESTIONS
from tests.e2e.test_fp8_doors import TP2_COLUMN_ROWS, assert_same_path, load_as_rank
from tests.unit import int4_writers as iw
from tests.unit.test_int4_checkpoints import gptq_case

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
SHARED = "You are a careful assistant. Answer in one short sentence, without any preamble or apology. " * 3
TEXTS = [*QUESTIONS, SHARED + "What is 2 + 2?", SHARED + "Name a color."]
ACT_ORDER_G32 = gptq_case(4, 32, sym=False, act_order=True)


def write_pair(root: Path, original: Path) -> tuple[Path, Path]:
    """(the GPTQ checkpoint, a float32 checkpoint of the test's own dequantization of it) of `original`."""
    weights = load_file(original / "model.safetensors")
    case = ACT_ORDER_G32(root / "gptq", original, weights)
    dense = root / "dense"
    dense.mkdir()
    save_file({name: case.expected(name.removesuffix(".weight")).contiguous()
               if name.removesuffix(".weight") in case.quantized else tensor for name, tensor in weights.items()},
              str(dense / "model.safetensors"), metadata={"format": "pt"})
    iw.write_config(dense, original, None)
    iw.copy_side_files(original, dense)
    return case.directory, dense


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("int4"), tiny_llama_dir)


@pytest.fixture(scope="module")
def dense_texts(pair, tiny_llama_dir) -> list[str]:
    texts = [out.outputs[0].text for out in LLM(pair[1]).generate(TEXTS, GREEDY, use_tqdm=False)]
    original = [out.outputs[0].text for out in LLM(tiny_llama_dir).generate(TEXTS, GREEDY, use_tqdm=False)]
    assert texts != original  # else a door that loaded the original weights could not be told apart
    return texts


def test_the_cli_on_two_replicas_and_a_resume_that_names_the_format(pair, dense_texts, tmp_path, capsys):
    pq.write_table(pa.table({"q": TEXTS}), tmp_path / "in.parquet")
    run = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q", "--model",
           str(pair[0]), "--max-tokens", str(MAX_NEW), "--rows-per-shard", "2", "--no-progress"]
    assert main([*run, "--data-parallel", "2"]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "out").to_pydict()["generated_text"] == dense_texts
    # Naming the checkpoint's own format changes nothing, so the job resumes; naming another is refused.
    (tmp_path / "out" / "part-00002.parquet").unlink()
    assert main([*run, "--quantization", "gptq"]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "out").to_pydict()["generated_text"] == dense_texts
    assert main([*run, "--quantization", "awq"]) == 2
    assert "quant_method='gptq'" in capsys.readouterr().err


def test_an_openai_batch_file_and_a_pandas_frame(pair, dense_texts, tmp_path):
    frame = pd.DataFrame({"q": TEXTS})
    out = batchllm.generate(frame, prompt_column="q", model=str(pair[0]), max_tokens=MAX_NEW, temperature=0,
                            use_tqdm=False)
    assert out["generated_text"].tolist() == dense_texts
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": text, "max_tokens": MAX_NEW, "temperature": 0}})
             for i, text in enumerate(TEXTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=str(pair[0]), use_tqdm=False)
    answers = {a["custom_id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [answers[f"r{i}"]["response"]["body"]["choices"][0]["text"] for i in range(len(TEXTS))] == dense_texts


def test_preemption_chunking_and_the_prefix_cache_on_the_async_loop(pair):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in LLM(pair[1]).generate(TEXTS, params, use_tqdm=False)]
    tight = LLM(pair[0], num_kv_blocks=8, max_num_batched_tokens=16, async_scheduling=True,
                admission_policy="optimistic")
    assert [out.outputs[0].token_ids for out in tight.generate(TEXTS, params, use_tqdm=False)] == expected
    assert tight.stats.num_preemptions > 0 and tight.stats.prefix_cache_hits > 0, tight.stats


def test_lora_adapters_apply_on_the_quantized_layers(loras, prompts, tmp_path):
    """Each adapter's delta on the 4-bit model equals its delta on the dense copy of the same weights."""
    pair = write_pair(tmp_path, default_model_path())
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    requests = [loras["all"], loras["qv"], None]
    got, expected = ([out.outputs[0].token_ids for out in
                      LLM(model, enable_lora=True, max_loras=2).generate(prompts, params, use_tqdm=False,
                                                                         lora_request=requests)]
                     for model in pair)
    assert got == expected


def test_tensor_parallel_ranks_hold_their_words_groups_and_g_idx(tmp_path):
    """Each rank's dequantized weight is exactly its slice of TP=1's, and TP=2 generates TP=1's tokens."""
    gptq, _ = write_pair(tmp_path, write_checkpoint(tmp_path / "float", **SHAPES["gqa-biases"]))
    whole, _ = load_model(gptq, "cpu", torch.float32)
    for rank in range(2):
        for name, module in load_as_rank(gptq, rank, 2).named_modules():
            if not hasattr(module, "dequantized_weight"):
                continue
            full = whole.get_submodule(name).dequantized_weight()
            kind = name.rsplit(".", 1)[-1]
            if kind in TP2_COLUMN_ROWS:
                expected = full[TP2_COLUMN_ROWS[kind](rank)]
            else:  # o_proj, down_proj: this rank's input columns (their groups and g_idx), all outputs
                width = full.shape[1] // 2
                expected = full[:, rank * width:(rank + 1) * width]
            assert torch.equal(module.dequantized_weight(), expected), name
    prompt_list = prompts(SHAPES["gqa-biases"]["vocab_size"])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one, two = ([out.outputs[0].token_ids for out in engine(gptq, tp).generate(prompt_list, params, use_tqdm=False)]
                for tp in (1, 2))
    assert one == two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_w4a16_gemm_follows_the_dense_weights(tmp_path):
    """The Triton GEMM (act-order rows sorted once at load, x permuted per call) against cuBLAS on the same
    dequantized weights, both bf16, on a random Llama: logprobs along the dense model's greedy path (see
    `assert_same_path`)."""
    gptq, dense = write_pair(tmp_path, write_checkpoint(tmp_path / "float", **SHAPES["gqa-biases"]))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompt_list = prompts(SHAPES["gqa-biases"]["vocab_size"])
    expected, got = ([out.outputs[0] for out in LLM(model, device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                                                    num_kv_blocks=64).generate(prompt_list, params, use_tqdm=False)]
                     for model in (dense, gptq))
    assert_same_path(expected, got)


def test_naming_an_integer_format_for_a_float_checkpoint_is_refused_before_loading():
    for method in ("gptq", "awq", "compressed-tensors"):
        with pytest.raises(ValueError, match=f"quantization='{method}' reads {method} checkpoints.*fp8"):
            LLM(quantization=method)
