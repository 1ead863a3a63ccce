"""`batchllm run --dry-run`: rows, prompt tokens and errors as a run would have them, with no weights loaded and
nothing written; the engine checks it makes without an engine; the model size and the run-time estimate."""

from __future__ import annotations

import functools
import json
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from transformers import AutoTokenizer

from batchllm.connectors import engine_cache
from batchllm.connectors.jobs.engine_preview import preview_engine
from batchllm.connectors.jobs.run_estimate import Machine, Workload, estimate_run, machine_for
from batchllm.entrypoints.cli.main import main
from batchllm.entrypoints.llm import LLM
from batchllm.model.config import ModelConfig
from batchllm.model.default_model import default_model_path
from batchllm.model.size import model_size
from tests.connectors.jobs import read_shards

QUESTIONS = ["What is two plus two?", "Name a color.", None, "Why is the sky blue? Answer in one sentence."]


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to build an engine or read a weight fails the test."""
    @functools.wraps(LLM.__init__)  # LLM's signature stays readable: the preview takes its defaults from it
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run built an engine or read weights")

    monkeypatch.setattr(LLM, "__init__", refuse)
    monkeypatch.setattr("batchllm.executor.model_runner.load_model", refuse)  # imported before it is patched
    monkeypatch.setattr("batchllm.model.loader.safe_open", refuse)
    monkeypatch.setattr("batchllm.connectors.engine_cache.get_llm", refuse)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def _chat_tokens(tokenizer, content: str) -> int:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fact(output: str, label: str) -> str:
    return re.search(rf"^{label}: +(.*)$", output, re.M)[1]


def test_parquet_dry_run_counts_rows_and_prompt_tokens_as_the_tokenizer_does(tmp_path, capsys, no_weights,
                                                                              tokenizer):
    pq.write_table(pa.table({"q": QUESTIONS}), tmp_path / "in.parquet")
    status = main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q", "--chat",
                   "--max-tokens", "20", "--dry-run"])
    out = capsys.readouterr().out
    assert status == 1  # a row would fail
    expected = sum(_chat_tokens(tokenizer, q) for q in QUESTIONS if q is not None)
    assert _fact(out, "prompt tokens").startswith(f"{expected:,} ")
    assert _fact(out, "rows") == "3 would run, 1 would fail"
    assert _fact(out, "output tokens").startswith("at most 60 ")
    assert "  row 2: prompt column 'q' is null\n" in out
    assert "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n" in out  # the chat template, rendered
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]  # no output directory, no file


def test_openai_batch_dry_run_counts_requests_as_the_tokenizer_does(tmp_path, capsys, no_weights, tokenizer):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 7}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time"}},
             {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "again"}}]
    (tmp_path / "requests.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n")
    status = main(["run", str(tmp_path / "requests.jsonl"), str(tmp_path / "results" / "out.jsonl"), "--max-tokens",
                   "5", "--dry-run"])
    out = capsys.readouterr().out
    assert status == 1
    expected = _chat_tokens(tokenizer, "Hello there") + len(tokenizer("Once upon a time")["input_ids"])
    assert _fact(out, "prompt tokens").startswith(f"{expected:,} ")
    assert _fact(out, "lines") == "2 would run, 2 would fail"
    assert _fact(out, "output tokens").startswith("at most 12 ")  # the request's 7, the job's default 5
    assert "  line 3: custom_id 'a' was already used on line 1\n" in out
    assert "  line 4: invalid JSON" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]


def test_embedding_dry_run(tmp_path, capsys, no_weights, tokenizer):
    pq.write_table(pa.table({"text": ["a short text", "another one, a little longer"]}), tmp_path / "in.parquet")
    status = main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--text-column", "text", "--task",
                   "embed", "--dry-run"])
    out = capsys.readouterr().out
    assert status == 0
    expected = sum(len(ids) for ids in tokenizer(["a short text", "another one, a little longer"])["input_ids"])
    assert _fact(out, "prompt tokens").startswith(f"{expected:,} ")
    hidden = transformers.AutoConfig.from_pretrained(default_model_path()).hidden_size
    assert _fact(out, "vectors") == f"one of {hidden:,} floats per row (embed), nothing generated"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [
    ["--prompt-column", "nope"],
    ["--prompt-column", "q", "--temperature", "-1"],
    ["--prompt-column", "q", "--dtype", "float64"],
    ["--prompt-column", "q", "--model", "/nonexistent/model"],
    ["--prompt-column", "q", "--model", "UNSUPPORTED"],
    ["--prompt-column", "q", "--max-num-seqs", "0"],
    ["--prompt-column", "q", "--max-tokens", "9000", "--max-tokens-cap", "9000"],
])
def test_a_refused_call_says_what_the_run_says(tmp_path, capsys, monkeypatch, args):
    # A run asking for another engine drops the cached one: the tests after this one get the default one back.
    monkeypatch.setattr(engine_cache, "_cached", engine_cache._cached)
    if "UNSUPPORTED" in args:  # the default model's config and tokenizer, under an architecture nobody implements
        model = tmp_path / "model"
        model.mkdir()
        config = json.loads((default_model_path() / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "architectures": ["NopeForCausalLM"]}))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).write_bytes((default_model_path() / name).read_bytes())
        args = [str(model) if arg == "UNSUPPORTED" else arg for arg in args]
    pq.write_table(pa.table({"q": QUESTIONS}), tmp_path / "in.parquet")
    command = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), *args]
    assert main([*command, "--dry-run"]) == 2
    refused = capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(command) == 2
    assert capsys.readouterr().err == refused
    assert refused.startswith("batchllm: error: ") and refused.count("\n") == 1


def test_rows_that_would_fail_carry_the_errors_a_run_saves(tmp_path, capsys, llm):
    pq.write_table(pa.table({"q": ["Say hi.", None, "   ", "Count to three."]}), tmp_path / "in.parquet")
    command = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q", "--max-tokens",
               "1", "--no-progress"]
    assert main([*command, "--dry-run"]) == 1
    listed = dict(re.findall(r"^  row (\d+): (.*)$", capsys.readouterr().out, re.M))
    assert main(command) == 0
    saved = read_shards(tmp_path / "out").column("error").to_pylist()
    assert listed == {str(row): error for row, error in enumerate(saved) if error is not None}
    assert len(listed) == 2


@pytest.mark.parametrize("kwargs", [
    {"dtype": "float64"}, {"device": "tpu"}, {"max_num_seqs": 0}, {"block_size": 12}, {"swap_space": -1},
    {"preemption_mode": "swap"}, {"max_lora_rank": 0}, {"task": "nope"}, {"kv_cache_dtype": "int8"},
    {"quantization": "gptq"}, {"structured_outputs_backend": "outlines"}, {"max_model_len": 1},
    {"pipeline_parallel_size": 2, "enable_lora": True}, {"disaggregated": {"prefill": 1, "decode": 1}, "task": "embed"},
    {"model": "/nonexistent/model"},
])
def test_the_engine_preview_refuses_what_llm_refuses_with_its_message(kwargs):
    """Each of these fails `LLM(...)` before it loads a weight: the preview must fail the same way."""
    kwargs = dict(kwargs)
    model = kwargs.pop("model", None)
    with pytest.raises(Exception) as by_llm:
        LLM(model, **kwargs)
    with pytest.raises(type(by_llm.value)) as by_preview:
        preview_engine(model, kwargs)
    assert str(by_preview.value) == str(by_llm.value)


@pytest.mark.parametrize("family, extra", [
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    ("llama", {"architectures": ["LlamaForSequenceClassification"], "num_labels": 3}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 24}),
])
def test_the_parameter_count_from_the_config_equals_hf_models(family, extra):
    config = transformers.AutoConfig.for_model(family, vocab_size=128, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=256, **extra)
    classify = "architectures" in extra
    hf_class = transformers.AutoModelForSequenceClassification if classify else transformers.AutoModelForCausalLM
    hf_model = hf_class.from_config(config)
    assert model_size(ModelConfig.from_hf_dict(config.to_dict())).parameters == hf_model.num_parameters()


def test_the_estimate_by_hand():
    """A 1-layer model (hidden 8, MLP 16, 2 heads and 2 KV heads of 4, vocab 10, tied)."""
    config = ModelConfig("LlamaForCausalLM", 8, 16, 1, 2, 2, 4, 10, 1e-6, 1e4, 64, 64, tie_word_embeddings=True)
    size = model_size(config)
    assert (size.layers, size.head) == (4 * 8 * 8 + 3 * 8 * 16 + 2 * 8, 10 * 8) == (656, 80)
    engine = SimpleNamespace(model_config=config, pooling_params=None, linear_weight_bits=16, dtype_bytes=2,
                             kv_cache_dtype="auto", max_num_batched_tokens=4, max_num_seqs=2, kv_cache_tokens=None)
    work = Workload()
    for _ in range(3):
        work.add(prompt_tokens=2, samples=1, max_output_tokens=4)
    machine = Machine("test", flops=1e6, bandwidth=1e5, kv_bandwidth=2e4, step_seconds=0.01, sequence_seconds=0.001,
                      devices=1)
    estimate = estimate_run(work, engine, machine)
    # Weights: (656 + 80) * 2 = 1,472 bytes. Prefill: 6 tokens in 2 steps of at most 4; FLOPs 2*656*6 + attention
    # 2*1*8*(3 * 2**2) + head 2*80*3 = 8,544 -> 8.5 ms, under the 2 * 1,472 bytes read -> 29.44 ms; host: 2 steps
    # and 3 sequences.
    assert estimate.prefill_seconds == pytest.approx(0.02944 + 2 * 0.01 + 3 * 0.001)
    # Decode: 12 tokens, 2 sequences at once -> 6 steps at a mean context of 2 + 4/2 = 4. A step: FLOPs
    # 2 * (2*736 + 4*1*8*4) = 3,200 -> 3.2 ms, under the weights' 1,472 bytes (14.72 ms) and 2*4*(2*1*2*4*2 = 32 bytes
    # of K/V a token) = 256 bytes of K/V at 20 kB/s (12.8 ms); host 10 ms + 2 sequences.
    assert estimate.concurrency == 2
    assert estimate.decode_seconds == pytest.approx(6 * (0.01472 + 0.0128 + 0.01 + 2 * 0.001))


def test_the_machine_from_the_cards_data_sheet(monkeypatch):
    monkeypatch.setattr("batchllm.connectors.jobs.run_estimate.gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    engine = SimpleNamespace(device_type="cuda", dtype_bytes=2, gpus_per_replica=2)
    machine = machine_for(engine, data_parallel_size=3)
    assert (machine.flops, machine.bandwidth, machine.devices) == (989e12 * 0.5, 3.35e12 * 0.6, 6)
    assert machine_for(SimpleNamespace(**{**vars(engine), "dtype_bytes": 4}), 1).flops == 989e12 * 0.5 / 16
