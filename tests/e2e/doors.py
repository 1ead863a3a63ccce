"""Helpers of the door tests (`test_*_doors.py`): the same prompts through another door."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import batchllm


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
