"""FP8 experts through the doors: `batchllm run --quantization fp8` and `LLM(quantization="fp8")` on a MoE
checkpoint, and the weight bytes the dry run and the run estimate count for it.

The model: test_moe's tiny Qwen3-MoE with the default model's vocabulary and tokenizer (the CLI reads text).
Whether `quantization="fp8"` computes the right thing on a MoE model is test_moe's FP8 test (against HF); here
the CLI's output must be `LLM(quantization="fp8")`'s, which the fixture checks differs from the float32 model's,
so a door that dropped the flag would fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchllm import LLM, SamplingParams
from batchllm.connectors.jobs.engine_preview import preview_engine
from batchllm.connectors.jobs.run_estimate import weight_bytes
from batchllm.entrypoints.cli.main import main
from batchllm.model.default_model import default_model_path
from batchllm.model.loader import load_model
from batchllm.model.size import model_size
from tests.e2e.conftest import QUESTIONS
from tests.e2e.test_moe import FAMILIES
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

E4M3 = torch.float8_e4m3fn
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
ENGINE = dict(device="cpu", num_kv_blocks=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def moe_with_tokenizer(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-moe-tokenizer")
    tokenizer = default_model_path()
    vocab_size = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    config = FAMILIES["qwen3-moe"]()
    config.vocab_size, config.tie_word_embeddings = vocab_size, True
    save_tiny_checkpoint(config, directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, directory)
    return directory


@pytest.fixture(scope="module")
def fp8_texts(moe_with_tokenizer) -> list[str]:
    llm = LLM(str(moe_with_tokenizer), quantization="fp8", **ENGINE)
    experts = llm.runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == E4M3
    texts = [out.outputs[0].text for out in llm.generate(QUESTIONS, GREEDY, use_tqdm=False)]
    float32 = [out.outputs[0].text for out in LLM(str(moe_with_tokenizer), **ENGINE).generate(QUESTIONS, GREEDY,
                                                                                              use_tqdm=False)]
    assert texts != float32  # else equal outputs could not tell whether the CLI applied the flag
    return texts


def test_the_cli_flag_reaches_the_moe_engine(moe_with_tokenizer, fp8_texts, tmp_path, capsys) -> None:
    pq.write_table(pa.table({"q": QUESTIONS}), tmp_path / "in.parquet")
    run = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--model", str(moe_with_tokenizer),
           "--prompt-column", "q", "--max-tokens", str(MAX_NEW), "--temperature", "0", "--no-progress"]
    assert main([*run, "--quantization", "fp8", "--dry-run"]) == 0
    assert "GB as float32 with 8-bit linear weights (experts included) on cpu" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    assert main([*run, "--quantization", "fp8"]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "out").to_pydict()["generated_text"] == fp8_texts


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_weight_bytes_counted_are_the_bytes_the_engine_holds(moe_with_tokenizer, quantization) -> None:
    """The dry run's and the run estimate's weight bytes (config only) against the parameters `load_model`
    actually builds: the experts and linear layers at one byte per weight under FP8, the router, norms and
    embeddings in float32; the per-row float32 scales are the only bytes left out."""
    model, config = load_model(moe_with_tokenizer, "cpu", torch.float32, quantization=quantization)
    held = {name: param.numel() * param.element_size() for name, param in model.named_parameters()}
    scales = sum(size for name, size in held.items() if name.endswith("weight_scale"))
    e4m3 = sum(param.numel() for param in model.parameters() if param.dtype == E4M3)
    preview = preview_engine(str(moe_with_tokenizer), {"quantization": quantization, "device": "cpu"})
    size = model_size(config)
    if quantization == "fp8":
        assert size.linear == e4m3 and scales > 0
    assert weight_bytes(size, preview) == sum(held.values()) - scales
