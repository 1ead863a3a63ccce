"""What a resumed job trusts: every shard file (Parquet) and every region of the output (JSONL) is recorded
with its size and SHA-256 and verified; a damaged one is redone, with a warning, and the output ends up
readable with every row exactly once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq

import batchllm
from batchllm.entrypoints.cli.main import main
from tests.connectors.helpers import GREEDY
from tests.connectors.jobs import read_shards, write_parquet_input

JOB = {"prompt_column": "q", "rows_per_shard": 4, "use_tqdm": False, **GREEDY}


def _records(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()[1:]]


def test_a_damaged_parquet_shard_is_redone(tmp_path, capsys, llm):
    write_parquet_input(tmp_path / "in", [10])
    output = tmp_path / "out"
    batchllm.run_job(tmp_path / "in", output, **JOB)
    before = read_shards(output)
    for record in _records(output / "_manifest.jsonl"):  # the manifest holds each file's true size and hash
        data = (output / record["file"]).read_bytes()
        assert (record["bytes"], record["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())

    with open(output / "part-00001.parquet", "r+b") as file:
        file.truncate(1000)  # `truncate -s 1000`
    data = bytearray((output / "part-00002.parquet").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content
    (output / "part-00002.parquet").write_bytes(bytes(data))
    capsys.readouterr()

    result = batchllm.run_job(tmp_path / "in", output, **JOB)
    warnings = capsys.readouterr().err
    assert "part-00001.parquet is damaged (1000 bytes, the manifest records" in warnings
    assert "part-00002.parquet is damaged (its SHA-256 differs from the manifest's): redoing its rows" in warnings
    assert (result.written_rows, result.resumed_rows) == (6, 4)
    for name in ("part-00000.parquet", "part-00001.parquet", "part-00002.parquet"):
        pq.read_table(output / name)  # readable again
    after = read_shards(output)
    assert sorted(after.column("id").to_pylist()) == list(range(10))  # every row once
    assert after.sort_by("id").equals(before.sort_by("id"))

    (output / "part-00000.parquet").unlink()
    assert batchllm.run_job(tmp_path / "in", output, **JOB).written_rows == 4
    assert "part-00000.parquet is missing: redoing its rows" in capsys.readouterr().err


def _request(i: int) -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": f"Fact number {i}:"}})


def _answers(path: Path) -> dict[str, str]:
    answers = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [a["custom_id"] for a in answers]
    assert len(ids) == len(set(ids)), ids  # exactly once
    return {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers}


def test_a_damaged_jsonl_region_cuts_the_output_back_to_the_last_good_one(tmp_path, capsys, llm):
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("".join(_request(i) + "\n" for i in range(6)))
    options = {"rows_per_shard": 2, "use_tqdm": False, **GREEDY}
    batchllm.run_job(requests, results, **options)
    first = _answers(results)
    manifest = results.with_name("results.jsonl.manifest.jsonl")
    regions = _records(manifest)
    start = 0
    for region in regions:  # regions follow each other and hash what the file holds
        data = results.read_bytes()[start:region["end_offset"]]
        assert (region["bytes"], region["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
        start = region["end_offset"]

    data = bytearray(results.read_bytes())
    cut = regions[0]["end_offset"]
    data[cut + 5] = ord("#")  # inside the second region
    results.write_bytes(bytes(data))
    capsys.readouterr()
    result = batchllm.run_job(requests, results, **options)
    assert f"results.jsonl is damaged from byte {cut}" in capsys.readouterr().err
    assert (result.written_rows, result.resumed_rows) == (4, 2)  # the shards after the damage are redone
    assert _answers(results) == first
    assert results.read_bytes()[:cut] == bytes(data[:cut])


def test_a_corrupted_manifest_line_is_a_usage_error(tmp_path, capsys, llm):
    write_parquet_input(tmp_path / "in", [2])
    command = ["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--max-tokens", "2",
               "--rows-per-shard", "1", "--no-progress"]
    assert main(command) == 0
    manifest = tmp_path / "out" / "_manifest.jsonl"
    lines = manifest.read_text().splitlines()
    lines[2] = lines[2][:40]
    manifest.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"batchllm: error: {manifest} line 3 is not a valid record (invalid JSON")
    assert f"delete {tmp_path / 'out'} to start over, or remove that line to redo its shard" in error
