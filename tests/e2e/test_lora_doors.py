"""Multi-LoRA through the other doors: the CLI on a Parquet table (two data-parallel replicas), an OpenAI batch
file whose requests' `model` names the adapter, and a job's manifest pinning the adapters. The expected text is
PEFT's greedy tokens (conftest.py), decoded."""

from __future__ import annotations

import contextlib
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.entrypoints.cli.main import main
from tests.e2e.conftest import MAX_NEW


def _texts(tokenizer, prompts):
    return [tokenizer.decode(p) for p in prompts]


def _expected(tokenizer, peft_greedy, i, name):
    return tokenizer.decode(peft_greedy[(i, name)], skip_special_tokens=True)


def test_the_cli_runs_each_row_under_its_column_adapter_on_two_replicas(adapter_dirs, prompts, peft_greedy,
                                                                        tokenizer, tmp_path, capsys):
    texts = _texts(tokenizer, prompts)
    names = [None, "qv", "all", "mlp", "", "nope", "mlp", "qv"]
    rows = [i % len(texts) for i in range(len(names))]
    pq.write_table(pa.table({"q": [texts[i] for i in rows], "adapter": names}), tmp_path / "in.parquet")
    flags = [arg for name, path in adapter_dirs.items() for arg in ("--lora", f"{name}={path}")]
    code = main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q",
                 "--lora-column", "adapter", *flags, "--max-loras", "2", "--max-tokens", str(MAX_NEW),
                 "--data-parallel", "2", "--rows-per-shard", "3", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    out = pq.read_table(tmp_path / "out").to_pydict()
    for j, (i, name) in enumerate(zip(rows, names)):
        if name == "nope":
            assert "names 'nope', which is not one of loras= (all, mlp, qv)" in out["error"][j]
        else:
            assert out["generated_text"][j] == _expected(tokenizer, peft_greedy, i, name or None), j


def test_cli_lora_flags_are_checked_before_anything_runs(adapter_dirs, tmp_path, capsys):
    pq.write_table(pa.table({"q": ["hi"], "adapter": ["qv"]}), tmp_path / "in.parquet")
    run = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q"]
    cases = [(["--lora-column", "adapter"], "--lora-column needs the adapters"),
             ([f"--lora=qv={adapter_dirs['qv']}"], "--lora on a table needs --lora-column"),
             (["--lora", "qv", "--lora-column", "adapter"], "expected NAME=PATH"),
             ([f"--lora=big={adapter_dirs['mlp']}", "--lora-column", "adapter", "--max-lora-rank", "8"],
              "'big'.*rank 16 is above --max-lora-rank 8")]
    for flags, message in cases:
        with pytest.raises(SystemExit) if message.startswith("expected") else contextlib.nullcontext():
            assert main([*run, *flags]) == 2  # argparse exits with 2 itself for a malformed value
        assert re.search(message, capsys.readouterr().err), flags
    assert not (tmp_path / "out" / "part-00000.parquet").exists()


def _request(custom_id, text, model=None):
    body = {"prompt": text, "max_tokens": MAX_NEW, "temperature": 0}
    if model is not None:
        body["model"] = model
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def test_an_openai_batch_requests_model_names_its_adapter(adapter_dirs, prompts, peft_greedy, tokenizer, tmp_path):
    texts = _texts(tokenizer, prompts)
    base = batchllm.LLM(enable_lora=True, max_loras=2, max_lora_rank=16)
    models = [None, "qv", base.model_path.name, "all", "mlp", "gpt-4o"]
    (tmp_path / "in.jsonl").write_text("\n".join(_request(f"r{j}", texts[j % 3], m) for j, m in enumerate(models)))
    mine = tmp_path / "qv"  # a copy, retrained below
    mine.mkdir()
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        (mine / file).write_bytes((adapter_dirs["qv"] / file).read_bytes())
    loras = {**{name: str(path) for name, path in adapter_dirs.items()}, "qv": str(mine)}
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm=base, loras=loras, use_tqdm=False)
    answers = {line["custom_id"]: line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for j, model in enumerate(models[:5]):
        name = model if model in loras else None
        body = answers[f"r{j}"]["response"]["body"]
        assert body["choices"][0]["text"] == _expected(tokenizer, peft_greedy, j % 3, name), model
        assert body["model"] == (name or base.model_path.name)
    assert "model 'gpt-4o' is neither the base model" in answers["r5"]["error"]["message"]

    # The manifest pins the adapters' contents: resuming with a retrained adapter under the same path is refused.
    settings = json.loads((mine / "adapter_config.json").read_text())
    (mine / "adapter_config.json").write_text(json.dumps({**settings, "lora_alpha": 7}))
    with pytest.raises(ManifestMismatch, match="adapters"):
        batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm=base, loras=loras, use_tqdm=False)
