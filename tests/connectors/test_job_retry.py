"""Mistakes that fail every row are refused up front; the fingerprint knows the tokenizer and its chat template;
`retry_errors` re-runs exactly the failed rows, in place, each row staying in the output exactly once."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.entrypoints.cli.main import main
from tests.connectors.helpers import GREEDY, reference_texts
from tests.connectors.jobs import read_shards, write_parquet_input

JOB = {"prompt_column": "q", "rows_per_shard": 3, "use_tqdm": False, **GREEDY}


def _engine_rows(llm, monkeypatch, failing=frozenset()) -> list[tuple[int, int]]:
    """The (shard, row) of every request the job sends to the engine; those in `failing` fail there."""
    stream, ran = type(llm).stream, []  # the class's: an earlier call's wrapper is replaced, not wrapped

    def recording(requests, **kwargs):
        for key, output in stream(llm, requests, **kwargs):
            ran.append(key[:2])
            if key[:2] in failing:
                output = dataclasses.replace(output, error="injected engine failure", outputs=[])
            yield key, output

    monkeypatch.setattr(llm, "stream", recording)
    return ran


def test_chat_prompts_without_a_chat_template_are_refused_before_generating(tmp_path, capsys, monkeypatch, llm):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    ran = _engine_rows(llm, monkeypatch)
    write_parquet_input(tmp_path / "in", [3])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--chat"]) == 2
    assert f"batchllm: error: the model at {llm.model_path} has no chat template" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing created: a later run starts clean
    with pytest.raises(ValueError, match="has no chat template"):
        batchllm.generate(["Hi"], chat=True, use_tqdm=False, **GREEDY)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"messages": [{"role": "user", "content": "Hi"}]}}) + "\n")
    with pytest.raises(ValueError, match="the 1 /v1/chat/completions requests in requests.jsonl need one"):
        batchllm.run_job(requests, tmp_path / "results.jsonl", use_tqdm=False, **GREEDY)
    assert ran == [] and not (tmp_path / "results.jsonl").exists()


def test_the_chat_template_is_part_of_the_fingerprint(tmp_path, monkeypatch, llm):
    write_parquet_input(tmp_path / "in", [1])
    batchllm.run_job(tmp_path / "in", tmp_path / "out", chat=True, **JOB)
    monkeypatch.setattr(llm.tokenizer, "chat_template", llm.tokenizer.chat_template + "{# edited #}")
    with pytest.raises(ManifestMismatch, match="tokenizer.chat_template_sha256: was"):
        batchllm.run_job(tmp_path / "in", tmp_path / "out", chat=True, **JOB)


def test_retry_errors_reruns_only_failed_parquet_rows_in_place(tmp_path, monkeypatch, llm):
    table = write_parquet_input(tmp_path / "in", [6])
    output = tmp_path / "out"
    _engine_rows(llm, monkeypatch, failing={(0, 1), (1, 2)})  # input rows 1 and 5
    assert batchllm.run_job(tmp_path / "in", output, **JOB).error_rows == 2
    first = read_shards(output)
    assert first.column("error").to_pylist() == [None, "injected engine failure", None, None, None,
                                                 "injected engine failure"]

    ran = _engine_rows(llm, monkeypatch)
    result = batchllm.run_job(tmp_path / "in", output, retry_errors=True, **JOB)
    assert sorted(ran) == [(0, 1), (1, 2)]
    assert (result.written_rows, result.error_rows, result.resumed_rows) == (2, 0, 4)
    assert sorted(p.name for p in output.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]
    assert [pq.read_table(output / f"part-0000{i}.parquet").column("id").to_pylist() for i in (0, 1)] == [
        [0, 1, 2], [3, 4, 5]]  # same files, rows in input order
    after = read_shards(output)
    assert after.column("error").null_count == 6
    texts, before = after.column("generated_text").to_pylist(), first.column("generated_text").to_pylist()
    prompts = table.column("q").to_pylist()
    assert [texts[1], texts[5]] == reference_texts(llm, [prompts[1], prompts[5]])
    assert [texts[i] for i in (0, 2, 3, 4)] == [before[i] for i in (0, 2, 3, 4)]

    ran.clear()
    again = batchllm.run_job(tmp_path / "in", output, retry_errors=True, **JOB)
    assert ran == [] and (again.written_rows, again.resumed_rows) == (0, 6)


def test_retry_errors_answers_failed_jsonl_requests_once(tmp_path, capsys, monkeypatch, llm):
    prompts = [f"Fact number {i}:" for i in range(4)]
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": p}}) + "\n" for i, p in enumerate(prompts)))
    command = ["run", str(requests), str(results), "--rows-per-shard", "2", "--max-tokens", "4", "--no-progress"]
    _engine_rows(llm, monkeypatch, failing={(0, 1), (1, 0)})  # requests r1 and r2
    assert main(command) == 0
    assert sum(json.loads(line)["error"] is not None for line in results.read_text().splitlines()) == 2

    ran = _engine_rows(llm, monkeypatch)
    assert main([*command, "--retry-errors"]) == 0
    assert "2 rows written (0 with errors), 2 already done" in capsys.readouterr().err
    assert sorted(ran) == [(0, 1), (1, 0)]
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["r0", "r1", "r2", "r3"]  # each exactly once
    assert all(a["error"] is None for a in answers)
    texts = {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers}
    assert [texts["r1"], texts["r2"]] == reference_texts(llm, prompts[1:3])
