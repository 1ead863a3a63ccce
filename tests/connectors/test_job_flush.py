"""One runaway row cannot hold a job: output tokens per row are capped, and the finished rows of an unfinished
shard are checkpointed every `flush_seconds`, so after a kill -9 (or a crash) the resumed job runs none of
them again and the output holds every row exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import batchllm
from batchllm.connectors.jobs.manifest import ManifestMismatch
from batchllm.entrypoints.cli.main import main
from tests.connectors.helpers import reference_texts
from tests.connectors.jobs import read_shards, write_parquet_input


def _checkpointed(manifest: Path) -> list[int]:
    """Offsets in shard 0 held by checkpoint records, read from the manifest's JSON lines."""
    if not manifest.exists():
        return []
    records = [json.loads(line) for line in manifest.read_text().splitlines()[1:] if line.endswith("}")]
    assert not any(r["complete"] for r in records), "the shard completed before the test could interrupt it"
    return [offset for r in records for start, end in r["ranges"] for offset in range(start, end)]


def _engine_rows(llm, monkeypatch, crash_when=None) -> list[int]:
    """Rows of shard 0 sent to the engine; `crash_when()` true after a result: the job dies there."""
    stream, ran = type(llm).stream, []

    def recording(requests, **kwargs):
        for key, output in stream(llm, requests, **kwargs):
            ran.append(key[1])
            yield key, output
            deadline = time.monotonic() + 60
            while crash_when is not None and len(ran) >= 2 and time.monotonic() < deadline:
                if crash_when():
                    raise RuntimeError("the machine went away")
                time.sleep(0.02)

    monkeypatch.setattr(llm, "stream", recording)
    return ran


def test_max_tokens_are_capped_for_every_row(tmp_path, llm):
    write_parquet_input(tmp_path / "in", [2])
    job = {"prompt_column": "q", "max_tokens": 50, "max_tokens_cap": 2, "temperature": 0, "use_tqdm": False}
    batchllm.run_job(tmp_path / "in", tmp_path / "out", **job)
    shards = read_shards(tmp_path / "out")
    assert shards.column("generated_text").to_pylist() == reference_texts(llm, shards.column("q").to_pylist(),
                                                                          max_tokens=2)
    with pytest.raises(ManifestMismatch, match="max_tokens_cap: was 2, now 3"):
        batchllm.run_job(tmp_path / "in", tmp_path / "out", **{**job, "max_tokens_cap": 3})

    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": "Once upon a time", "max_tokens": limit}}) + "\n"
                                for i, limit in enumerate([100000, None])))  # more than the model's length; null
    batchllm.run_job(requests, results, max_tokens_cap=2, temperature=0, use_tqdm=False)
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    assert [a["error"] for a in answers] == [None, None]  # capped, not refused
    assert [a["response"]["body"]["choices"][0]["text"] for a in answers] == reference_texts(
        llm, ["Once upon a time"] * 2, max_tokens=2)


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens-cap", "0"], "error: --max-tokens-cap must be an int >= 1, got 0"),
    (["--flush-seconds", "0"], "error: --flush-seconds must be a number > 0, got 0.0"),
])
def test_bad_job_limits_are_usage_errors(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", pytest.fail)
    write_parquet_input(tmp_path / "in", [1])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", *flags]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_tokens_cap must be an int >= 1, got None"):
        batchllm.run_job(tmp_path / "in", tmp_path / "out", prompt_column="q", max_tokens_cap=None)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return batchllm.LLM(tiny_llama_dir, device="cpu", num_kv_blocks=KV_BLOCKS)


# The kill test runs on the session's tiny Llama (its point is the checkpoints, not the weights). Its steps cost
# ~1-3 ms, so each row asks for more tokens (EOS ignored) to keep the shard unfinished for a second or more; its KV
# cache is given what the job needs (by default 65,536 blocks, 512 MB, in every process).
TINY_TOKENS = 40
KV_BLOCKS = 64


def test_rows_checkpointed_before_a_kill_are_not_run_again(tmp_path, monkeypatch, tiny_llama_dir, tiny):
    llm = tiny
    table = write_parquet_input(tmp_path / "in", [12])
    output, log = tmp_path / "out", tmp_path / "job.log"
    # One shard that takes many engine steps: rows one at a time, checkpointed every 0.1 s.
    command = [sys.executable, "-m", "batchllm", "run", str(tmp_path / "in"), str(output), "--prompt-column", "q",
               "--model", str(tiny_llama_dir), "--num-kv-blocks", str(KV_BLOCKS), "--ignore-eos",
               "--max-tokens", str(TINY_TOKENS), "--rows-per-shard", "100", "--max-in-flight", "1",
               "--flush-seconds", "0.1"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not _checkpointed(output / "_manifest.jsonl"):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    saved = _checkpointed(output / "_manifest.jsonl")
    assert 0 < len(saved) < 12 and not list(output.glob("part-*.parquet"))

    ran = _engine_rows(llm, monkeypatch)
    result = batchllm.run_job(tmp_path / "in", output, llm=llm, prompt_column="q", max_tokens=TINY_TOKENS,
                              ignore_eos=True, temperature=0, rows_per_shard=100, use_tqdm=False)
    assert sorted(ran) == sorted(set(range(12)) - set(saved))  # nothing saved was run again
    assert (result.resumed_rows, result.written_rows) == (len(saved), 12 - len(saved))
    shards = read_shards(output)
    assert shards.column("id").to_pylist() == list(range(12))  # every row once, in input order
    assert shards.column("generated_text").to_pylist() == reference_texts(llm, table.column("q").to_pylist(),
                                                                          max_tokens=TINY_TOKENS, ignore_eos=True)
    assert sorted(p.name for p in output.iterdir()) == ["_manifest.jsonl", "part-00000.parquet"]


def test_jsonl_lines_checkpointed_before_a_crash_are_not_run_again(tmp_path, monkeypatch, llm):
    prompts = [f"Fact number {i}:" for i in range(5)]
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": p}}) + "\n" for i, p in enumerate(prompts)))
    manifest = tmp_path / "results.jsonl.manifest.jsonl"
    job = {"rows_per_shard": 10, "max_in_flight": 1, "max_tokens": 3, "temperature": 0, "use_tqdm": False}
    _engine_rows(llm, monkeypatch, crash_when=lambda: len(_checkpointed(manifest)) >= 2)
    with pytest.raises(RuntimeError, match="the machine went away"):
        batchllm.run_job(requests, results, flush_seconds=0.05, **job)
    saved = _checkpointed(manifest)
    assert len(saved) >= 2 and len(results.read_text().splitlines()) == len(saved)

    ran = _engine_rows(llm, monkeypatch)
    batchllm.run_job(requests, results, **job)
    assert sorted(ran) == sorted(set(range(5)) - set(saved))
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers) == [f"r{i}" for i in range(5)]  # each exactly once
    texts = {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers}
    assert [texts[f"r{i}"] for i in range(5)] == reference_texts(llm, prompts, max_tokens=3)
