"""Embeddings through every door: `batchllm.embed` on pandas / Arrow / datasets / lists, the Parquet job (resumed),
an OpenAI batch file's /v1/embeddings lines, `batchllm run --task embed`, and two data-parallel replicas.

The expected vectors are HF transformers' (`AutoModel`, float32): the final hidden states of each text alone,
mean-pooled and normalized, as the default model's directory asks (no sentence-transformers layout: normalized).
Bad rows fail alone, with their error and a null vector.
"""

from __future__ import annotations

import base64
import json

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm.connectors import engine_cache
from batchllm.entrypoints.cli.main import main

DOCS = ["The river runs past the mill.", None, "", "A lighthouse keeper writes letters to the sea.", 7,
        "Short."]
GOOD = [0, 3, 5]  # the others: null, empty, not a string
ENGINE = {"device": "cpu", "task": "embed", "pooling": "mean"}


@pytest.fixture(autouse=True)
def keep_the_packages_engine():
    """The doors below cache an embedding engine; the connectors package shares its default engine through the same
    cache (conftest.py), so it is put back after each test."""
    saved = engine_cache._cached
    yield
    engine_cache._cached = saved


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from batchllm.model.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    hf = AutoModel.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    with torch.inference_mode():
        vectors = [hf(torch.tensor([tokenizer(DOCS[i])["input_ids"]])).last_hidden_state[0].mean(0) for i in GOOD]
    return torch.nn.functional.normalize(torch.stack(vectors), dim=-1).numpy()


def _check(vectors: list, errors: list, expected: np.ndarray) -> None:
    assert [e is None for e in errors] == [i in GOOD for i in range(len(DOCS))], errors
    assert [v is None for v in vectors] == [i not in GOOD for i in range(len(DOCS))]
    np.testing.assert_allclose(np.array([vectors[i] for i in GOOD], np.float32), expected, atol=1e-5)


def test_pandas_arrow_datasets_and_lists(expected):
    frame = pd.DataFrame({"doc": DOCS})
    out = batchllm.embed(frame, text_column="doc", engine_kwargs=ENGINE, use_tqdm=False)
    assert isinstance(out["embedding"].dtype, pd.ArrowDtype)
    assert out["embedding"].dtype.pyarrow_dtype == pa.list_(pa.float32(), 576)
    vectors = pa.array(out["embedding"].array).to_pylist()  # the same Arrow buffer the column holds
    _check(vectors, [None if pd.isna(e) else e for e in out["error"]], expected)
    assert "is null" in out["error"][1] and "must be a string, got int" in out["error"][4]

    table = batchllm.embed(pa.table({"doc": pa.array([d if isinstance(d, str) or d is None else str(d)
                                                      for d in DOCS])}),
                           text_column="doc", engine_kwargs=ENGINE, use_tqdm=False)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 576)
    assert table.column("embedding").null_count == 2  # "7" is text in Arrow: only the null and the empty fail

    dataset = datasets.Dataset.from_dict({"doc": ["The river runs past the mill.", "Short."], "id": [1, 2]})
    embedded = batchllm.embed(dataset, text_column="doc", engine_kwargs=ENGINE, use_tqdm=False)
    np.testing.assert_allclose(np.array(embedded["embedding"], np.float32), expected[[0, 2]], atol=1e-5)
    assert embedded["id"] == [1, 2]

    rows = batchllm.embed(["The river runs past the mill."], engine_kwargs=ENGINE, use_tqdm=False)
    np.testing.assert_allclose(rows[0]["embedding"], expected[0], atol=1e-5)
    with pytest.raises(ValueError, match="samples nothing"):
        batchllm.run_job("unused.parquet", "unused", prompt_column="doc", engine_kwargs=ENGINE, max_tokens=5)


def test_the_parquet_job_resumes_and_the_cli(expected, tmp_path, capsys):
    docs = [d if isinstance(d, str) or d is None else str(d) for d in DOCS]
    pq.write_table(pa.table({"doc": docs}), tmp_path / "in.parquet")
    result = batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="doc", engine_kwargs=ENGINE,
                              rows_per_shard=2, use_tqdm=False)
    assert result.written_rows == 6 and result.output_tokens == 0
    again = batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", prompt_column="doc", engine_kwargs=ENGINE,
                             rows_per_shard=2, use_tqdm=False)
    assert again.resumed_rows == 6 and again.written_rows == 0
    table = pq.read_table(tmp_path / "out")
    assert table.column_names == ["doc", "embedding", "prompt_tokens", "error"]
    got = table.column("embedding").to_pylist()
    np.testing.assert_allclose(np.array([got[i] for i in GOOD], np.float32), expected, atol=1e-5)

    flags = ["--task", "embed", "--text-column", "doc", "--device", "cpu", "--pooling", "mean", "--no-progress"]
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "cli"), *flags]) == 0, capsys.readouterr().err
    assert pq.read_table(tmp_path / "cli").column("embedding").to_pylist() == got
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "bad"), *flags, "--temperature", "0.5"]) == 2
    assert "--task 'embed' samples nothing: temperature does not apply" in capsys.readouterr().err


def test_openai_batch_embeddings(expected, tmp_path):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": "The river runs past the mill.", "model": "m"}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": ["Short."], "encoding_format": "base64"}},
             {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["x", "y"]}},
             {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 8}},
             {"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    batchllm.run_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", engine_kwargs=ENGINE, use_tqdm=False)
    answers = {a["custom_id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    body = answers["a"]["response"]["body"]
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding" and body["usage"]["prompt_tokens"] > 0
    np.testing.assert_allclose(body["data"][0]["embedding"], expected[0], atol=1e-5)
    packed = answers["b"]["response"]["body"]["data"][0]["embedding"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(packed), "<f4"), expected[2], atol=1e-5)
    assert "one line per input" in answers["c"]["error"]["message"]
    assert "this model's embeddings have 576" in answers["d"]["error"]["message"]
    assert "need an engine built with task='generate'" in answers["e"]["error"]["message"]


def test_two_data_parallel_replicas_embed_as_hf_does(expected):
    out = batchllm.embed(pd.DataFrame({"doc": [DOCS[i] for i in GOOD] * 3}), text_column="doc", engine_kwargs=ENGINE,
                         data_parallel_size=2, use_tqdm=False)
    np.testing.assert_allclose(np.array(pa.array(out["embedding"].array).to_pylist(), np.float32),
                               np.concatenate([expected] * 3), atol=1e-5)
