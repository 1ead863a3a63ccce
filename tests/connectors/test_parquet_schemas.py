"""Parquet inputs whose files differ only in string vs large_string, nullability or a pandas index column are
read as one table (cast to the first file's schema); any other difference is still refused."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm.connectors.jobs.sources import ParquetSource
from tests.connectors.helpers import GREEDY, reference_texts
from tests.connectors.jobs import read_shards


def _rows(source: ParquetSource) -> list[dict]:
    return [row for _, batch in source.batches(100, lambda start, end: False) for row in batch.to_pylist()]


def _write_mixed(directory):
    """part-0 by pyarrow (string, a non-null id), part-1 by pandas (large_string, nulls, an index column)."""
    directory.mkdir()
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("q", pa.string())])
    pq.write_table(pa.table({"id": [0, 1], "q": ["The capital of France is", "Cats and"]}, schema=schema),
                   directory / "part-0.parquet")
    frame = pd.DataFrame({"id": pd.array([2, None], dtype="Int64"), "q": ["One, two,", "Red, green,"]},
                         index=[7, 3])  # not a range: pandas stores it as __index_level_0__
    frame.to_parquet(directory / "part-1.parquet")
    return schema


def test_string_kinds_nullability_and_a_partial_pandas_index_are_unified(tmp_path):
    first_schema = _write_mixed(tmp_path / "in")
    second = pq.read_schema(tmp_path / "in" / "part-1.parquet")
    assert second.field("q").type == pa.large_string() and "__index_level_0__" in second.names  # what pandas wrote

    source = ParquetSource(tmp_path / "in")

    assert source.schema == pa.schema([pa.field("id", pa.int64(), nullable=True), ("q", pa.string())])
    assert source.schema.field("q").type == first_schema.field("q").type
    assert _rows(source) == [{"id": 0, "q": "The capital of France is"}, {"id": 1, "q": "Cats and"},
                             {"id": 2, "q": "One, two,"}, {"id": None, "q": "Red, green,"}]


def test_a_pandas_index_in_every_file_is_kept(tmp_path):
    (tmp_path / "in").mkdir()
    pd.DataFrame({"q": ["a", "b"]}, index=[5, 1]).to_parquet(tmp_path / "in" / "part-0.parquet")
    pd.DataFrame({"q": ["c"]}, index=[9]).to_parquet(tmp_path / "in" / "part-1.parquet")
    source = ParquetSource(tmp_path / "in")
    assert [(row["q"], row["__index_level_0__"]) for row in _rows(source)] == [("a", 5), ("b", 1), ("c", 9)]


@pytest.mark.parametrize("other", [
    pa.table({"id": pa.array([2], pa.int32()), "q": ["x"]}),  # another integer width
    pa.table({"id": [2], "question": ["x"]}),  # another column name
    pa.table({"id": [2], "q": ["x"], "extra": [1.0]}),  # an extra column
])
def test_other_differences_are_still_refused_naming_both_files(tmp_path, other):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": [0], "q": ["a"]}), tmp_path / "in" / "a.parquet")
    pq.write_table(other, tmp_path / "in" / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet has another schema than .*a\.parquet"):
        ParquetSource(tmp_path / "in")


def test_a_job_over_mixed_files_answers_every_row(tmp_path, llm):
    _write_mixed(tmp_path / "in")
    result = batchllm.run_job(tmp_path / "in", tmp_path / "out", prompt_column="q", rows_per_shard=3, llm=llm,
                              use_tqdm=False, **GREEDY)
    assert (result.total_rows, result.error_rows) == (4, 0)
    table = read_shards(tmp_path / "out")
    prompts = ["The capital of France is", "Cats and", "One, two,", "Red, green,"]
    assert table.column("q").to_pylist() == prompts
    assert table.column("id").to_pylist() == [0, 1, 2, None]
    assert "__index_level_0__" not in table.column_names
    assert table.column("generated_text").to_pylist() == reference_texts(llm, prompts)
    assert len(pd.read_parquet(tmp_path / "out")) == 4  # pandas reads the shards back despite the dropped index
