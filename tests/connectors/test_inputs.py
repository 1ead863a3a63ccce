"""Job inputs other than Parquet: CSV and JSON-lines tables, how "auto" tells them from OpenAI batch files,
clear errors for files that are not what they claim, and the refusal of a file-like output path."""

from __future__ import annotations

import json

import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pytest

import batchllm
from batchllm.connectors.jobs import sources
from batchllm.connectors.jobs.sources import TextTableSource, input_format_of
from batchllm.entrypoints.cli.main import main
from tests.connectors.helpers import GREEDY, reference_texts
from tests.connectors.jobs import read_shards

PROMPTS = ["The capital of France is", "Cats, dogs and", "One, two,"]
CSV_TEXT = 'id,q,note\n0,The capital of France is,a\n1,"Cats, dogs and",\n2,"One, two,",c\n'
JSONL_TEXT = "".join(json.dumps({"id": i, "q": q, "meta": {"n": i}}) + "\n" for i, q in enumerate(PROMPTS))
REQUEST = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if anything would build an engine: these errors must come before any generation."""
    monkeypatch.setattr("batchllm.connectors.replicas.data_parallel.get_llm", pytest.fail)


@pytest.mark.parametrize("name, text", [("questions.csv", CSV_TEXT), ("questions.jsonl", JSONL_TEXT)])
def test_tables_run_as_resumable_jobs(tmp_path, llm, name, text):
    (tmp_path / name).write_text(text)
    job = {"prompt_column": "q", "rows_per_shard": 2, "use_tqdm": False, "llm": llm, **GREEDY}
    result = batchllm.run_job(tmp_path / name, tmp_path / "out", **job)
    assert (result.total_rows, result.num_shards, result.error_rows) == (3, 2, 0)

    table = read_shards(tmp_path / "out")
    assert table.column("id").to_pylist() == [0, 1, 2]
    assert table.column("q").to_pylist() == PROMPTS
    assert table.column("generated_text").to_pylist() == reference_texts(llm, PROMPTS)
    if name.endswith(".csv"):
        assert table.column("note").to_pylist() == ["a", "", "c"]
    else:
        assert table.column("meta").to_pylist() == [{"n": 0}, {"n": 1}, {"n": 2}]

    again = batchllm.run_job(tmp_path / name, tmp_path / "out", **job)
    assert (again.resumed_rows, again.written_rows) == (3, 0)


def test_auto_tells_batch_request_files_from_tables(tmp_path):
    cases = {"requests.jsonl": "\n" + json.dumps(REQUEST) + "\n", "empty.jsonl": "",
             "table.jsonl": JSONL_TEXT, "table.json": JSONL_TEXT, "t.csv": CSV_TEXT,
             "custom_id_only.jsonl": json.dumps({"custom_id": "a", "q": "x"}) + "\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    detected = {name: input_format_of(tmp_path / name) for name in cases}
    assert detected == {"requests.jsonl": "openai-batch", "empty.jsonl": "openai-batch",
                        "table.jsonl": "jsonl-table", "table.json": "jsonl-table", "t.csv": "csv",
                        "custom_id_only.jsonl": "jsonl-table"}
    (tmp_path / "dir").mkdir()
    assert input_format_of(tmp_path / "dir") == input_format_of(tmp_path / "*.parquet") == "parquet"
    assert input_format_of(tmp_path / "table.jsonl", "openai-batch") == "openai-batch"
    with pytest.raises(ValueError, match="input_format must be one of auto, parquet, csv"):
        input_format_of(tmp_path / "t.csv", "tsv")


@pytest.mark.parametrize("name, text, input_format, message", [
    ("bad.csv", "id,q\n0,a\n1,b,extra\n", "auto", "bad.csv cannot be read as CSV: .*Expected 2 columns, got 3"),
    ("bad.jsonl", '{"q": "a"}\n{"q": \n', "auto", "bad.jsonl cannot be read as a JSON-lines table"),
    ("array.json", '[{"q": "a"}, {"q": "b"}]\n', "auto", "array.json cannot be read as a JSON-lines table"),
    ("notes.parquet", "id,q\n0,a\n", "auto", "notes.parquet cannot be read as Parquet"),
    ("table.csv", "id,q\n0,a\n", "parquet", "table.csv cannot be read as Parquet"),
    ("latin1.csv", b"id,q\n0,caf\xe9\n", "auto", r"latin1.csv cannot be read as CSV: columns \['q'\] are not valid"),
])
def test_files_that_do_not_parse_as_their_format_name_both(tmp_path, no_engine, name, text, input_format, message):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message):
        batchllm.run_job(path, tmp_path / "out", prompt_column="q", input_format=input_format)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output", ["answers.parquet", "answers.jsonl", "answers.CSV"])
def test_a_file_like_output_path_for_a_table_job_is_refused(tmp_path, no_engine, output):
    (tmp_path / "t.csv").write_text(CSV_TEXT)
    refusal = r"is a directory of Parquet shards; pass a directory path, e\.g\. '.*/answers'"
    with pytest.raises(ValueError, match=refusal):
        batchllm.run_job(tmp_path / "t.csv", tmp_path / output, prompt_column="q")
    assert not (tmp_path / output).exists()


def test_column_types_that_change_after_the_first_block_are_read_from_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_BLOCK_BYTES", 64)  # many blocks; the first holds only numeric ids
    rows = [f"{i},prompt number {i}" for i in range(40)] + ["x7,a late text id"]
    (tmp_path / "t.csv").write_text("id,q\n" + "\n".join(rows) + "\n")
    lines = [json.dumps({"id": i, "q": f"p{i}"}) for i in range(40)] + [json.dumps({"id": 40, "q": "p", "late": 1})]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")

    for name, whole_file in (("t.csv", pa_csv.read_csv), ("t.jsonl", pa_json.read_json)):
        expected = whole_file(tmp_path / name)  # pyarrow's own reading of the whole file
        source = TextTableSource(tmp_path / name, "csv" if name.endswith(".csv") else "jsonl-table")
        batches = list(source.batches(7, lambda start, end: False))
        assert source.schema == expected.schema and source.total_rows == expected.num_rows == 41
        sizes = [batch.num_rows for _, batch in batches]
        assert max(sizes) <= 7 and [start for start, _ in batches] == [sum(sizes[:i]) for i in range(len(sizes))]
        assert [row for _, batch in batches for row in batch.to_pylist()] == expected.to_pylist()


def test_skipped_ranges_are_left_out_but_positions_stay_exact(tmp_path):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)))
    source = TextTableSource(tmp_path / "t.jsonl", "jsonl-table")
    kept = [(start, batch.column("i").to_pylist()) for start, batch in source.batches(3, lambda a, b: a < 3)]
    assert kept == [(3, [3, 4, 5]), (6, [6, 7, 8]), (9, [9])]


def test_cli_reads_a_jsonl_table_and_takes_input_format(tmp_path, llm, capsys):
    (tmp_path / "table.jsonl").write_text(JSONL_TEXT)
    base = ["run", str(tmp_path / "table.jsonl"), str(tmp_path / "out"), "--prompt-column", "q"]
    tiny = ["--max-tokens", "4", "--temperature", "0", "--no-progress"]
    assert main([*base, *tiny]) == 0
    assert read_shards(tmp_path / "out").column("generated_text").to_pylist() == reference_texts(llm, PROMPTS)

    assert main([*base, "--input-format", "openai-batch", *tiny]) == 2
    assert "do not apply to an OpenAI batch file" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "table.jsonl"), str(tmp_path / "out.parquet"), "--prompt-column", "q"]) == 2
    assert "is a directory of Parquet shards" in capsys.readouterr().err
