"""Shared settings and references for the connector tests."""

from __future__ import annotations

import json
from pathlib import Path

from batchllm import SamplingParams

# Tiny greedy settings: the real model on 2 CPU cores.
GREEDY = {"max_tokens": 4, "temperature": 0}


def reference_texts(llm, prompts: list[str], **fields) -> list[str]:
    """The facade's greedy text for each prompt: the ground truth for the connectors."""
    params = SamplingParams(**{**GREEDY, **fields})
    return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]


def openai_batch_texts(directory: Path, texts: list[str], max_tokens: int, engine_kwargs: dict) -> list[str]:
    """Each text as a greedy /v1/completions line of an OpenAI batch file run by `batchllm.run_job` with
    `engine_kwargs`; the answers' texts in input order."""
    import batchllm

    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
             for i, text in enumerate(texts)]
    (directory / "in.jsonl").write_text("\n".join(lines) + "\n")
    batchllm.run_job(directory / "in.jsonl", directory / "out.jsonl", engine_kwargs=engine_kwargs, use_tqdm=False)
    answers = {a["custom_id"]: a for a in map(json.loads, (directory / "out.jsonl").read_text().splitlines())}
    return [answers[f"r{i}"]["response"]["body"]["choices"][0]["text"] for i in range(len(texts))]
