"""Helpers of the door tests (`test_*_doors.py`): the same prompts through another door."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import batchllm
from batchllm.entrypoints.cli.main import main


def parquet_job_texts(tmp_path: Path, model: str, texts: list[str], max_tokens: int, flags: list[str]) -> list[str]:
    """Each text's completion through `batchllm run` on a Parquet table, two data-parallel replicas of the engine
    that `flags` ask for, two rows a shard; the table is `tmp_path / "in.parquet"`, the output `tmp_path / "out"`."""
    pq.write_table(pa.table({"q": texts}), tmp_path / "in.parquet")
    run = ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--prompt-column", "q", "--model", model,
           "--max-tokens", str(max_tokens), "--rows-per-shard", "2", "--no-progress", *flags, "--data-parallel", "2"]
    assert main(run) == 0, "batchllm run failed (its error is in the captured stderr)"
    return pq.read_table(tmp_path / "out").to_pydict()["generated_text"]


def batch_file_texts(tmp_path: Path, model: str, texts: list[str], engine_kwargs: dict[str, Any],
                     **body: Any) -> list[str]:
    """Each text's completion through an OpenAI batch file (`batchllm.run_job`, /v1/completions), `body` the
    request's other fields (max_tokens, temperature, ...), in the texts' order."""
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": text, **body}}) for i, text in enumerate(texts)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=model, engine_kwargs=engine_kwargs,
                     use_tqdm=False)
    answers = {a["custom_id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    return [answers[f"r{i}"]["response"]["body"]["choices"][0]["text"] for i in range(len(texts))]
